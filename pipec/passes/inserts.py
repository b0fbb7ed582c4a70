"""What goes in between a rank's transfers and computes when lowering (`pipec.passes.lower`): the
data-parallel collectives (REDUCE_GRAD, the fsdp UNSHARD .. RESHARD windows, the schedule's own), the memory
ops, and the REDUCE_GRAD and STEP that close a stream; the rules are `pipec.passes.lower`'s docstring.

Per rank: `finish_rank` takes one rank's base stream (its sends, receives and computes, in order) and
merges these in with one sort. The lowering of all ranks at once (`pipec.passes.lower`) calls it only for
the ranks that have collectives or memory ops; the others get their closing REDUCE_GRADs and STEPs there,
vectorised over ranks. The fsdp windows are placed by a loop over windows (one per stage without a bound)
and, with `max_gathered`, the Belady walk over steps.
"""

from __future__ import annotations

import numpy as np

from pipec.errors import error
from pipec.ir.dataparallel import DataParallel
from pipec.ir.opcodes import CODE, IS_COMPUTE, IS_RECV, MEMOPS, REDUCE_GRAD, RESHARD, STEP, UNSHARD
from pipec.ir.program import RankProgram
from pipec.ir.schedule import Collective, MemOp, RankOps, Schedule


def finish_rank(
    sched: Schedule,
    rank: int,
    ops: RankOps,
    step: np.ndarray,
    code: np.ndarray,
    peer: np.ndarray,
    src: np.ndarray,
    group: np.ndarray,
    other_col: np.ndarray | None,
    dp: DataParallel,
    placed: list[list[tuple[int, Collective | MemOp]]],
) -> RankProgram:
    """Rank `rank`'s Program from its base stream (code, peer, src: the op each instruction comes from,
    group, other_col: a graph's other stage, None on the chain; step: each op's step): the collectives and
    memory ops merged in, REDUCE_GRAD and STEP at the end; appends what the schedule itself placed, as
    (instruction index, collective or memory op), to `placed`."""
    mb, stage = ops.mb, ops.stage
    own = np.asarray(sched.stages_of(rank), dtype=np.int64)[::-1]
    memops = sched.memops[rank] if rank < len(sched.memops) else ()
    if dp.is_default and not memops:  # no data parallelism, as before PP x DP: the reductions, then the steps
        if "B" not in sched.kinds:  # nothing to reduce or step
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
