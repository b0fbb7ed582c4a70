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
numpy per rank: slot keys, one sort, masks; the collectives are merged in with
one more sort. The fsdp windows are placed by a loop over windows (one per
stage without a bound) and, with `max_gathered`, the Belady walk over steps.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipec.errors import PipecError, error
from pipec.ir.dataparallel import DataParallel
from pipec.ir.graph import across, message_edge
from pipec.ir.opcodes import (
    CODE,
    COMPUTE_OF_KIND,
    FWD,
    HAS_SEND,
    IN_MSG,
    IN_STAGE,
    IS_COMPUTE,
    IS_P2P,
    IS_RECV,
    MEMOPS,
    OUT_PEER_STAGE,
    PRODUCER_KIND,
    RECV_OF_KIND,
    REDUCE_GRAD,
    RESHARD,
    SEND_OF_KIND,
    STEP,
    UNSHARD,
    may_group,
)
from pipec.ir.program import Program, RankProgram
from pipec.ir.schedule import Collective, MemOp, RankOps, Schedule
from pipec.ir.validate import validate
from pipec.passes.deadlock import global_order
from pipec.passes.dryrun import DryRun, deadlock_error, dry_run


def lower(sched: Schedule, dp: DataParallel | None = None) -> Program:
    """One instruction stream per rank (the schedule must have passed `check_schedule`), with the
    data-parallel collectives of `dp` (default: none beyond each stage's REDUCE_GRAD and STEP)."""
    return lower_with_proof(sched, dp)[0]


def lower_with_proof(sched: Schedule, dp: DataParallel | None = None) -> tuple[Program, DryRun]:
    """The Program and a strict rendezvous dry run of it; E401 when the schedule itself deadlocks, E421
    when `dp` cannot be honoured, E423 when the schedule's own collectives break a rule, E424 its memory
    ops."""
    dp = dp or DataParallel()
    if _forward_only(sched) and (not dp.is_default or any(sched.memops) or any(sched.collectives)):
        raise ValueError("a forward-only schedule lowers without data-parallel collectives or memory ops")
    times = global_order(sched)
    S, m = sched.num_stages, sched.num_microbatches
    time_of = op_times(sched, times)
    placement = sched.placement_array
    placed: list[list[tuple[int, Collective | MemOp]]] = []  # per rank: (instruction index, what) it placed
    ranks = tuple(
        _lower_rank(sched, r, ops, t, time_of, placement, dp, placed)
        for r, (ops, t) in enumerate(zip(sched.ranks, times))
    )
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
    for ops, t in zip(sched.ranks, times):
        time_of[(ops.kind * S + ops.stage) * m + ops.mb] = t
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
    r_idx, r_other = np.concatenate(r_idx or none), np.concatenate(r_other or none)
    s_idx, s_other = np.concatenate(s_idx or none), np.concatenate(s_other or none)
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

    own = np.asarray(sched.stages_of(rank), dtype=np.int64)[::-1]
    memops = sched.memops[rank] if rank < len(sched.memops) else ()
    if dp.is_default and not memops:  # no data parallelism, as before PP x DP: the reductions, then the steps
        if _forward_only(sched):  # nothing to reduce or step
            own = own[:0]
        tail = np.concatenate([np.full(len(own), REDUCE_GRAD), np.full(len(own), STEP)])
        z = np.full(len(tail), -1)
        placed.append([])
        return RankProgram(
            op=np.concatenate([code, tail]).astype(np.int64),
            mb=np.concatenate([mb[src], z]).astype(np.int64),
            stage=np.concatenate([stage[src], own, own]).astype(np.int64),
            peer=np.concatenate([peer, z]).astype(np.int64),
            group=np.concatenate([group, np.zeros(len(tail), dtype=bool)]),
            other=None if other_col is None else np.concatenate([other_col, z]).astype(np.int64),
        )
    points = _points(ops, step, code, src, group)
    if dp.is_default:  # the memory ops go in; REDUCE_GRAD then STEP of each stage close the stream
        mine: tuple[Collective, ...] = ()
        c_op, c_stage, c_pos, c_from = _memop_rows(sched, rank, ops, step, points, memops)
        c_mb = np.asarray([x.mb for x in memops], dtype=np.int64)[np.maximum(c_from, 0)] if len(c_op) else c_op
        tail_op = np.concatenate([np.full(len(own), REDUCE_GRAD), np.full(len(own), STEP)])
        tail_stage = np.concatenate([own, own])
        items: list = list(memops)
    else:
        mine = sched.collectives[rank] if rank < len(sched.collectives) else ()
        c_op, c_stage, c_pos, c_from = _collectives(sched, rank, ops, step, points, own, dp, mine)
        c_mb = np.full(len(c_op), -1, dtype=np.int64)
        if memops:  # after the collectives at one point (a RECOMPUTE after the UNSHARD it computes under)
            m_op, m_stage, m_pos, m_from = _memop_rows(sched, rank, ops, step, points, memops)
            m_mb = np.asarray([x.mb for x in memops], dtype=np.int64)[m_from]
            at = np.argsort(np.concatenate([c_pos, m_pos]), kind="stable")
            c_op, c_stage, c_pos = (np.concatenate(x)[at] for x in ((c_op, m_op), (c_stage, m_stage), (c_pos, m_pos)))
            c_mb = np.concatenate([c_mb, m_mb])[at]
            c_from = np.concatenate([c_from, np.where(m_from >= 0, m_from + len(mine), -1)])[at]
        tail_op, tail_stage = np.full(len(own), STEP), own
        items = [*mine, *memops]
    n_base = len(code)
    # Merge: an inserted instruction at position p goes before base instruction p (after the ones before it).
    new_base = np.arange(n_base) + np.searchsorted(c_pos, np.arange(n_base), side="right")
    new_coll = c_pos + np.arange(len(c_pos))
    total = n_base + len(c_pos) + len(tail_op)
    out = {k: np.full(total, -1, dtype=np.int64) for k in ("op", "mb", "stage", "peer")}
    out_group = np.zeros(total, dtype=bool)
    out["op"][new_base], out["mb"][new_base], out["stage"][new_base] = code, mb[src], stage[src]
    out["peer"][new_base], out_group[new_base] = peer, group
    if other_col is not None:
        out["other"] = np.full(total, -1, dtype=np.int64)
        out["other"][new_base] = other_col
    out["op"][new_coll], out["mb"][new_coll], out["stage"][new_coll] = c_op, c_mb, c_stage
    tail = np.arange(n_base + len(c_pos), total)
    out["op"][tail], out["stage"][tail] = tail_op, tail_stage
    placed.append([(int(new_coll[k]), items[int(c_from[k])]) for k in np.flatnonzero(c_from >= 0).tolist()])
    return RankProgram(out["op"], out["mb"], out["stage"], out["peer"], out_group, out.get("other"))


# Order of the collectives at one point: the schedule's own first (in its order), then reductions, then
# closing windows, then opening ones (so a closing and an opening window are never held at once).
_PHASE_PLACED, _PHASE_REDUCE, _PHASE_RESHARD, _PHASE_UNSHARD = range(4)


def _points(ops: RankOps, step: np.ndarray, code: np.ndarray, src: np.ndarray, group: np.ndarray):
    """The two kinds of insertion points of the module docstring, as positions in the base stream (code,
    src, group: the rank's sends, receives and computes, in order): per step g, right before its first
    compute (`before[g]`; `before[number of steps]` is the end) and right after it (`after[g]`)."""
    n_base = len(code)
    comp = np.flatnonzero(IS_COMPUTE[code])
    comp_step = step[src[comp]]
    first = np.concatenate(([True], comp_step[1:] != comp_step[:-1])) if len(comp) else np.zeros(0, dtype=bool)
    before_step = np.append(comp[first], n_base)  # position right before step g's first compute; n_base: the end
    body = np.flatnonzero(~IS_RECV[code])  # computes and sends, which belong to the step that produced them
    body_step = step[src[body]]
    last = np.append(body_step[1:] != body_step[:-1], True) if len(body) else np.zeros(0, dtype=bool)
    end = body[last]
    after_step = end + 1 + group[end]  # past the receive a step's last send may be batched with
    return before_step, after_step


def _memop_rows(
    sched: Schedule,
    rank: int,
    ops: RankOps,
    step: np.ndarray,
    points: tuple[np.ndarray, np.ndarray],
    memops: tuple[MemOp, ...],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The schedule's memory ops of a rank as (opcode, stage, insertion position, index into `memops`),
    by position (stable: in the schedule's order at one point). A memory op before op j goes right
    before the compute of op j's step; one before `len(ops)` at the end, before the reductions."""
    n_ops = len(ops)
    num_steps = int(step[-1]) + 1 if n_ops else 0
    for x in memops:
        if x.op not in MEMOPS:
            raise error("E424", f"`{x.op}` is not a memory op ({', '.join(MEMOPS)})", x.span, sched.source)
        if not 0 <= x.before <= n_ops:
            raise error(
                "E424",
                f"`{x.op} {x.mb} {x.stage}` is placed before op {x.before} of rank {rank}, outside 0 .. {n_ops}",
                x.span,
                sched.source,
            )
    before = np.asarray([x.before for x in memops], dtype=np.int64)
    g = np.where(before < n_ops, step[np.minimum(before, max(n_ops - 1, 0))] if n_ops else 0, num_steps)
    pos = points[0][g]
    order = np.argsort(pos, kind="stable")
    code = np.asarray([CODE[x.op] for x in memops], dtype=np.int64)
    stage = np.asarray([x.stage for x in memops], dtype=np.int64)
    return code[order], stage[order], pos[order], order.astype(np.int64)


def _collectives(
    sched: Schedule,
    rank: int,
    ops: RankOps,
    step: np.ndarray,
    points: tuple[np.ndarray, np.ndarray],
    own: np.ndarray,
    dp: DataParallel,
    mine: tuple[Collective, ...],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rank's collectives as (opcode, stage, insertion position in the base stream, index into the
    schedule's own or -1), sorted by position and phase."""
    n_ops = len(ops)
    num_steps = int(step[-1]) + 1 if n_ops else 0
    before_step, after_step = points
    # Rows: (position, phase, sequence, opcode, stage, index into `mine`).
    rows: list[tuple[int, int, int, int, int, int]] = []
    keep_windows = dp.kind == "fsdp"
    for k, c in enumerate(mine):
        if c.op not in (UNSHARD_NAME, RESHARD_NAME, REDUCE_NAME):
            raise error("E423", f"`{c.op}` is not a data-parallel collective", c.span, sched.source)
        if c.op != REDUCE_NAME and not keep_windows:
            continue
        if not 0 <= c.before <= n_ops:
            raise error(
                "E423", f"`{c.op} {c.stage}` is placed before op {c.before}, outside 0 .. {n_ops}", c.span, sched.source
            )
        g = int(step[c.before]) if c.before < n_ops else num_steps
        rows.append((int(before_step[g]), _PHASE_PLACED, k, _CODE[c.op], c.stage, k))
    placed_reduce = {c.stage for c in mine if c.op == REDUCE_NAME}
    placed_window = {c.stage for c in mine if c.op != REDUCE_NAME}
    last_step = np.full(sched.num_stages, -1, dtype=np.int64)
    np.maximum.at(last_step, ops.stage, step)  # each stage's last step
    for s in own.tolist():
        if s in placed_reduce:
            continue
        if last_step[s] >= 0:
            rows.append((int(after_step[last_step[s]]), _PHASE_REDUCE, int(last_step[s]), REDUCE_GRAD, s, -1))
    if keep_windows:
        stages = [s for s in own.tolist() if s not in placed_window]
        for s, opened, closed, issue in _windows(sched, rank, ops, step, num_steps, stages, dp):
            at = 0 if issue < 0 else int(before_step[issue])
            rows.append((at, _PHASE_UNSHARD, opened, UNSHARD, s, -1))
            rows.append((int(after_step[closed]), _PHASE_RESHARD, closed, RESHARD, s, -1))
    if not rows:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(4))  # type: ignore[return-value]
    a = np.array(rows, dtype=np.int64)
    order = np.lexsort((a[:, 2], a[:, 1], a[:, 0]))
    a = a[order]
    return a[:, 3], a[:, 4], a[:, 0], a[:, 5]


REDUCE_NAME, UNSHARD_NAME, RESHARD_NAME = "REDUCE_GRAD", "UNSHARD", "RESHARD"
_CODE = {REDUCE_NAME: REDUCE_GRAD, UNSHARD_NAME: UNSHARD, RESHARD_NAME: RESHARD}


def _windows(
    sched: Schedule,
    rank: int,
    ops: RankOps,
    step: np.ndarray,
    num_steps: int,
    stages: list[int],
    dp: DataParallel,
) -> list[tuple[int, int, int, int]]:
    """The default fsdp windows of these stages as (stage, first step used, last step used, step before
    which its UNSHARD is issued, -1 for the start of the stream); see the module docstring."""
    if not stages or not num_steps:
        return []
    k = dp.max_gathered
    wanted = np.zeros(sched.num_stages, dtype=bool)
    wanted[stages] = True
    use = wanted[ops.stage]
    first = np.full(sched.num_stages, num_steps, dtype=np.int64)
    last = np.full(sched.num_stages, -1, dtype=np.int64)
    np.maximum.at(last, ops.stage[use], step[use])
    np.minimum.at(first, ops.stage[use], step[use])
    windows: list[tuple[int, int, int]] = []  # (stage, opened, closed)
    if k is None or k >= len(stages):
        windows = sorted(((s, int(first[s]), int(last[s])) for s in stages if last[s] >= 0), key=lambda w: w[1])
    else:
        windows = _belady(sched, rank, ops, step, num_steps, use, k)
    open_at = np.zeros(num_steps, dtype=np.int64)  # windows holding a stage before each step
    closed_last: dict[int, int] = {}
    out = []
    for s, a, b in windows:  # in order of first use
        want = a - dp.prefetch
        t = max(want, closed_last.get(s, -1) + 1, 0)
        if k is not None and t < a and open_at[t:a].max() >= k:
            t = t + int(np.flatnonzero(open_at[t:a] >= k)[-1]) + 1
        open_at[t : b + 1] += 1
        closed_last[s] = b
        out.append((s, a, b, -1 if t == 0 and want < 0 else t))
    return out


def _belady(
    sched: Schedule, rank: int, ops: RankOps, step: np.ndarray, num_steps: int, use: np.ndarray, k: int
) -> list[tuple[int, int, int]]:
    """Windows of at most k stages at once, closing the stage whose next use is furthest ahead."""
    st = ops.stage[use].tolist()
    sp = step[use].tolist()
    need: list[list[int]] = [[] for _ in range(num_steps)]
    for s, g in zip(st, sp):
        if s not in need[g]:
            need[g].append(s)
    uses: dict[int, list[int]] = {}
    for g, ss in enumerate(need):
        for s in ss:
            uses.setdefault(s, []).append(g)
    nxt = {s: 0 for s in uses}  # index into uses[s] of its next use
    held: dict[int, int] = {}  # stage -> step its window opened
    last_use: dict[int, int] = {}
    windows: list[tuple[int, int, int]] = []
    for g, ss in enumerate(need):
        if len(ss) > k:
            raise error(
                "E421",
                f"data parallelism: --max-gathered {k} cannot hold the {len(ss)} stages that rank {rank}'s "
                f"overlapped pair at step {g} computes together ({', '.join(map(str, ss))})",
            )
        for s in ss:
            if s in held:
                continue
            if len(held) >= k:

                def ahead(q: int) -> int:
                    i = nxt[q]
                    return uses[q][i] if i < len(uses[q]) else num_steps + 1

                victim = max((q for q in held if q not in ss), key=lambda q: (ahead(q), q))
                windows.append((victim, held.pop(victim), last_use[victim]))
            held[s] = g
        for s in ss:
            last_use[s] = g
            nxt[s] += 1
    windows += [(s, a, last_use[s]) for s, a in held.items()]
    windows.sort(key=lambda w: (w[1], w[0]))
    return windows


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
