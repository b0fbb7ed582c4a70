"""Memory over time: the two pools' curves of a simulated (or measured) Timeline, per rank.

The rule of what each instruction does to the device and host pools is
`pipec.sim.memory.instruction_deltas`', and whether a compute or host-link
instruction makes it at its start or its end is `DEVICE_AT_START` /
`HOST_AT_START` there; this module places the changes at the Timeline's
times of the instructions:

- FWD and RECOMPUTE at their start (memory is allocated as the forward runs),
  BWD and WGRAD at their end (what they free is freed when they are done);
- OFFLOAD: the host copy is allocated when the transfer starts, the device copy
  freed when it ends; RELOAD: the device copy at its start, the host copy freed
  at its end (both pools hold the micro-batch during a transfer). Times are the
  Timeline's host-link rows (`host_*`); a Timeline without them (a simulator
  that does not run the host link, a measured run) places both at the
  instruction's issue;
- UNSHARD when its rank's stream issued it, RESHARD at its instant (fsdp);
- anything else, at its issue: the end of the last compute before it on the
  rank (0 before any).

Changes at one instant apply in the rank's instruction order. When every change
happens in instruction order (no host link), the largest value of a curve is
`pipec.sim.memory.program_memory`'s peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pipec.ir.opcodes import IS_HOST, ON_COMPUTE, RESHARD, UNSHARD, WGRAD
from pipec.ir.program import Program, RankProgram
from pipec.sim.memory import DEVICE_AT_START, HOST_AT_START, instruction_deltas, resident, unit_of
from pipec.sim.timeline import Timeline

Curve = tuple[np.ndarray, np.ndarray]  # (times, values): the value from each time on


@dataclass(frozen=True, eq=False)
class MemoryCurves:
    """Per rank, the device and host pools over time (collapsed step functions) and their peaks (from
    every step); the model's unit ("bytes" or "units") and per-rank limits (NaN: none)."""

    device: tuple[Curve, ...]
    host: tuple[Curve, ...]
    device_peak: np.ndarray
    host_peak: np.ndarray
    unit: str
    limit: np.ndarray
    host_limit: np.ndarray

    @property
    def offloads(self) -> bool:
        """Whether any rank's host pool holds anything at some time (then the host curves are drawn)."""
        return bool((self.host_peak > 0).any())


def _key(*cols: np.ndarray) -> np.ndarray:
    """One int64 key per row of non-negative integer columns."""
    out = np.zeros(len(cols[0]), dtype=np.int64)
    for c in cols:
        c = np.asarray(c, dtype=np.int64)
        out = out * (int(c.max()) + 1 if len(c) else 1) + c
    return out


def _occurrence(key: np.ndarray) -> np.ndarray:
    """For each row, how many earlier rows have its key (0 for the first)."""
    o = np.argsort(key, kind="stable")
    k = key[o]
    starts = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1]))) if len(k) else np.zeros(0, np.int64)
    out = np.empty(len(k), dtype=np.int64)
    out[o] = np.arange(len(k)) - np.repeat(starts, np.diff(np.append(starts, len(k))))
    return out


def _match(queries: list[np.ndarray], rows: list[np.ndarray], occurrence: bool = False):
    """For each query (columns of non-negative ints), whether a row has the same columns, and that row's
    index; with `occurrence`, the k-th query of a key matches the k-th row of it."""
    nq = len(queries[0])
    cols = [np.concatenate([np.asarray(q, np.int64), np.asarray(w, np.int64)]) for q, w in zip(queries, rows)]
    keys = _key(*cols)
    if occurrence:
        keys = _key(keys, np.concatenate([_occurrence(keys[:nq]), _occurrence(keys[nq:])]))
    q, w = keys[:nq], keys[nq:]
    if not len(w) or not nq:
        return np.zeros(nq, bool), np.zeros(nq, np.int64)
    o = np.argsort(w, kind="stable")
    pos = np.minimum(np.searchsorted(w[o], q), len(w) - 1)
    return w[o][pos] == q, o[pos]


def _times(tl: Timeline, prog: Program) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per rank, the time of each instruction's change to the device pool and to the host pool."""
    empty = np.zeros(0, np.int64)
    ir = np.concatenate([np.full(len(rp), r, dtype=np.int64) for r, rp in enumerate(prog.ranks)] + [empty])
    op = np.concatenate([rp.op for rp in prog.ranks] + [empty])
    mb = np.maximum(np.concatenate([rp.mb for rp in prog.ranks] + [empty]), 0)
    st = np.maximum(np.concatenate([rp.stage for rp in prog.ranks] + [empty]), 0)
    dev_t, host_t = np.full(len(op), np.nan), np.full(len(op), np.nan)
    comp = ON_COMPUTE[op]
    c_end = np.full(len(op), -np.inf)  # each compute's end, for the issue times of what follows it
    if comp.any() and len(tl.rank):
        idx = np.flatnonzero(comp)
        found, row = _match([ir[idx], op[idx], mb[idx], st[idx]], [tl.rank, tl.op, np.maximum(tl.mb, 0), tl.stage])
        idx, row = idx[found], row[found]
        t = np.where(DEVICE_AT_START[op[idx]], tl.start[row], tl.end[row])
        dev_t[idx] = host_t[idx] = t
        c_end[idx] = tl.end[row]
    h_rank = getattr(tl, "host_rank", None)  # the host link's rows, where the simulator records them
    if h_rank is not None and len(h_rank) and IS_HOST[op].any():
        idx = np.flatnonzero(IS_HOST[op])
        rows = [h_rank, tl.host_op, np.maximum(tl.host_mb, 0), np.maximum(tl.host_stage, 0)]
        found, row = _match([ir[idx], op[idx], mb[idx], st[idx]], rows)
        idx, row = idx[found], row[found]
        a, b = tl.host_start[row], tl.host_end[row]
        host_t[idx] = np.where(HOST_AT_START[op[idx]], a, b)
        dev_t[idx] = np.where(DEVICE_AT_START[op[idx]], a, b)
    win = np.isin(op, [UNSHARD, RESHARD])
    if win.any() and len(tl.coll_rank):
        idx = np.flatnonzero(win)
        found, row = _match([ir[idx], op[idx], st[idx]], [tl.coll_rank, tl.coll_op, tl.coll_stage], occurrence=True)
        idx, row = idx[found], row[found]
        t = np.where(op[idx] == UNSHARD, tl.coll_issue[row], tl.coll_start[row])
        dev_t[idx] = host_t[idx] = t
    out_d, out_h, lo = [], [], 0
    for rp in prog.ranks:  # everything else at its issue: the end of the last compute before it, 0 before any
        hi = lo + len(rp)
        issue = (
            np.maximum(np.maximum.accumulate(np.concatenate(([0.0], c_end[lo:hi])))[:-1], 0.0)
            if hi > lo
            else np.zeros(0)
        )
        out_d.append(np.where(np.isnan(dev_t[lo:hi]), issue, dev_t[lo:hi]))
        out_h.append(np.where(np.isnan(host_t[lo:hi]), issue, host_t[lo:hi]))
        lo = hi
    return out_d, out_h


def _curves(
    times: list[np.ndarray], deltas: list[np.ndarray], bases: np.ndarray
) -> tuple[tuple[Curve, ...], np.ndarray]:
    """Every rank's `_curve` (collapsed) and its peak (of the curve before collapsing: a rise and a fall at
    one instant count), in one pass over all ranks: at p=10,000 the call per rank and pool was a third of
    a check. Each rank's rows are its start point (time 0, nothing changed) and then its changes, ordered by
    rank, time and instruction order."""
    counts = np.array([len(t) for t in times], dtype=np.int64) + 1  # + the start point
    R = len(counts)
    rank = np.repeat(np.arange(R), counts)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    t = np.zeros(len(rank))
    d = np.zeros(len(rank))
    within = np.arange(len(rank)) - first[rank]  # 0 for the start point, then 1 + instruction index
    rest = within > 0
    t[rest] = np.concatenate(times) if R else t[rest]
    d[rest] = np.concatenate(deltas) if R else d[rest]
    o = np.lexsort((within, t, rest, rank))  # per rank its start point, then its changes by time and index
    t, d, rank = t[o], d[o], rank[o]
    # each rank's own running sum, summed as `_curve` sums it (one cumulative sum over all ranks less each
    # rank's offset would round differently, and a value that returns to the base might not equal it)
    v = bases[rank] + np.concatenate([np.cumsum(x) for x in np.split(d, first[1:])] or [d])
    peaks = np.maximum.reduceat(v, first) if len(v) else np.zeros(R)
    last = np.ones(len(t), dtype=bool)  # collapse: the last row at each (rank, time) ...
    last[:-1] = (t[1:] != t[:-1]) | (rank[1:] != rank[:-1])
    t, v, rank = t[last], v[last], rank[last]
    moved = np.ones(len(t), dtype=bool)  # ... and only rows where the value moves (each rank's first kept)
    moved[1:] = (v[1:] != v[:-1]) | (rank[1:] != rank[:-1])
    t, v, rank = t[moved], v[moved], rank[moved]
    cut = np.searchsorted(rank, np.arange(1, R))
    return tuple(zip(np.split(t, cut), np.split(v, cut), strict=True)), peaks


def memory_curves(tl: Timeline, prog: Program, model: Mapping[str, np.ndarray]) -> MemoryCurves:
    """The device and host curves of each rank of the Program that ran as `tl`, under a
    `pipec.sim.memory.memory_model` (the module docstring says when each instruction counts)."""
    deltas = instruction_deltas(prog, model)
    dev_t, host_t = _times(tl, prog)
    n = prog.dp if prog.dp_kind == "fsdp" else 1
    bases = np.asarray(resident(prog.placement_array, model, prog.num_ranks, n), dtype=float)
    dev, dpk = _curves(dev_t, [d for d, _ in deltas], bases)
    host, hpk = _curves(host_t, [h for _, h in deltas], np.zeros(len(bases)))
    return MemoryCurves(
        dev,
        host,
        dpk,
        np.maximum(hpk, 0.0),
        unit_of(model),
        np.asarray(model["limit"], dtype=float),
        np.asarray(model["host_limit"], dtype=float),
    )


def timeline_program(tl: Timeline, split_backward: bool | None = None) -> Program:
    """The instruction streams a Timeline shows (a measured run's, or a simulated one whose Program is not
    at hand): per rank its computes, host-link transfers and fsdp windows in the order they started (a
    collective just before the compute it preceded). Enough for `memory_curves`, which needs only what
    each instruction is and when it ran; the messages are left out (they hold no memory). At one instant a
    collective goes before the computes that start then: exact unless a compute takes no time, when the Timeline
    alone cannot tell a window closed after it from one closed before it (`memory_curves` with the Program can)."""
    split = bool((tl.op == WGRAD).any()) if split_backward is None else split_backward
    h_rank = getattr(tl, "host_rank", np.zeros(0, np.int64))
    parts = [  # (rank, op, mb, stage, time, order at one time)
        (tl.rank, tl.op, tl.mb, tl.stage, tl.start, np.ones(len(tl.rank))),
        (h_rank, tl.host_op, tl.host_mb, tl.host_stage, tl.host_start, np.full(len(h_rank), 2.0))
        if len(h_rank)
        else None,
        (tl.coll_rank, tl.coll_op, -np.ones_like(tl.coll_rank), tl.coll_stage, tl.coll_issue, 0.0 * tl.coll_issue)
        if len(tl.coll_rank)
        else None,
    ]
    cols = [np.concatenate([np.asarray(p[k]) for p in parts if p is not None]) for k in range(6)]
    rank, op, mb, stage, when, tie = cols
    ranks = []
    for r in range(tl.num_ranks):
        sel = np.flatnonzero(rank == r)
        sel = sel[np.lexsort((tie[sel], when[sel]))]
        z = np.full(len(sel), -1, dtype=np.int64)
        i64 = [c[sel].astype(np.int64) for c in (op, mb, stage)]
        ranks.append(RankProgram(*i64, z, np.zeros(len(sel), bool)))
    stages = int(max(tl.stage.max(initial=-1), tl.coll_stage.max(initial=-1))) + 1
    placement = np.zeros(stages, dtype=np.int64)
    placement[tl.stage] = tl.rank
    placement[tl.coll_stage] = tl.coll_rank
    fsdp = tl.dp_kind == "fsdp" and len(tl.coll_rank)
    return Program(
        "timeline",
        (),
        stages,
        tl.num_ranks,
        int(tl.mb.max(initial=-1)) + 1,
        split,
        tuple(int(x) for x in placement),
        tuple(ranks),
        dp=tl.dp if fsdp else 1,
        dp_kind=tl.dp_kind if fsdp else "ddp",
    )


def timeline_curves(tl: Timeline, model: Mapping[str, np.ndarray], split_backward: bool | None = None) -> MemoryCurves:
    """The curves of a Timeline alone, when the Program that ran is not at hand: `memory_curves` over the
    streams it shows (`timeline_program`)."""
    return memory_curves(tl, timeline_program(tl, split_backward), model)
