"""The public entry, `synthesize`: the heuristic, the memory-op candidates under a low limit, then CP-SAT
from the best, each candidate ranked by its simulated figures; `Result` is what it returns. The one
module that runs the phases in order, so each phase's module knows nothing of the others' order."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from pipec.passes.policy import Derived
from pipec.synth.evaluate import Figures, _fits, below_1f1b, evaluate_orders
from pipec.synth.memops import check_floor, least_plan, recompute_candidates, repair, repair_candidates
from pipec.synth.seeds import Candidate, heuristic
from pipec.synth.solver import improve, sim_times, solver_available
from pipec.synth.spec import MemOps, Progress, Spec, _g


@dataclass(frozen=True, eq=False)
class Result:
    spec: Spec
    orders: tuple[tuple[tuple[int, int, int], ...], ...]
    figures: Figures
    heuristic: Candidate
    heuristic_figures: Figures
    solver_status: str
    solver_note: str | None
    bound: float | None
    seconds_heuristic: float
    seconds_solver: float
    memops: MemOps = ()  # per rank, the memory ops the schedule places (pipec.ir.schedule.MemOp)
    floor: tuple[float, ...] | None = None  # per rank, the least memory the search can reach (`memory_floor`)


def synthesize(
    spec: Spec,
    time_limit: float = 30.0,
    use_solver: bool | None = None,
    progress: Progress | None = None,
    max_solver_ops: int = 2000,
) -> Result:
    """Heuristic, then (unless told not to, or the case is too large) CP-SAT from its result; each phase has
    `time_limit` seconds.

    Under a memory limit with memory ops allowed (`Spec.memops`), a limit below the floor (`memory_floor`) is
    E703; the plain policies may all fail (E701 only without memory ops); recomputation seeds join the
    candidates, and the schedule that runs one micro-batch at a time stands when nothing else fits; the solver
    decides per (micro-batch, stage) whether to recompute or offload. Candidates rank by (makespan, memory
    ops, cost): memory ops stay out unless they shorten the step or are needed to fit."""
    from pipec.errors import PipecError

    t0 = time.monotonic()
    memory_ops = bool(spec.memops) and spec.limit is not None
    floor = check_floor(spec) if memory_ops else None
    cands: list[Candidate] = []
    try:
        cands.append(heuristic(spec, progress, budget_s=max(time_limit, 0.0)))
    except PipecError as e:
        if not memory_ops or e.code != "E701":
            raise
        if progress:
            progress("heuristic: no policy fits without memory ops")
    # Memory ops are for limits below 1F1B's memory (or ones no plain policy meets): above it they are not
    # searched, and the search is the one of the plain schedules.
    memory_ops = memory_ops and (not cands or below_1f1b(spec))
    if memory_ops:
        cands += recompute_candidates(spec, progress)
        cands += repair_candidates(spec, [c for c in cands if not c.memops], progress)
    scored: list[tuple[Candidate, Figures, object]] = []
    for c in cands:
        try:
            sim, f = evaluate_orders(spec, c.derived.orders, memops=c.memops)
        except PipecError:  # a seed that pipec's own checks refuse (its memory, by the order model)
            continue
        if _fits(spec, f):
            scored.append((c, f, sim))
    if not scored:
        orders, mops, _ = least_plan(spec)
        sim, f = evaluate_orders(spec, orders, memops=mops)
        seq = Candidate(None, Derived(orders, (), (), f.peak), "sequential", mops, "one micro-batch at a time")
        scored.append((seq, f, sim))
        if progress:
            progress(f"memory ops: makespan {_g(f.makespan)} running one micro-batch at a time")
    best, h_fig, best_sim = min(scored, key=lambda x: x[1].key3)
    t_h = time.monotonic() - t0
    orders, memops, fig = best.derived.orders, best.memops, h_fig
    n_ops = spec.num_stages * spec.m * (3 if spec.split else 2)
    status, note, bound, t_s = "skipped", None, None, 0.0
    why = solver_available() if use_solver is not False else None  # (importing OR-Tools takes seconds)
    if use_solver is False:
        note = "solver not asked for (--no-solver)"
    elif why is not None:
        status, note = "unavailable", why
    elif use_solver is None and n_ops > max_solver_ops:
        note = f"solver skipped: {n_ops} ops is above {max_solver_ops} (use --solver to force it)"
    elif time_limit <= 0:
        note = "solver skipped: no time left"
    else:
        if progress:
            what = " with memory-op decisions" if memory_ops else ""
            progress(f"solver: CP-SAT on {n_ops} ops{what}, warm-started, limit {time_limit:g} s")
        times = sim_times(best_sim) if best.memops else None
        res = improve(
            spec, best.derived, time_limit, progress, memops=best.memops, times=times, decide_memops=memory_ops
        )
        status, bound, t_s = res.status, res.bound, res.seconds
        if res.orders is not None:
            try:
                _, f2 = evaluate_orders(spec, res.orders, memops=res.memops)
            except PipecError as e:  # the solver's model is coarser than pipec's checks; keep the heuristic's
                f2 = None
                if progress:
                    progress(f"solver: its orders fail pipec's checks ({e.diagnostics[0].message})")
            if progress and f2 is not None:
                fits = "fits" if _fits(spec, f2) else f"over the limit (peak {_g(max(f2.peak))})"
                progress(f"solver: simulated makespan {_g(f2.makespan)}, {f2.memops} memory ops, {fits}")
            if f2 is not None and not _fits(spec, f2) and memory_ops:
                # the solver's memory is coarser than the simulated curve (the host link runs in issue order):
                # more memory ops where the curve still passes the limit
                fixed = repair(spec, res.orders, res.memops)
                if fixed is not None:
                    _, f2 = evaluate_orders(spec, fixed.derived.orders, memops=fixed.memops)
                    res = replace(res, memops=fixed.memops)
                    if progress:
                        progress(f"solver: repaired to makespan {_g(f2.makespan)} with {f2.memops} memory ops")
            if f2 is not None and _fits(spec, f2) and f2.key3 < fig.key3:
                orders, memops, fig = res.orders, res.memops, f2
            elif status == "improved":
                status = "no better"
    return Result(spec, orders, fig, best, h_fig, status, note, bound, t_h, t_s, memops, floor)
