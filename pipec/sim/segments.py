"""Compute ops cut at their all-to-alls, for the simulator (expert parallelism, docs/moe.md).

A FWD or BWD on a stage with `L` MoE layers issues `all_to_alls(kind, L)` all-to-alls (the opcode table's
`a2a` column, `pipec.ir.experts`), so it is that many plus one compute segments, each but the last followed
by an all-to-all on the rank's expert link (its bytes one at a time, its latency overlapping the next one's),
the next segment waiting for it. An overlapped pair's segments
take turns in `pair_order`, so one op's all-to-all travels while the other computes; without overlap
(`pipec simulate --no-overlap`, the executor's `--no-overlap`) the pair runs one op after the other, each
waiting for its own all-to-alls. `cut` rewrites a rank stream's columns into that order: segment rows keep
their op's opcode (each takes an equal share of its cost), all-to-all rows are marked apart (`a2a` >= 0), and
every other row is copied as it is. The machine (`pipec.sim.machine`) then runs segments as compute ops and
all-to-alls as messages on a channel of their own per rank, as it runs the collectives. The rest of this
module is the simulator's expert bookkeeping: the Plan's fields (`a2a_plan`), each later segment's wait for
its all-to-all (`a2a_needs`), and the Timeline's rows (`a2a_rows`, `merge_segments`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pipec.ir.experts import A2A_PER_LAYER, pair_order
from pipec.ir.opcodes import A2A_KIND, ON_COMPUTE

if TYPE_CHECKING:
    from pipec.sim.plan import Plan


@dataclass(frozen=True, eq=False)
class Cut:
    """The stream's columns after cutting (see the module docstring), and per row: `a2a`, the index of an
    all-to-all within its op (-1: not one); `seg`, a segment's index (-1: not a segment of a cut op);
    `nseg`, its op's segment count (1 for rows not cut); `src`, the row of the op (or other instruction)
    it comes from in the uncut columns; `turn`, whether a segment of an overlapped pair takes the turn from
    the pair's other op (its thread wakes up for it: the cost key `pair_handoff`)."""

    op: np.ndarray
    mb: np.ndarray
    stage: np.ndarray
    peer: np.ndarray
    rank: np.ndarray
    wait_for: np.ndarray
    a2a: np.ndarray
    seg: np.ndarray
    nseg: np.ndarray
    src: np.ndarray
    turn: np.ndarray


def counts(op: np.ndarray, stage: np.ndarray, layers: Sequence[int]) -> np.ndarray:
    """All-to-alls each instruction issues (`all_to_alls` of its opcode's `a2a` kind, vectorised)."""
    per_stage = np.asarray(layers, dtype=np.int64) if len(layers) else np.zeros(1, dtype=np.int64)
    issues = A2A_KIND[op] >= 0
    return np.where(issues, A2A_PER_LAYER * per_stage[np.clip(stage, 0, len(per_stage) - 1)], 0)


def cut(
    op: np.ndarray,
    mb: np.ndarray,
    stage: np.ndarray,
    peer: np.ndarray,
    rank: np.ndarray,
    wait_for: np.ndarray | None,
    group: np.ndarray,
    layers: Sequence[int],
    overlap: bool = True,
) -> Cut:
    """The columns with every op that issues all-to-alls cut (module docstring). A zero-cost row between the
    two ops of a pair (a wait the simulator inserted for the second op) moves before the pair."""
    n_a2a = counts(op, stage, layers)
    on = ON_COMPUTE[op]
    rows: list[tuple[int, int, int, int, bool]] = []  # (src, a2a index, segment index, segment count, turn)
    N = len(op)
    i = 0
    while i < N:
        if not on[i]:
            rows.append((i, -1, -1, 1, False))
            i += 1
            continue
        j = i + 1
        if group[i]:  # its partner: the next compute of the rank (waits may sit between)
            while j < N and not on[j] and rank[j] == rank[i]:
                j += 1
        if group[i] and j < N and on[j] and rank[j] == rank[i]:
            rows.extend((x, -1, -1, 1, False) for x in range(i + 1, j))
            ops, c = (i, j), (int(n_a2a[i]), int(n_a2a[j]))
            if overlap:
                order = pair_order(*c)
            else:
                order = tuple((0, k) for k in range(c[0] + 1)) + tuple((1, k) for k in range(c[1] + 1))
            i = j + 1
        else:
            ops, c = (i,), (int(n_a2a[i]),)
            order = tuple((0, k) for k in range(c[0] + 1))
            i += 1
        last = -1
        for who, k in order:
            x = ops[who]
            cut_op = c[who] > 0
            rows.append((x, -1, k if cut_op else -1, c[who] + 1, overlap and len(ops) == 2 and 0 <= last != who))
            last = who
            if k < c[who]:
                rows.append((x, k, -1, 1, False))
    src, a2a, seg, nseg, turn = (
        (np.array(col, dtype=np.int64) for col in zip(*rows)) if rows else (np.zeros(0, np.int64),) * 5
    )
    new_of = np.full(N, -1, dtype=np.int64)
    plain = (a2a < 0) & (seg <= 0)  # one row per source instruction: its first segment, or itself
    new_of[src[plain]] = np.flatnonzero(plain)
    wf = np.full(len(src), -1, dtype=np.int64)
    if wait_for is not None:
        w = wait_for[src]
        wf = np.where((w >= 0) & (a2a < 0) & (seg <= 0), new_of[np.maximum(w, 0)], -1)
    return Cut(op[src], mb[src], stage[src], peer[src], rank[src], wf, a2a, seg, nseg, src, turn.astype(bool))


def a2a_rows(pl: Plan, start: np.ndarray, end: np.ndarray, send: np.ndarray, arr: np.ndarray) -> dict:
    """The Timeline's all-to-all rows (each from when its expert link took it, its issue or when the one
    before it left the wire, to its arrival) and compute segment rows (the intervals of cut ops that compute).
    A rank's all-to-alls share one latency (its slowest expert link), so the one before left the wire its
    latency before it arrived."""
    a = pl.a_ids
    prev = np.asarray(pl.prev, dtype=np.int64)[a]
    p = np.maximum(prev, 0)
    began = np.where(prev >= 0, np.maximum(send[a], arr[p] - np.asarray(pl.lat)[p]), send[a])
    cutrow = pl.real & (pl.c_seg >= 0)
    return {
        "a2a_rank": pl.a_rank,
        "a2a_op": pl.a_op,
        "a2a_mb": pl.a_mb,
        "a2a_stage": pl.a_stage,
        "a2a_index": pl.a_index,
        "a2a_start": began,
        "a2a_end": arr[a],
        "seg_rank": pl.c_rank[cutrow],
        "seg_op": pl.c_op[cutrow],
        "seg_mb": pl.c_mb[cutrow],
        "seg_stage": pl.c_stage[cutrow],
        "seg_start": start[cutrow],
        "seg_end": end[cutrow],
    }


def merge_segments(seg, src, c_rank, c_op, c_mb, c_stage, start, end):
    """Compute rows with each cut op's segments folded into one row (its first segment's), ending when its
    last segment ends."""
    first = seg <= 0
    last_end = np.zeros(int(src.max()) + 1 if len(src) else 0)
    np.maximum.at(last_end, src, end)
    end = np.where(seg >= 0, last_end[src], end)
    return (a[first] for a in (c_rank, c_op, c_mb, c_stage, start, end))


def a2a_plan(cutting: Cut, cidx: np.ndarray, midx: np.ndarray, a_ids: np.ndarray) -> dict:
    """Plan's expert fields (see `Plan`)."""
    pos = midx[a_ids]
    return {
        "c_seg": cutting.seg[cidx],
        "c_src": cutting.src[cidx],
        "a_ids": a_ids,
        "a_op": cutting.op[pos],
        "a_mb": cutting.mb[pos],
        "a_stage": cutting.stage[pos],
        "a_rank": cutting.rank[pos],
        "a_index": cutting.a2a[pos],
    }


def a2a_needs(need: np.ndarray, cutting: Cut, cidx: np.ndarray, midx: np.ndarray) -> np.ndarray:
    """`need` with each later segment of a cut op waiting for the all-to-all its op issued before it (a
    message id among `midx`)."""
    seg = cutting.seg[cidx]
    later = np.flatnonzero(seg > 0)
    if not len(later):
        return need
    apos = np.flatnonzero(cutting.a2a >= 0)
    width = int(cutting.nseg.max()) + 1
    akey = cutting.src[apos] * width + cutting.a2a[apos]
    o = np.argsort(akey, kind="stable")
    want = cutting.src[cidx[later]] * width + seg[later] - 1
    at = np.searchsorted(akey[o], want)
    need = need.copy()
    need[later] = np.searchsorted(midx, apos[o][at])
    return need
