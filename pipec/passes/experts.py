"""Expert parallelism's checks: the options against the schedule, and the all-to-all order of an expert group.

The rules themselves are `pipec.ir.experts`'s (the options, `all_to_alls`, `pair_order`, `a2a_sequence`); this
module applies them to a Schedule or Program and says what is wrong where:

- E425 before anything is lowered: experts not divisible by the expert group (Experts' own rule), an expert
  group that does not divide the data-parallel replicas it is folded into, MoE layer counts that do not name
  every stage, and a RECOMPUTE of a stage whose forward issues all-to-alls (the forward run again would issue
  them again, which neither the executor nor the simulator does yet);
- E426 when a Program file is checked or run with experts or MoE layers other than those it was compiled for
  (its all-to-alls are fixed per op, as its collectives are for its `dp`);
- E427 when the ranks of one expert group would issue their all-to-alls in different orders (`order_error`).

Where the all-to-all order can differ. Every rank of an expert group is a replica of one pipeline rank and
runs that rank's one Program, so under one compiled Program the group's sequences are equal by construction
and no check of the Program alone could fail (docs/moe.md says so). What can differ is the model each replica
builds: a replica whose stage holds another number of MoE layers (an odd count against an even one is
Megatron-LM 1852's deadlock) issues another sequence. The runtime exchanges each replica's per-stage MoE
layer counts at the start of a job and asks `order_error` for the diagnostic, which names the ranks, the first
all-to-all where they part and the source line of the op that issues it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pipec.errors import PipecError, Source, Span, error
from pipec.ir.dataparallel import DataParallel
from pipec.ir.experts import Experts, a2a_sequence, experts_mismatch, layers_problem
from pipec.ir.opcodes import IS_COMPUTE, KIND_OF, OP_KINDS
from pipec.ir.program import Program
from pipec.ir.schedule import Schedule

COMMAND_LINE = Source("<command line>", "")


def layers_for(num_stages: int, given: Sequence[int]) -> tuple[int, ...]:
    """Per-stage MoE layers from what a user gave: one count for every stage, or one per stage; E425 when a
    list names another number of stages."""
    if len(given) == 1:
        return (int(given[0]),) * num_stages
    problem = layers_problem(tuple(given), num_stages)
    if problem is not None:
        raise error("E425", f"expert parallelism: {problem}", source=COMMAND_LINE)
    return tuple(int(x) for x in given)


def check_experts(sched: Schedule, dp: DataParallel, experts: Experts, layers: Sequence[int]) -> None:
    """E425 when these experts and MoE layers cannot be lowered with this schedule and data parallelism."""
    problem = experts.fits(dp.size) or layers_problem(tuple(layers), sched.num_stages)
    if problem is not None:
        raise error("E425", f"expert parallelism: {problem}", source=COMMAND_LINE)
    if experts.size < 2 or not any(layers):
        return
    for mo in (x for row in sched.memops for x in row):
        if mo.op == "RECOMPUTE" and 0 <= mo.stage < len(layers) and layers[mo.stage]:
            raise error(
                "E425",
                f"expert parallelism: RECOMPUTE {mo.mb} {mo.stage} would run the forward of a stage with "
                f"{layers[mo.stage]} MoE layer(s) again, and its all-to-alls with it",
                mo.span,
                sched.source,
                ("recompute only stages without MoE layers, or run without --ep",),
            )


def check_program_experts(prog: Program, experts: Experts, layers: Sequence[int], path: str | None) -> None:
    """E426 when a Program was compiled for other experts or MoE layers than these."""
    problem = experts_mismatch(prog, experts, tuple(layers))
    if problem is not None:
        raise error(
            "E426",
            problem,
            source=Source(path, "") if path else COMMAND_LINE,
            notes=("compile the schedule again with these options, or leave them out to run the Program as it is",),
        )


def rank_sequence(prog: Program, rank: int, layers: Sequence[int]) -> list[tuple[str, int, int, int]]:
    """The all-to-alls pipeline rank `rank` issues under these per-stage MoE layers, in issue order
    (`pipec.ir.experts.a2a_sequence` over its compute instructions)."""
    rp = prog.ranks[rank]
    idx = np.flatnonzero(IS_COMPUTE[rp.op])
    kinds = KIND_OF[rp.op[idx]].tolist()
    ops = zip(
        (OP_KINDS[k] for k in kinds),
        rp.mb[idx].tolist(),
        rp.stage[idx].tolist(),
        rp.group[idx].tolist(),
    )
    return a2a_sequence(ops, tuple(layers) if prog.experts.size > 1 else ())


def order_error(
    prog: Program,
    rank: int,
    layers_by_rank: Mapping[int, Sequence[int]],
    sched: Schedule | None = None,
) -> PipecError | None:
    """E427 when the replicas of pipeline rank `rank` in one expert group (global rank -> the MoE layer
    counts, indexed by stage, of the model it built; only the rank's own stages are read) would issue
    different all-to-all sequences; None when they agree. `sched`, the Schedule the Program was lowered from,
    locates the op that issues the first all-to-all where two replicas part (its source line); without it
    the diagnostic names that op (kind, micro-batch, stage) only. The runtime's start-up exchange of layer
    counts (pipec.runtime.model.moe.check_same_layers) reports through here."""
    seqs = {g: rank_sequence(prog, rank, layers) for g, layers in sorted(layers_by_rank.items())}
    if len(seqs) < 2:
        return None
    (g0, ref), *rest = seqs.items()
    for g, seq in rest:
        if seq == ref:
            continue
        k = next((i for i, (a, b) in enumerate(zip(ref, seq)) if a != b), min(len(ref), len(seq)))
        shown = [f"rank {g0}: {_a2a(ref, k)}", f"rank {g}: {_a2a(seq, k)}"]
        span, source = _op_span(prog, rank, ref[k] if k < len(ref) else seq[k], sched)
        rp = prog.ranks[rank]
        held = sorted(set(rp.stage[IS_COMPUTE[rp.op]].tolist()))
        return error(
            "E427",
            f"the ranks of an expert group would issue their all-to-alls in different orders: ranks {g0} and {g} "
            f"(replicas of pipeline rank {rank}) part at all-to-all #{k}",
            span,
            source,
            (
                *shown,
                f"MoE layers of its stages {held}: rank {g0} {[layers_by_rank[g0][s] for s in held]}, rank {g} "
                f"{[layers_by_rank[g][s] for s in held]}",
                "every replica must build the same MoE layers on each stage (an odd count on one replica changes "
                "how an overlapped pair's all-to-alls interleave)",
            ),
        )
    return None


def _a2a(seq: list[tuple[str, int, int, int]], k: int) -> str:
    if k >= len(seq):
        return f"issues no all-to-all #{k} (it issues {len(seq)})"
    kind, mb, stage, i = seq[k]
    return f"all-to-all {i} of {kind}({mb}, stage {stage})"


def _op_span(
    prog: Program, rank: int, a2a: tuple[str, int, int, int], sched: Schedule | None
) -> tuple[Span | None, Source | None]:
    """The source line of the op that issues this all-to-all, when the Schedule has spans."""
    if sched is None or not sched.spans or rank >= len(sched.ranks):
        return None, None
    ops = sched.ranks[rank]
    kind, mb, stage, _ = a2a
    k = sched.kinds.index(kind) if kind in sched.kinds else -1
    hit = np.flatnonzero((ops.kind == k) & (ops.mb == mb) & (ops.stage == stage))
    if not len(hit):
        return None, None
    return sched.spans[int(ops.sid[hit[0]])], sched.source
