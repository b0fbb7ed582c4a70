"""Where the time went: the critical path of a Timeline and, for each idle gap of a rank's compute stream,
the event it waited for.

Both are read off the Timeline alone (simulated or measured), by one rule: an event that did not start at
the step's start started because something else ended at that instant. For a compute op that is a message
arriving at its rank (preferred: the cross-rank wait is the one worth seeing) or the op before it on its
rank's stream; for a message, an event on its sending rank ending when the send began (its producer); for
a collective, a host-link transfer or an optimizer step, an event of its rank. Following that rule back
from the event that ends last gives a chain of tight events from the step's start to its end: its length
is the makespan, which is what makes it the critical path. The same rule applied at the end of an idle
gap names what the rank waited for, so the viewer can say "idle because the activation of F(3, stage 1)
from rank 0 arrived only now" instead of drawing blank space.

Which message a compute op needs is the stage graph's to say (`pipec.ir.rules`): F(i, v) the activation
of micro-batch i along every edge into v, B(i, u) the gradient along every edge out of u. A message names
its sending stage; `attribute` takes each message's receiving stage (`to`: the other end of its edge,
`pipec.view.edges`; without it the chain's, s + 1 or s - 1). Of the messages arriving at an op's rank as
it starts, one the op needs is preferred (on a fan-in: the input that came last); only where none is, any
message arriving then (a rank's own wait on a send, say) is taken, as before.

Where the cost model charges time a Timeline does not record (`overhead`, a rank's own time per send and
receive), nothing ends exactly when the next event starts; then the event that ended last before it is
taken, and the difference is that unrecorded time.

Everything is vectorised (numpy searches over sorted keys), because the viewer runs this on million-op
timelines; only the walk along the path is a Python loop, one step per event on the path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipec.ir.opcodes import KIND_OF
from pipec.sim.timeline import Timeline

# Event kinds, in the order a tie is broken when two events end at the same instant on one rank.
COMPUTE, MESSAGE, COLLECTIVE, HOST, STEP = range(5)
KIND_NAMES = ("compute", "message", "collective", "host", "step")


@dataclass(frozen=True, eq=False)
class Attribution:
    """The critical path (events in time order, as (kind, index into the Timeline's arrays of that kind)),
    its length, and the idle gaps of each rank's compute stream with what each waited for (kind -1:
    nothing ends when the gap ends, so the wait is not explained by the Timeline)."""

    path_kind: np.ndarray
    path_index: np.ndarray
    length: float
    gap_rank: np.ndarray
    gap_start: np.ndarray
    gap_end: np.ndarray
    gap_kind: np.ndarray
    gap_index: np.ndarray

    def on_path(self, kind: int, n: int) -> np.ndarray:
        """A mask over the `n` events of one kind: which lie on the critical path."""
        mask = np.zeros(n, dtype=bool)
        mask[self.path_index[self.path_kind == kind]] = True
        return mask


@dataclass(frozen=True, eq=False)
class _Events:
    """Every interval of a Timeline in one table: its kind and index, the rank it ends on (a message: its
    receiver), the rank whose events may have held it up (a message: its sender), start and end."""

    kind: np.ndarray
    index: np.ndarray
    rank: np.ndarray
    pred_rank: np.ndarray
    start: np.ndarray
    end: np.ndarray


def _events(tl: Timeline) -> _Events:
    parts = [
        (COMPUTE, tl.rank, tl.rank, tl.start, tl.end),
        (MESSAGE, tl.msg_dst, tl.msg_src, tl.msg_send, tl.msg_arrival),
        (COLLECTIVE, tl.coll_rank, tl.coll_rank, tl.coll_start, tl.coll_end),
        (HOST, tl.host_rank, tl.host_rank, tl.host_start, tl.host_end),
        (STEP, tl.step_rank, tl.step_rank, tl.step_start, tl.step_end),
    ]
    cols: list[list[np.ndarray]] = [[], [], [], [], [], []]
    for kind, rank, pred, start, end in parts:
        n = len(start)
        for c, v in zip(cols, (np.full(n, kind), np.arange(n), rank, pred, start, end)):
            c.append(np.asarray(v))
    kind, index, rank, pred, start, end = (np.concatenate(c) for c in cols)
    return _Events(
        kind.astype(np.int64),
        index.astype(np.int64),
        rank.astype(np.int64),
        pred.astype(np.int64),
        start.astype(float),
        end.astype(float),
    )


def chain_receivers(tl: Timeline) -> np.ndarray:
    """Each message's receiving stage on the chain: s + 1 for an activation, s - 1 for a gradient."""
    return np.where(tl.msg_kind == 0, tl.msg_stage + 1, tl.msg_stage - 1).astype(np.int64)


def _tolerance(tl: Timeline) -> float:
    """Two instants are one when they differ by less than this: times are sums of costs, so a rounding
    error of a few ulps of the makespan separates instants that are equal by construction."""
    return 1e-9 * max(1.0, abs(tl.makespan))


class _Finder:
    """Finds, for many (rank, instant) queries at once, an event of a chosen set ending on that rank at that
    instant (the first by kind order; -1 when none).

    One search for all queries: each row's key is its rank times (M + 1) plus the position of its end among
    the M distinct ends, so keys sort as (rank, end) do and an instant's bound is an exact integer too
    (e >= x exactly when e's position is at least x's left insertion point; e <= x when it is below x's
    right one). Ten thousand ranks are one searchsorted, not ten thousand."""

    def __init__(self, ev: _Events, select: np.ndarray, tol: float) -> None:
        idx = np.flatnonzero(select)
        order = np.lexsort((ev.kind[idx], ev.end[idx], ev.rank[idx]))
        self.rows = idx[order]
        self.rank = ev.rank[self.rows]
        self.end = ev.end[self.rows]
        self.tol = tol
        self.ends = np.unique(self.end)
        self.width = len(self.ends) + 1
        self.key = self.rank * self.width + np.searchsorted(self.ends, self.end, side="left")

    def _bounds(self, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each query's rank's rows begin and end in the sorted rows."""
        base = np.asarray(rank, np.int64) * self.width
        return np.searchsorted(self.key, base, side="left"), np.searchsorted(self.key, base + self.width, side="left")

    def find(self, rank: np.ndarray, t: np.ndarray, exclude: np.ndarray | None = None) -> np.ndarray:
        out = np.full(len(t), -1, dtype=np.int64)
        if not len(self.rows) or not len(t):
            return out
        rank = np.asarray(rank, np.int64)
        _, hi = self._bounds(rank)
        at = np.searchsorted(self.ends, t - self.tol, side="left")  # ends >= t - tol
        k = np.searchsorted(self.key, rank * self.width + at, side="left")
        last = len(self.rows) - 1
        for _ in range(2):  # skip the excluded row itself (a zero-length event ending at its own start)
            kk = np.minimum(k, last)
            hit = (k < hi) & (np.abs(self.end[kk] - t) <= self.tol)
            out = np.where(hit, self.rows[kk], -1)
            if exclude is None:
                break
            same = hit & (out == exclude)
            if not same.any():
                break
            k = np.where(same, k + 1, k)
        return out

    def latest(self, rank: np.ndarray, t: np.ndarray, exclude: np.ndarray) -> np.ndarray:
        """For each query, the event of its rank that ends last at or before the instant (-1: none)."""
        out = np.full(len(t), -1, dtype=np.int64)
        if not len(self.rows) or not len(t):
            return out
        rank = np.asarray(rank, np.int64)
        lo, _ = self._bounds(rank)
        below = np.searchsorted(self.ends, t + self.tol, side="right")  # ends <= t + tol
        k = np.searchsorted(self.key, rank * self.width + below, side="left") - 1
        rows = np.where(k >= lo, self.rows[np.maximum(k, 0)], -1)
        back = (rows == exclude) & (k - 1 >= lo)  # itself (zero length): the one before it
        before = self.rows[np.maximum(k - 1, 0)]
        return np.where(back, before, np.where(rows == exclude, -1, rows))


def _needed(tl: Timeline, to: np.ndarray, tol: float) -> np.ndarray:
    """Per compute op (in the Timeline's order), the row in `ev` of the message it needs that arrived last
    at or before its start, when that arrival is its start (-1 otherwise): the input it waited for.

    A message is keyed by (receiving rank, kind, micro-batch, receiving stage), an op by (rank, the kind of
    message its kind needs, micro-batch, stage): F needs activations (kind 0), B gradients (kind 1)."""
    n = len(tl.start)
    out = np.full(n, -1, np.int64)
    need = np.where(KIND_OF[tl.op] == 0, 0, np.where(KIND_OF[tl.op] == 1, 1, -1))  # W, RECOMPUTE: none
    if not len(tl.msg_kind) or not (need >= 0).any():
        return out
    S = int(max(tl.stage.max(initial=0), tl.msg_stage.max(initial=0), to.max(initial=0))) + 2
    U = int(max(tl.mb.max(initial=0), tl.msg_mb.max(initial=0))) + 1

    def key(rank, kind, mb, stage):
        return ((np.asarray(rank, np.int64) * 2 + kind) * U + mb) * S + (np.asarray(stage, np.int64) + 1)

    m_key = key(tl.msg_dst, tl.msg_kind, tl.msg_mb, to)
    groups, g = np.unique(m_key, return_inverse=True)
    ends = np.unique(tl.msg_arrival)
    W = len(ends) + 1
    code = g * W + np.searchsorted(ends, tl.msg_arrival, side="left")
    order = np.argsort(code, kind="stable")
    code = code[order]
    comp = np.flatnonzero(need >= 0)
    q = key(tl.rank[comp], need[comp], tl.mb[comp], tl.stage[comp])
    gq = np.minimum(np.searchsorted(groups, q), len(groups) - 1)
    known = groups[gq] == q
    below = np.searchsorted(ends, tl.start[comp] + tol, side="right")  # arrivals <= start + tol
    k = np.searchsorted(code, gq * W + below, side="left") - 1
    kk = np.maximum(k, 0)
    hit = known & (k >= 0) & (code[kk] // W == gq)
    j = order[kk]
    hit &= np.abs(tl.msg_arrival[j] - tl.start[comp]) <= tol
    msg_row = len(tl.start) + j  # messages follow the compute ops in `ev` (`_events`)
    out[comp[hit]] = msg_row[hit]
    return out


def _predecessors(ev: _Events, tol: float, first: float, needed: np.ndarray | None = None) -> np.ndarray:
    """For each event, the event whose end let it start (-1: it started at the step's start, or nothing
    ends then). A compute op prefers a message it needs arriving as it starts (`needed`, per compute op),
    then any message arriving at its rank; other events look on their own (a message: its sender's) rank,
    among events that are not messages."""
    n = len(ev.kind)
    is_msg = ev.kind == MESSAGE
    msgs = _Finder(ev, is_msg, tol)
    local = _Finder(ev, ~is_msg, tol)
    all_rows = np.arange(n)
    pred = local.find(ev.pred_rank, ev.start, exclude=all_rows)
    comp = np.flatnonzero(ev.kind == COMPUTE)
    via_msg = msgs.find(ev.rank[comp], ev.start[comp])
    if needed is not None:
        via_msg = np.where(needed >= 0, needed, via_msg)
    pred[comp] = np.where(via_msg >= 0, via_msg, pred[comp])
    # Nothing ends exactly then: time the Timeline does not record (the cost model's per-message
    # `overhead`, the rank's own time) lies between. The wait is on what ended last before it.
    lost = np.flatnonzero((pred < 0) & (ev.start > first + tol))
    if len(lost):
        near = local.latest(ev.pred_rank[lost], ev.start[lost], lost)
        is_comp = ev.kind[lost] == COMPUTE
        m = np.where(is_comp, msgs.latest(ev.rank[lost], ev.start[lost], lost), -1)
        better = (m >= 0) & ((near < 0) | (ev.end[np.maximum(m, 0)] >= ev.end[np.maximum(near, 0)]))
        pred[lost] = np.where(better, m, near)
    pred[ev.start <= first + tol] = -1
    return pred


def attribute(tl: Timeline, to: np.ndarray | None = None) -> Attribution:
    """The critical path and the gap attribution of a Timeline (module docstring); `to`: each message's
    receiving stage on a stage graph (None: the chain's)."""
    ev = _events(tl)
    tol = _tolerance(tl)
    empty_i, empty_f = np.zeros(0, np.int64), np.zeros(0, float)
    if not len(ev.kind):
        return Attribution(empty_i, empty_i, 0.0, empty_i, empty_f, empty_f, empty_i, empty_i)
    first = min(float(ev.start.min()), 0.0)
    receivers = np.asarray(to, np.int64) if to is not None else chain_receivers(tl)
    pred = _predecessors(ev, tol, first, _needed(tl, receivers, tol))
    # The walk back from the event that ends last (ties: the earliest kind, a compute op).
    last = int(np.lexsort((ev.kind, -ev.end))[0])
    path, seen, e = [], set(), last
    while e >= 0 and e not in seen:
        seen.add(e)
        path.append(e)
        e = int(pred[e])
    path.reverse()
    p = np.asarray(path, dtype=np.int64)
    length = float(ev.end[last] - first)  # the chain runs back to the step's start (module docstring)
    g_rank, g_start, g_end, g_row = _gaps(tl, ev, pred, tol, first)
    g_kind = np.where(g_row >= 0, ev.kind[np.maximum(g_row, 0)], -1)
    g_index = np.where(g_row >= 0, ev.index[np.maximum(g_row, 0)], -1)
    return Attribution(ev.kind[p], ev.index[p], length, g_rank, g_start, g_end, g_kind, g_index)


def _gaps(tl: Timeline, ev: _Events, pred: np.ndarray, tol: float, first: float):
    """The idle gaps of each rank's compute stream (from the step's start to its first op, and between
    ops) longer than the tolerance, and the event each waited for: what let the op after the gap start,
    unless that is the op before the gap itself (then the wait is on something else ending then)."""
    comp = np.flatnonzero(ev.kind == COMPUTE)
    order = comp[np.lexsort((ev.start[comp], ev.rank[comp]))]
    rank, start, end = ev.rank[order], ev.start[order], ev.end[order]
    new_rank = np.r_[True, rank[1:] != rank[:-1]] if len(order) else np.zeros(0, bool)
    prev_end = np.full(len(order), first)
    if len(order):  # the latest end so far on the rank (pairs and measured runs may overlap)
        seg = np.cumsum(new_rank) - 1
        ends = np.unique(end)  # a running maximum per rank at once: over (rank, position of the end) keys
        width = len(ends) + 1
        code = np.maximum.accumulate(seg * width + np.searchsorted(ends, end)) - seg * width
        run = ends[code]
        prev_end = np.where(new_rank, first, np.r_[first, run[:-1]])
    is_gap = start - prev_end > tol
    rows = order[is_gap]
    waited = pred[rows]
    # A gap ends when its op starts; the op before it ended earlier, so `pred` is never that op here.
    return rank[is_gap], prev_end[is_gap], start[is_gap], waited
