"""Schedule to Program: explicit sends and receives around each rank's compute.

NCCL runs the point-to-point operations between two ranks in the order they
were issued, so both ranks must issue their messages to each other in one
order, or they hang (the cross-node send-before-recv deadlocks users hit in
torch, pytorch/pytorch#172668). The lowering makes that hold by
construction: it takes one dependency-respecting execution of the whole
schedule in rounds (`deadlock.global_order`: all ranks step together, one op
per round), gives every op and message a time in that execution, and places
each send and receive at its time on both ends, so each channel is ordered by
message time on both sides.

- A send goes right after the compute that produces it.
- A receive is posted at the receiving rank's point in that timeline when
  the message is sent: after its last op that ran earlier, so a sender that
  keeps to the timeline never waits, and always before the consuming
  compute (which ran later).
- A send and a receive with the same peer, side by side, form one batched
  exchange (one `batch_isend_irecv`, Megatron's `send_forward_recv_backward`).
- Stages on the same rank hand tensors over locally: no instruction.

Data-parallel collectives (`DataParallel`, docs/program.md "Data parallelism").
Without data parallelism (size 1, ddp) each rank ends with `REDUCE_GRAD` then
`STEP` of its stages, as before PP x DP, and collectives a schedule places are
not lowered (a single replica reduces nothing). Otherwise the collectives go into the stream at two kinds of
points that never split a group: *after step g* (right after step g's compute
and the sends that carry its output, so the neighbour is not delayed; past the
receive a send is batched with) and *before step g* (right before step g's
first compute, after the receives posted for it). A step is one compute or an
overlapped pair.

- `REDUCE_GRAD s` after the step of stage s's last compute; the `STEP`s close
  the stream (each waits for its reduction).
- fsdp: windows `UNSHARD s` .. `RESHARD s`. The windows of a rank follow from
  its steps: with no `max_gathered` (or one at least the rank's stage count),
  one window per stage, from its first compute to its last; with
  `max_gathered = k`, Belady's rule: walking the steps, a step that needs a
  stage not gathered opens a window for it and, when k are gathered already,
  closes the gathered stage (not needed by this step) whose next use is
  furthest ahead. A window closes after the step of its last use: `RESHARD s`
  after that step (after `REDUCE_GRAD s` for a stage's last window). Its
  `UNSHARD s` is issued before the step `prefetch` steps ahead of its first
  use (at the very start of the stream when there are fewer steps before it),
  but never while stage s is still gathered and never so early that more than
  k stages would be gathered at once: windows are placed in order of first
  use, each as early as those bounds allow. At one point RESHARDs come before
  UNSHARDs, so a closing window and an opening one are never both held.
- A schedule that places collectives itself (`Schedule.collectives`, a ZeroPP-
  style schedule) gets exactly those: a collective before op j goes right
  before the compute of op j (before the first of its pair when op j is the
  second), one before `len(ops)` after the last op; the defaults above are
  added only for the stages and opcodes it does not place (`REDUCE_GRAD s`, or
  the windows of s), and `max_gathered` bounds the default windows only. Under
  ddp the schedule's UNSHARD/RESHARD are dropped (replicated parameters have
  nothing to gather, as torch's UNSHARD of an unsharded stage does nothing).
  `validate` proves the result; a rule it breaks is E423 at the collective.

Memory ops (`Schedule.memops`: RECOMPUTE, OFFLOAD, RELOAD; docs/program.md
"Memory ops") go in at *before step g* points too: one before op j right before
the first compute of op j's step, one before `len(ops)` at the end (before the
REDUCE_GRADs without data parallelism); at one point after the collectives (a
RECOMPUTE after the UNSHARD it computes under), in the schedule's order. A rank
without them lowers exactly as before. `validate` proves the result; a rule it
breaks is E424 at the memory op.

`pipec.passes.dryrun` then proves the result under rendezvous sends. Built with
numpy over all ranks at once (`_lower_all`: slot keys with the rank as the first
key of one sort, masks, exchanges bound within a rank, the closing REDUCE_GRADs
and STEPs scattered in), so a pipeline of ten thousand ranks with a few ops each
costs a handful of array passes, not ten thousand. A rank with collectives or
memory ops is finished on its own from its slice of that stream
(`pipec.passes.inserts`: one more sort per rank; the fsdp windows by a loop over
windows and, with `max_gathered`, the Belady walk over steps). `_lower_rank` is
the same lowering one rank at a time (`lower_with_proof(..., per_rank=True)`),
the reference tests/unit/passes/test_wide_lower.py holds the all-ranks pass to.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipec.errors import PipecError, error
from pipec.ir.dataparallel import DataParallel
from pipec.ir.graph import across, message_edge
from pipec.ir.opcodes import (
    COMPUTE_OF_KIND,
    FWD,
    HAS_SEND,
    IN_MSG,
    IN_STAGE,
    IS_COMPUTE,
    IS_P2P,
    OUT_PEER_STAGE,
    PRODUCER_KIND,
    RECV_OF_KIND,
    REDUCE_GRAD,
    SEND_OF_KIND,
    STEP,
    may_group,
)
from pipec.ir.program import Program, RankProgram
from pipec.ir.schedule import Collective, MemOp, RankOps, Schedule
from pipec.ir.validate import validate
from pipec.passes.deadlock import global_order
from pipec.passes.dryrun import DryRun, deadlock_error, dry_run
from pipec.passes.inserts import finish_rank


def lower(sched: Schedule, dp: DataParallel | None = None) -> Program:
    """One instruction stream per rank (the schedule must have passed `check_schedule`), with the
    data-parallel collectives of `dp` (default: none beyond each stage's REDUCE_GRAD and STEP)."""
    return lower_with_proof(sched, dp)[0]


def lower_with_proof(
    sched: Schedule, dp: DataParallel | None = None, *, per_rank: bool = False
) -> tuple[Program, DryRun]:
    """The Program and a strict rendezvous dry run of it; E401 when the schedule itself deadlocks, E421
    when `dp` cannot be honoured, E423 when the schedule's own collectives break a rule, E424 its memory
    ops. `per_rank`: build each rank's base stream on its own (the reference the all-ranks pass is held
    equal to, tests/unit/passes/test_wide_lower.py)."""
    dp = dp or DataParallel()
    if _forward_only(sched) and (not dp.is_default or any(sched.memops) or any(sched.collectives)):
        raise ValueError("a forward-only schedule lowers without data-parallel collectives or memory ops")
    times = global_order(sched)
    S, m = sched.num_stages, sched.num_microbatches
    time_of = op_times(sched, times)
    placement = sched.placement_array
    placed: list[list[tuple[int, Collective | MemOp]]] = []  # per rank: (instruction index, what) it placed
    if per_rank:
        ranks = tuple(
            _lower_rank(sched, r, ops, t, time_of, placement, dp, placed)
            for r, (ops, t) in enumerate(zip(sched.ranks, times))
        )
    else:
        ranks = _lower_all(sched, times, time_of, placement, dp, placed)
    prog = Program(
        name=sched.name,
        params=sched.params,
        num_stages=S,
        num_ranks=sched.num_ranks,
        num_microbatches=m,
        split_backward=sched.split_backward,
        placement=sched.placement,
        ranks=ranks,
        dp=dp.size,
        dp_kind=dp.kind,
        slicing=sched.slicing,
        forward_only=_forward_only(sched),
        graph=sched.graph,
    )
    if any(placed):
        _prove_placed(sched, prog, placed)
    return prog, dry_run(prog, witness=time_of)  # the order above, checked against every rule


def forward_program(prog: Program) -> Program:
    """The forward-only Program of `prog` (an evaluation pass): each rank's FWDs in `prog`'s order, as a
    schedule of F ops alone, lowered again, so it is validated and proven by the dry run like any Program.
    A subsequence of a deadlock-free order with only the activation messages stays deadlock-free; the
    lowering re-derives the channel order. No memory ops, collectives, REDUCE_GRAD or STEP."""
    ranks = []
    for rp in prog.ranks:
        fwd = np.flatnonzero(rp.op == FWD)
        n = len(fwd)
        ranks.append(RankOps(np.zeros(n, np.int64), rp.mb[fwd], rp.stage[fwd], np.full(n, -1), np.zeros(n, bool)))
    sched = Schedule(
        name=prog.name,
        params=prog.params,
        num_stages=prog.num_stages,
        num_ranks=prog.num_ranks,
        num_microbatches=prog.num_microbatches,
        kinds=("F",),
        placement=prog.placement,
        ranks=tuple(ranks),
        slicing=prog.slicing,
        graph=prog.graph,
    )
    out, run = lower_with_proof(sched)
    if not run.completed:  # cannot happen for a proven Program's FWDs; a lowering bug if it does
        raise deadlock_error(run)
    return replace(out, experts=prog.experts, moe_layers=prog.moe_layers)  # its FWDs' all-to-alls


def _forward_only(sched: Schedule) -> bool:
    return "B" not in sched.kinds


def op_times(sched: Schedule, times: list[np.ndarray]) -> np.ndarray:
    """Each op's completion time in `global_order`'s execution, by op key (kind * S + stage) * m + mb: what
    the lowering places messages by, and the witness the dry run checks."""
    S, m = sched.num_stages, sched.num_microbatches
    time_of = np.zeros(len(sched.kinds) * S * m, dtype=np.int64)
    if sched.ranks:  # all ranks in one scatter (op keys are unique)
        cat = [np.concatenate([getattr(o, f) for o in sched.ranks]) for f in ("kind", "stage", "mb")]
        time_of[(cat[0].astype(np.int64) * S + cat[1]) * m + cat[2]] = np.concatenate(times)
    return time_of


def _prove_placed(sched: Schedule, prog: Program, placed: list[list[tuple[int, Collective | MemOp]]]) -> None:
    """Validate a Program holding the schedule's own collectives or memory ops; a broken rule is E423 at
    the collective it concerns, E424 at the memory op (or the first the rank placed)."""
    where = [dict(p) for p in placed]

    def find(r: int, j: int) -> Collective | MemOp | None:
        if not 0 <= r < len(where) or not where[r]:
            return None
        return where[r].get(j) or next(iter(where[r].values()))

    first: list[Collective | MemOp | None] = [None]

    def locate(r: int, j: int):
        first[0] = find(r, j)  # validate locates its first problem only
        return getattr(first[0], "span", None)

    try:
        validate(prog, sched.source, locate)
    except PipecError as e:
        d = e.diagnostics[0]
        message = d.message.replace("invalid program: ", "", 1)
        memop = isinstance(first[0], MemOp) or not any(isinstance(c, Collective) for p in placed for _, c in p)
        what = "memory ops" if memop else "data-parallel collectives"
        raise error(
            "E424" if memop else "E423",
            f"the schedule's {what} make an invalid program: " + message,
            d.span,
            sched.source,
            d.notes,
        ) from None


def _lower_rank(
    sched: Schedule,
    rank: int,
    ops: RankOps,
    times: np.ndarray,
    time_of: np.ndarray,
    placement: np.ndarray,
    dp: DataParallel,
    placed: list[list[tuple[int, Collective | MemOp]]],
) -> RankProgram:
    S, m = sched.num_stages, sched.num_microbatches
    n = len(ops)
    kind, mb, stage = ops.kind, ops.mb, ops.stage
    graph = sched.graph
    # Step index: the two ops of an overlapped pair share a step.
    second = np.zeros(n, dtype=bool)
    second[1:] = ops.paired[:-1]
    step = np.cumsum(~second) - 1

    # What each op receives and sends, from the instruction table and the stage graph: its inputs come from
    # the stages across IN_STAGE (the stage before it on the chain; every input stage on a graph), its
    # outputs go to those across OUT_PEER_STAGE; a stage on this rank is a local hand-off.
    r_idx, r_other, s_idx, s_other = _transfers(graph, stage, kind, S, placement, rank)
    # A message's time: when its producer completes (the producer of B(i,s)'s gradient is B(i,s+1)).
    producer = PRODUCER_KIND[np.maximum(IN_MSG[kind[r_idx]], 0)]
    recv_time = time_of[(producer * S + r_other) * m + mb[r_idx]]

    # Slot keys (primary, secondary): compute of step g at 4g+1 and its sends at 4g+2, both after their
    # time; a receive of a message produced at time t right after this rank's last op before t. On a graph
    # the edge breaks the last ties (two messages of one op), the same way on both ends of a channel.
    before = np.searchsorted(times, recv_time) - 1
    recv_primary = np.where(before >= 0, 4 * step[np.maximum(before, 0)] + 2, -1)
    recv_code = RECV_OF_KIND[kind[r_idx]]
    send_code = SEND_OF_KIND[kind[s_idx]]
    compute_code = COMPUTE_OF_KIND[kind]
    primary = np.concatenate([recv_primary, 4 * step + 1, 4 * step[s_idx] + 2])
    secondary = np.concatenate([recv_time, times, times[s_idx]])
    code = np.concatenate([recv_code, compute_code, send_code])
    peer = np.concatenate([placement[r_other], np.full(n, -1), placement[s_other]])
    src = np.concatenate([r_idx, np.arange(n), s_idx])
    if graph is None:
        order = np.lexsort((secondary, primary))
        code, peer, src = code[order], peer[order], src[order]
        other_col = None
    else:
        other_all = np.concatenate([r_other, np.full(n, -1), s_other])
        edge = message_edge(graph, np.concatenate([stage[r_idx], stage, stage[s_idx]]), np.maximum(other_all, 0))
        order = np.lexsort((np.where(other_all >= 0, edge, -1), secondary, primary))
        code, peer, src, other_col = code[order], peer[order], src[order], other_all[order]

    group = np.zeros(len(code), dtype=bool)
    comp = np.flatnonzero(IS_COMPUTE[code])
    group[comp] = ops.paired[src[comp]]  # overlapped compute pairs
    group = _bind_exchanges(code, peer, group)

    return finish_rank(sched, rank, ops, step, code, peer, src, group, other_col, dp, placed)


def _bind_exchanges(code: np.ndarray, peer: np.ndarray, group: np.ndarray) -> np.ndarray:
    """A send and a receive with the same peer, side by side, become one batched exchange (the table's
    exchange group)."""
    comm = IS_P2P[code]
    pair = comm[:-1] & comm[1:] & may_group(code[:-1], code[1:], peer[:-1], peer[1:])
    taken = -2
    for j in np.flatnonzero(pair).tolist():
        if j > taken + 1:  # never chain three into one group
            group[j] = True
            taken = j
    return group


def _lower_all(
    sched: Schedule,
    times: list[np.ndarray],
    time_of: np.ndarray,
    placement: np.ndarray,
    dp: DataParallel,
    placed: list[list[tuple[int, Collective | MemOp]]],
) -> tuple[RankProgram, ...]:
    """Every rank's stream in one pass over the ranks' concatenated arrays, the same streams as `_lower_rank`
    per rank: the same slot keys with the rank as the first key of one sort, exchanges bound within a rank,
    the closing REDUCE_GRADs and STEPs scattered in. A rank with collectives or memory ops is finished on
    its own (`finish_rank`) from its slice of the base stream."""
    S, m, R = sched.num_stages, sched.num_microbatches, sched.num_ranks
    graph = sched.graph
    lengths = np.asarray([len(ops) for ops in sched.ranks], dtype=np.int64)
    op_off = np.concatenate(([0], np.cumsum(lengths)))
    none = [np.zeros(0, dtype=np.int64)]
    kind = np.concatenate([o.kind for o in sched.ranks] or none).astype(np.int64)
    mb = np.concatenate([o.mb for o in sched.ranks] or none).astype(np.int64)
    stage = np.concatenate([o.stage for o in sched.ranks] or none).astype(np.int64)
    paired = np.concatenate([o.paired for o in sched.ranks] or [np.zeros(0, dtype=bool)]).astype(bool)
    t_all = np.concatenate(times or none).astype(np.int64)
    n = len(kind)
    rank = np.repeat(np.arange(R, dtype=np.int64), lengths)
    # Steps, numbered from 0 on each rank (a rank's first op always starts one).
    second = np.zeros(n, dtype=bool)
    second[1:] = paired[:-1]
    second[op_off[:-1][lengths > 0]] = False
    g_step = np.cumsum(~second) - 1
    step = g_step - g_step[op_off[:-1][rank]] if n else g_step

    r_idx, r_other, s_idx, s_other = _transfers(graph, stage, kind, S, placement, rank)
    producer = PRODUCER_KIND[np.maximum(IN_MSG[kind[r_idx]], 0)]
    recv_time = time_of[(producer * S + r_other) * m + mb[r_idx]]
    # The rank's last op before each message's time: one search over (rank, time), sorted (times increase
    # along each rank's order).
    span = int(max(t_all.max(initial=0), time_of.max(initial=0))) + 1
    r_rank = rank[r_idx]
    before = np.searchsorted(rank * span + t_all, r_rank * span + recv_time) - 1
    mine = before >= op_off[:-1][r_rank]
    recv_primary = np.where(mine, 4 * step[np.maximum(before, 0)] + 2, -1)
    primary = np.concatenate([recv_primary, 4 * step + 1, 4 * step[s_idx] + 2])
    secondary = np.concatenate([recv_time, t_all, t_all[s_idx]])
    code = np.concatenate([RECV_OF_KIND[kind[r_idx]], COMPUTE_OF_KIND[kind], SEND_OF_KIND[kind[s_idx]]])
    peer = np.concatenate([placement[r_other], np.full(n, -1), placement[s_other]])
    src = np.concatenate([r_idx, np.arange(n), s_idx])
    who = rank[src]
    keys = [(who, R), (primary + 1, 4 * int(lengths.max(initial=0)) + 4), (secondary, span)]
    other_all = None
    if graph is not None:
        other_all = np.concatenate([r_other, np.full(n, -1), s_other])
        edge = message_edge(graph, stage[src], np.maximum(other_all, 0))
        keys.append((np.where(other_all >= 0, edge, -1) + 1, graph.num_edges + 1))
    order = _sort(keys)
    code, peer, src, who = code[order], peer[order], src[order], who[order]
    other_col = None if other_all is None else other_all[order]
    group = np.zeros(len(code), dtype=bool)
    comp = np.flatnonzero(IS_COMPUTE[code])
    group[comp] = paired[src[comp]]
    group = _bind_all(code, peer, who, group)
    b_len = np.bincount(who, minlength=R) if len(who) else np.zeros(R, dtype=np.int64)
    b_off = np.concatenate(([0], np.cumsum(b_len)))

    # The closing REDUCE_GRADs then STEPs of each rank's stages, last stage first.
    valid = (placement >= 0) & (placement < R)
    owned = np.flatnonzero(valid)
    owned = owned[np.lexsort((-owned, placement[owned]))]
    k_own = np.bincount(placement[owned], minlength=R) if len(owned) else np.zeros(R, dtype=np.int64)
    if "B" not in sched.kinds:  # forward only: nothing to reduce or step
        owned, k_own = owned[:0], np.zeros(R, dtype=np.int64)
    o_len = b_len + 2 * k_own
    o_off = np.concatenate(([0], np.cumsum(o_len)))
    total = int(o_off[-1])
    out = {k: np.full(total, -1, dtype=np.int64) for k in ("op", "mb", "stage", "peer")}
    out_group = np.zeros(total, dtype=bool)
    at = np.arange(len(code)) - b_off[:-1][who] + o_off[:-1][who]
    out["op"][at], out["mb"][at], out["stage"][at], out["peer"][at] = code, mb[src], stage[src], peer
    out_group[at] = group
    if other_col is not None:
        out["other"] = np.full(total, -1, dtype=np.int64)
        out["other"][at] = other_col
    t_rank = placement[owned]
    t_at = np.arange(len(owned)) - np.concatenate(([0], np.cumsum(k_own)))[:-1][t_rank] + o_off[:-1][t_rank]
    t_at = t_at + b_len[t_rank]
    out["op"][t_at], out["stage"][t_at] = REDUCE_GRAD, owned
    out["op"][t_at + k_own[t_rank]], out["stage"][t_at + k_own[t_rank]] = STEP, owned

    ranks = []
    bounds = o_off.tolist()
    for r, ops in enumerate(sched.ranks):
        memops = sched.memops[r] if r < len(sched.memops) else ()
        if dp.is_default and not memops:
            lo, hi = bounds[r], bounds[r + 1]
            other = out.get("other")
            ranks.append(
                RankProgram(
                    out["op"][lo:hi],
                    out["mb"][lo:hi],
                    out["stage"][lo:hi],
                    out["peer"][lo:hi],
                    out_group[lo:hi],
                    None if other is None else other[lo:hi],
                )
            )
            placed.append([])
            continue
        lo, hi = int(b_off[r]), int(b_off[r + 1])
        rows = slice(lo, hi)
        ranks.append(
            finish_rank(
                sched,
                r,
                ops,
                step[op_off[r] : op_off[r + 1]],
                code[rows],
                peer[rows],
                src[rows] - op_off[r],
                group[rows].copy(),
                None if other_col is None else other_col[rows],
                dp,
                placed,
            )
        )
    return tuple(ranks)


def _sort(keys: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """The stable order by several non-negative integer keys, the first most significant (each with its
    bound): one packed int64 argsort where the bounds' product fits, else a lexsort."""
    bound = 1
    for _, b in keys:
        bound *= max(b, 1)
    if bound < 2**62:
        packed = np.zeros(len(keys[0][0]), dtype=np.int64)
        for k, b in keys:
            packed = packed * max(b, 1) + k
        return np.argsort(packed, kind="stable")
    return np.lexsort(tuple(k for k, _ in reversed(keys)))


def _bind_all(code: np.ndarray, peer: np.ndarray, who: np.ndarray, group: np.ndarray) -> np.ndarray:
    """`_bind_exchanges` over all ranks' streams at once (`who`: each instruction's rank): a pair binds within
    one rank only, and in each run of adjacent pairs the first, third, ... bind (never three in one group),
    as the per-rank loop does."""
    if len(code) < 2:
        return group
    comm = IS_P2P[code]
    pair = comm[:-1] & comm[1:] & may_group(code[:-1], code[1:], peer[:-1], peer[1:]) & (who[:-1] == who[1:])
    j = np.flatnonzero(pair)
    if len(j):
        run = np.r_[True, np.diff(j) != 1]
        first = np.maximum.accumulate(np.where(run, np.arange(len(j)), 0))
        group[j[(np.arange(len(j)) - first) % 2 == 0]] = True
    return group


def _transfers(graph, stage: np.ndarray, kind: np.ndarray, S: int, placement: np.ndarray, rank) -> tuple:
    """Which ops receive and send, and the stage at each message's other end, from the instruction table and
    the stage graph: inputs from the stages across IN_STAGE (the stage before on the chain; every input
    stage on a graph), outputs to those across OUT_PEER_STAGE; a stage on the op's own rank (`rank`, one or
    per op) is a local hand-off. (receiving op indices, their other stages, sending op indices, theirs)."""
    r_idx, r_other, s_idx, s_other = [], [], [], []
    for other, valid in across(graph, stage, IN_STAGE[kind], S):
        hit = valid & (RECV_OF_KIND[kind] >= 0) & (placement[np.clip(other, 0, S - 1)] != rank)
        r_idx.append(np.flatnonzero(hit))
        r_other.append(other[r_idx[-1]])
    for other, valid in across(graph, stage, OUT_PEER_STAGE[kind], S):
        hit = valid & HAS_SEND[kind] & (placement[np.clip(other, 0, S - 1)] != rank)
        s_idx.append(np.flatnonzero(hit))
        s_other.append(other[s_idx[-1]])
    none = [np.zeros(0, dtype=np.int64)]
    return tuple(np.concatenate(x or none) for x in (r_idx, r_other, s_idx, s_other))
