"""A synthesized schedule as one more candidate: `pipec.synth`'s heuristic (its policy grid, list-scheduled
under the memory limit, then per-rank in-flight limits tuned) on the stage costs and bytes of the best plan
found so far, then that schedule's own split by the partition local search. Why a module of its own: synth
needs fixed stage costs, which depend on the split the planner is choosing, so it runs once, late, on the
incumbent's split (one round of that fixed point); and only where it is cheap (p <= 8)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipec.errors import PipecError
from pipec.partition.problem import Problem
from pipec.planner.bounds import improve
from pipec.planner.space import Candidate
from pipec.sim.memory import CKPT_OF_ACT

SYNTH = "synth"  # the schedule name of the synthesized candidates
MAX_P = 8


def synthesized(pb: Problem, bounds, m: int, limit, budget_s: float) -> tuple[Candidate, Problem] | None:
    """The synthesized candidate at `bounds` of the incumbent's problem `pb` (None when synth finds none in
    `budget_s` seconds or the placement is not one synth makes), with its own Problem."""
    from pipec.passes.compiler import compile_schedule
    from pipec.synth import Spec, heuristic, to_schedule

    p, S = pb.R, pb.S
    place = list(pb.sched.placement)
    if S == p and place == list(range(p)):
        v, placement = 1, "loop"
    elif S % p == 0 and place == [s % p for s in range(S)]:
        v, placement = S // p, "loop"
    elif S == 2 * p and place == [s if s < p else 2 * p - 1 - s for s in range(S)]:
        v, placement = 2, "v"
    else:
        return None
    doc = pb.cost_doc(bounds)
    b = pb.stage_bytes(bounds)
    doc.update(
        saved_bytes=b["act"].tolist(),
        wsaved_bytes=b["wact"].tolist(),
        state_bytes=b["params"].tolist(),
        input_bytes=(b["act"] * CKPT_OF_ACT).tolist(),
    )
    lim = np.asarray(limit, dtype=float)
    spec = Spec(
        p=p,
        m=m,
        v=v,
        placement=placement,
        split=True,
        cost_docs=(*pb.cost_docs, doc),
        # synth's memory model takes one size per kind for every stage (a rank's share): the largest stage's,
        # so what its list scheduler keeps under the limit is under it with each stage's own bytes too
        memory={k: float(b[k].max()) * S / p for k in ("act", "wact", "params")},
        limit=None if np.isnan(lim).all() else tuple(np.where(np.isnan(lim), 1e30, lim).tolist()),
        memops=(),
    )
    try:
        found = heuristic(spec, None, budget_s)
    except PipecError:
        return None
    # its memory declarations are synth's model; the Problem walks the table's bytes (and says if it fits)
    sched = replace(to_schedule(spec, found.derived.orders, SYNTH), memory={})
    program = compile_schedule(sched).program
    return Candidate(SYNTH, m, v if v > 1 else 0), Problem(sched, program, pb.table, pb.speed, pb.limit, pb.cost_docs)


def refine_synthesized(pb: Problem, bounds, deadline: float):
    """The synthesized schedule's best split near the incumbent's (the partition local search), or None."""
    start = pb.evaluate(bounds)
    if not start.fits:
        return None
    best, _ = improve(pb, start, deadline)
    return best
