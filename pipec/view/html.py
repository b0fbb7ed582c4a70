"""The interactive view: a schedule's timelines as one self-contained HTML file (`pipec view`, and the
playground's canvas, `pipec serve`).

The page must open from disk with no network and stay responsive at a million ops, so the data is not one
JSON object per op: each column (start, end, rank, micro-batch, ...) is a little-endian typed array,
deflated (zlib) and base64-encoded (`encode`; the page inflates it with the browser's own
DecompressionStream), and the front end (`static/viewer.js`, vanilla JS on a <canvas>, no build step) is
inlined with its CSS. What the page draws is computed here, in Python, from the driver's Simulation: the
ops sorted by rank and start (so the page finds the visible window by binary search), each op's source
line, the critical path and what each idle gap waited for (`pipec.view.critical`), the memory curves of
both pools, a measured run matched op by op to its simulation, and a refused schedule's chain of waits.

A document holds panels on one time axis: one per schedule (two with `--compare`), one for a measured run
laid over its simulation, or one for a deadlock.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

import numpy as np

from pipec.ir.opcodes import FWD, KIND_OF, OPCODES, RECOMPUTE
from pipec.sim.timeline import Timeline
from pipec.view.critical import COLLECTIVE, COMPUTE, HOST, MESSAGE, STEP, attribute
from pipec.view.edges import drawn_graph, graph_json, receiving_stages

if TYPE_CHECKING:
    from pipec.driver import Simulation
    from pipec.errors import PipecError
    from pipec.ir.program import Program
    from pipec.ir.schedule import Schedule
    from pipec.sim.memtime import MemoryCurves

# Bits of an op's `flags` column (the page reads the same numbers).
CRITICAL, PAIR_FIRST, PAIR_SECOND, IN_CYCLE = 1, 2, 4, 8
DTYPES = {"f4": "<f4", "i4": "<i4", "i2": "<i2", "u1": "u1"}


# How hard `encode` deflates: 6 for a file (`pipec view`: its size is what is kept), 1 for the playground's
# answers (`compression(1)`: thrown away after one draw; 3.7x faster for 20% more bytes at 10,000 ranks).
_LEVEL: ContextVar[int] = ContextVar("pipec_view_deflate_level", default=6)


@contextmanager
def compression(level: int) -> Iterator[None]:
    """Documents built inside deflate their columns at this zlib level."""
    token = _LEVEL.set(level)
    try:
        yield
    finally:
        _LEVEL.reset(token)


def encode(values: np.ndarray | Sequence[float], dtype: str) -> dict[str, object]:
    """One column for the page: {dtype, n, b64} with the little-endian bytes deflated, then base64."""
    arr = np.ascontiguousarray(np.asarray(values).astype(DTYPES[dtype]))
    packed = zlib.compress(arr.tobytes(), _LEVEL.get())
    return {"dtype": dtype, "n": int(arr.size), "b64": base64.b64encode(packed).decode()}


def decode(col: dict[str, object]) -> np.ndarray:
    """The inverse of `encode` (what the page does in JS; the tests hold the two equal)."""
    raw = zlib.decompress(base64.b64decode(str(col["b64"])))
    return np.frombuffer(raw, dtype=DTYPES[str(col["dtype"])])


@dataclass(frozen=True)
class _Sources:
    """The source lines ops came from, each once: (path, line, text), indexed by the ops' `src` column."""

    rows: list[tuple[str, int, str]]
    index: dict[tuple[str, int], int]

    def add(self, path: str, line: int, text: str) -> int:
        key = (path, line)
        if key not in self.index:
            self.index[key] = len(self.rows)
            self.rows.append((path, line, text))
        return self.index[key]


def _op_sources(tl: Timeline, sched: Schedule | None, sources: _Sources) -> tuple[np.ndarray, np.ndarray]:
    """Per compute event: the index of its source line (-1: unknown) and its pair flags, found by its
    (rank, kind, stage, micro-batch) among the Schedule's ops (a RECOMPUTE: its forward's line)."""
    n = len(tl.start)
    src, flags = np.full(n, -1, np.int64), np.zeros(n, np.int64)
    if sched is None or not sched.ranks or not n:
        return src, flags
    S, K = max(sched.num_stages, 1), len(sched.kinds)
    # All ranks' ops at once (a loop over ten thousand ranks' small arrays costs more than the work).
    lengths = np.fromiter((len(r) for r in sched.ranks), np.int64, len(sched.ranks))
    cat = {f: np.concatenate([getattr(r, f) for r in sched.ranks]) for f in ("kind", "stage", "mb", "sid", "paired")}
    U = int(max(tl.mb.max(), cat["mb"].max() if len(cat["mb"]) else 0)) + 1

    def key(rank, kind, stage, mb):
        return ((np.asarray(rank, np.int64) * K + kind) * S + stage) * U + mb

    k_all = key(np.repeat(np.arange(len(sched.ranks)), lengths), cat["kind"], cat["stage"], cat["mb"])
    sid_all = cat["sid"]
    first = cat["paired"].astype(bool)
    starts = np.zeros(len(first), bool)
    starts[np.cumsum(lengths)[:-1][lengths[1:] > 0]] = True  # each rank's first op follows no op of its own
    second = np.r_[False, first[:-1]] & ~starts if len(first) else first
    pf_all = first * PAIR_FIRST + second * PAIR_SECOND
    order = np.argsort(k_all, kind="stable")
    k_all, sid_all, pf_all = k_all[order], sid_all[order], pf_all[order]
    op = np.where(tl.op == RECOMPUTE, FWD, tl.op)
    q = key(tl.rank, KIND_OF[op], tl.stage, tl.mb)
    pos = np.minimum(np.searchsorted(k_all, q), len(k_all) - 1)
    hit = (k_all[pos] == q) & (KIND_OF[op] >= 0)
    flags[hit] = pf_all[pos[hit]] * (tl.op[hit] != RECOMPUTE)
    path = sched.source.path if sched.source else sched.name
    line_src: dict[int, int] = {}
    for sid in np.unique(sid_all[pos[hit]]).tolist():
        if 0 <= sid < len(sched.spans):
            line = sched.spans[sid].line
            text = sched.source.line(line).strip() if sched.source else ""
            line_src[sid] = sources.add(path, line, text)
    lut = np.full(len(sched.spans) + 1, -1, np.int64)
    for sid, i in line_src.items():
        lut[sid] = i
    sid_hit = sid_all[pos[hit]]
    src[hit] = np.where((sid_hit >= 0) & (sid_hit < len(sched.spans)), lut[np.clip(sid_hit, 0, len(lut) - 1)], -1)
    return src, flags


def _offsets(rank: np.ndarray, num_ranks: int) -> list[int]:
    """Where each rank's rows begin in rows sorted by rank (num_ranks + 1 entries)."""
    return np.searchsorted(rank, np.arange(num_ranks + 1), side="left").astype(int).tolist()


def _curves(curves: MemoryCurves | None, t0: float) -> dict | None:
    if curves is None:
        return None

    # Every rank's samples in one column each (rank r's are [off[r], off[r + 1])): ten thousand ranks are
    # four columns for the page to inflate, not forty thousand.
    n = len(curves.device)

    def column(x: np.ndarray) -> list[float | None]:  # n values, None where absent or not finite
        x = np.asarray(x, float)[:n]
        return [v if np.isfinite(v) else None for v in x.tolist()] + [None] * (n - len(x))

    ranks = [
        {"limit": a, "host_limit": b, "peak": c, "host_peak": d}
        for a, b, c, d in zip(
            column(curves.limit),
            column(curves.host_limit),
            np.asarray(curves.device_peak, float).tolist(),
            np.asarray(curves.host_peak, float).tolist(),
        )
    ]

    def packed(pairs) -> tuple[dict, dict, list[int]]:
        ts = [np.asarray(t, float) - t0 for t, _ in pairs]
        off = np.cumsum([0] + [len(t) for t in ts]).tolist()
        vs = [np.asarray(v, float) for _, v in pairs]
        return encode(np.concatenate(ts or [[]]), "f4"), encode(np.concatenate(vs or [[]]), "f4"), off

    t, v, off = packed(curves.device)
    ht, hv, hoff = packed(curves.host)
    return {
        "unit": curves.unit,
        "ranks": ranks,
        "host": bool(curves.offloads),
        "t": t,
        "v": v,
        "off": off,
        "ht": ht,
        "hv": hv,
        "hoff": hoff,
    }


def timeline_panel(
    tl: Timeline,
    title: str,
    sched: Schedule | None = None,
    curves: MemoryCurves | None = None,
    sources: _Sources | None = None,
    measured: Timeline | None = None,
    program: Program | None = None,
) -> dict[str, object]:
    """One panel: a Timeline's events sorted for the page, with source lines, pairs, the critical path, the
    attributed gaps and the memory curves; with `measured`, that run's times matched op by op (NaN where
    the run has no such op) and its makespan. On a stage graph (the `program`'s or the schedule's) the panel
    carries the graph and each message's receiving stage (`pipec.view.edges`); on the chain neither."""
    sources = sources if sources is not None else new_sources()
    graph = drawn_graph(program.graph if program is not None else sched.graph if sched is not None else None)
    to = None
    if graph is not None:
        placement = program.placement if program is not None else sched.placement  # type: ignore[union-attr]
        to = receiving_stages(tl, graph, program, placement)
    att = attribute(tl, to)
    t0 = min(0.0, float(tl.start.min())) if len(tl.start) else 0.0
    src, flags = _op_sources(tl, sched, sources)
    flags = flags | att.on_path(COMPUTE, len(tl.start)) * CRITICAL
    order = np.lexsort((tl.start, tl.rank))
    ops = {
        "rank": encode(tl.rank[order], "i2"),
        "op": encode(tl.op[order], "u1"),
        "mb": encode(tl.mb[order], "i4"),
        "stage": encode(tl.stage[order], "i2"),
        "start": encode(tl.start[order] - t0, "f4"),
        "end": encode(tl.end[order] - t0, "f4"),
        "src": encode(src[order], "i4"),
        "flags": encode(flags[order], "u1"),
    }
    new_index = _inverse(order)
    panel: dict[str, object] = {
        "title": title,
        "kind": "timeline",
        "origin": tl.origin,
        "ranks": int(tl.num_ranks),
        "makespan": float(tl.makespan),
        "t0": t0,
        "slices": int(tl.slicing.slices) if tl.slicing else 1,
        "ops": ops,
        "op_off": _offsets(tl.rank[order], tl.num_ranks),
        "critical_length": att.length,
        "time_unit": "s" if tl.origin == "measured" or measured is not None else "units",
        "rules": _rules(tl, sched),  # the dependency rule (pipec.ir.rules) the page's selection follows
    }
    if measured is not None:
        mstart, mend = _match(tl, measured)
        ops["mstart"] = encode(mstart[order] - t0, "f4")
        ops["mend"] = encode(mend[order] - t0, "f4")
        panel["kind"] = "overlay"
        panel["measured_makespan"] = float(measured.makespan)
        dur_err = (mend - mstart) - (tl.end - tl.start)
        ok = np.isfinite(dur_err)
        panel["matched"] = int(ok.sum())
        panel["mean_abs_error"] = float(np.abs(dur_err[ok]).mean()) if ok.any() else None
    # Messages: sends on their sender's lane (sorted by sender, send time), receives by receiver.
    m_order = np.lexsort((tl.msg_send, tl.msg_src))
    m_new = _inverse(m_order)
    m_flags = att.on_path(MESSAGE, len(tl.msg_send)) * CRITICAL
    r_order = np.lexsort((tl.msg_arrival, tl.msg_dst))
    panel["msgs"] = {
        "src": encode(tl.msg_src[m_order], "i2"),
        "dst": encode(tl.msg_dst[m_order], "i2"),
        "kind": encode(tl.msg_kind[m_order], "u1"),
        "mb": encode(tl.msg_mb[m_order], "i4"),
        "stage": encode(tl.msg_stage[m_order], "i2"),
        "send": encode(tl.msg_send[m_order] - t0, "f4"),
        "arrival": encode(tl.msg_arrival[m_order] - t0, "f4"),
        "flags": encode(m_flags[m_order], "u1"),
        "recv": encode(m_new[r_order], "i4"),
    }
    if graph is not None:  # the edge each message travels: its sending stage and this one
        panel["msgs"]["to"] = encode(to[m_order], "i2")  # type: ignore[index]
        panel["graph"] = graph_json(graph)
    panel["msg_off"] = _offsets(tl.msg_src[m_order], tl.num_ranks)
    panel["recv_off"] = _offsets(tl.msg_dst[r_order], tl.num_ranks)
    c_order = np.lexsort((tl.coll_start, tl.coll_rank))
    panel["colls"] = {
        "op": encode(tl.coll_op[c_order], "u1"),
        "stage": encode(tl.coll_stage[c_order], "i2"),
        "start": encode(tl.coll_start[c_order] - t0, "f4"),
        "end": encode(tl.coll_end[c_order] - t0, "f4"),
        "flags": encode(att.on_path(COLLECTIVE, len(tl.coll_start))[c_order] * CRITICAL, "u1"),
    }
    panel["coll_off"] = _offsets(tl.coll_rank[c_order], tl.num_ranks)
    h_order = np.lexsort((tl.host_start, tl.host_rank))
    panel["host"] = {
        "op": encode(tl.host_op[h_order], "u1"),
        "mb": encode(tl.host_mb[h_order], "i4"),
        "stage": encode(tl.host_stage[h_order], "i2"),
        "start": encode(tl.host_start[h_order] - t0, "f4"),
        "end": encode(tl.host_end[h_order] - t0, "f4"),
    }
    panel["host_off"] = _offsets(tl.host_rank[h_order], tl.num_ranks)
    a_order = np.lexsort((tl.a2a_start, tl.a2a_rank))  # expert parallelism's all-to-alls, a lane like the host's
    panel["a2a"] = {
        "op": encode(tl.a2a_op[a_order], "u1"),
        "mb": encode(tl.a2a_mb[a_order], "i4"),
        "stage": encode(tl.a2a_stage[a_order], "i2"),
        "start": encode(tl.a2a_start[a_order] - t0, "f4"),
        "end": encode(tl.a2a_end[a_order] - t0, "f4"),
    }
    panel["a2a_off"] = _offsets(tl.a2a_rank[a_order], tl.num_ranks)
    # Gaps, by rank and start; what each waited for, as (kind, index in the page's order of that kind).
    remap = {COMPUTE: new_index, MESSAGE: m_new, COLLECTIVE: _inverse(c_order), HOST: _inverse(h_order)}
    widx = att.gap_index.copy()
    for kind, inv in remap.items():
        sel = att.gap_kind == kind
        widx[sel] = inv[att.gap_index[sel]]
    g_order = np.lexsort((att.gap_start, att.gap_rank))
    panel["gaps"] = {
        "start": encode(att.gap_start[g_order] - t0, "f4"),
        "end": encode(att.gap_end[g_order] - t0, "f4"),
        "wkind": encode(att.gap_kind[g_order], "i2"),
        "widx": encode(widx[g_order], "i4"),
    }
    panel["gap_off"] = _offsets(att.gap_rank[g_order], tl.num_ranks)
    steps_on_path = att.path_kind == STEP
    panel["critical_steps"] = int(steps_on_path.sum())
    panel["memory"] = _curves(curves, t0)
    return panel


def _rules(tl: Timeline, sched: Schedule | None) -> list[list[int]]:
    """The rules by which the panel's ops need one another (`pipec.ir.rules.active`): [kind, needs, stage
    offset, unit offset] each, kinds indexing OP_KINDS (the document's `kind_of` maps an opcode to one)."""
    from pipec.ir.rules import active

    kinds = len(sched.kinds) if sched is not None else (3 if (KIND_OF[tl.op] == 2).any() else 2)
    slices = int(tl.slicing.slices) if tl.slicing else 1
    return [[r.kind, r.needs, r.stage, r.unit] for r in active(kinds, slices)]


def _inverse(order: np.ndarray) -> np.ndarray:
    inv = np.empty(len(order), np.int64)
    inv[order] = np.arange(len(order))
    return inv


def _match(sim: Timeline, run: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """The measured start and end of each simulated compute event: the run's event of the same rank,
    opcode, stage and micro-batch (the n-th of several for the n-th), NaN when the run has none."""

    def keys(tl: Timeline) -> np.ndarray:
        cols = [tl.rank, tl.op, tl.stage, tl.mb]
        out = np.zeros(len(tl.start), np.int64)
        for c, top in zip(cols, (1 << 16, 1 << 8, 1 << 16, 1 << 24)):
            out = out * top + np.asarray(c, np.int64)
        return out

    def occurrence(k: np.ndarray) -> np.ndarray:
        o = np.lexsort((np.arange(len(k)), k))
        ks = k[o]
        first = np.r_[True, ks[1:] != ks[:-1]] if len(ks) else np.zeros(0, bool)
        starts = np.maximum.accumulate(np.where(first, np.arange(len(ks)), 0))
        out = np.empty(len(k), np.int64)
        out[o] = np.arange(len(ks)) - starts
        return out

    ks, kr = keys(sim), keys(run)
    ks = ks * 64 + np.minimum(occurrence(ks), 63)
    kr = kr * 64 + np.minimum(occurrence(kr), 63)
    o = np.argsort(kr, kind="stable")
    kr_sorted = kr[o]
    start, end = np.full(len(ks), np.nan), np.full(len(ks), np.nan)
    if not len(kr):
        return start, end
    pos = np.minimum(np.searchsorted(kr_sorted, ks), len(kr_sorted) - 1)
    hit = kr_sorted[pos] == ks
    start[hit] = run.start[o[pos[hit]]]
    end[hit] = run.end[o[pos[hit]]]
    return start, end


def simulation_panel(sim: Simulation, title: str, sources: _Sources, measured: Timeline | None = None) -> dict:
    """A simulated schedule's panel (its Program's memory curves included)."""
    from pipec.view.report import curves_of

    return timeline_panel(sim.timeline, title, sim.schedule, curves_of(sim), sources, measured, sim.compiled.program)


def deadlock_panel(sched: Schedule, err: PipecError, sources: _Sources) -> dict:
    """A schedule refused for a deadlock: each rank's ops in their order (one slot each: nothing can be
    timed), the ops of the wait cycle flagged, the chain of waits as (waiting op, the op it needs) pairs,
    and the diagnostic."""
    from pipec.ir.opcodes import COMPUTE_OF_KIND, OP_KINDS
    from pipec.passes.deadlock import find_deadlock

    opcode = COMPUTE_OF_KIND[[OP_KINDS.index(k) for k in sched.kinds]]  # the schedule's kind -> its opcode
    rank, op, mb, stage, start = [], [], [], [], []
    for r, ops in enumerate(sched.ranks):
        n = len(ops)
        rank.append(np.full(n, r))
        op.append(opcode[ops.kind])
        mb.append(ops.mb)
        stage.append(ops.stage)
        start.append(np.arange(n, dtype=float))
    tl = Timeline(
        num_ranks=sched.num_ranks,
        rank=np.concatenate(rank),
        op=np.concatenate(op),
        mb=np.concatenate(mb),
        stage=np.concatenate(stage),
        start=np.concatenate(start),
        end=np.concatenate(start) + 0.9,
        slicing=sched.slicing,
        schedule=sched.name,
    )
    panel = timeline_panel(tl, f"{sched.name}: refused (deadlock)", sched, None, sources)
    panel["kind"] = "deadlock"
    offsets = np.cumsum([0] + [len(r) for r in sched.ranks])

    def index_of(r: int, kind: str, m: int, s: int) -> int:
        ops = sched.ranks[r]
        k = sched.kinds.index(kind)
        j = np.flatnonzero((ops.kind == k) & (ops.mb == m) & (ops.stage == s))
        return int(offsets[r] + j[0]) if len(j) else -1

    chain, cycle = [], set()
    for w in find_deadlock(sched):
        at = index_of(w.rank, w.op.kind, w.op.mb, w.op.stage)
        needs = index_of(w.peer, w.needs.kind, w.needs.mb, w.needs.stage)
        stuck = index_of(w.peer, w.peer_op.kind, w.peer_op.mb, w.peer_op.stage)
        chain.append({"rank": w.rank, "at": at, "peer": w.peer, "needs": needs, "peer_at": stuck})
        cycle |= {at, needs, stuck}
    flags = decode(panel["ops"]["flags"]).astype(np.int64).copy()  # ops are in rank order already
    for i in cycle - {-1}:
        flags[i] |= IN_CYCLE
    flags &= ~CRITICAL  # nothing ran: no critical path
    panel["ops"]["flags"] = encode(flags, "u1")
    panel["chain"] = chain
    panel["diagnostic"] = "\n".join(d.format() for d in err.diagnostics)
    panel["gaps"] = {k: encode([], "f4" if k in ("start", "end") else "i4") for k in ("start", "end", "wkind", "widx")}
    panel["gap_off"] = [0] * (sched.num_ranks + 1)
    return panel


def document(panels: Sequence[dict], sources: _Sources, title: str) -> dict[str, object]:
    """The page's data: its panels, the opcode names and the source lines ops name by index."""
    return {
        "format": "pipec-view",
        "version": 1,
        "title": title,
        "opcodes": list(OPCODES),
        "kind_of": KIND_OF.tolist(),  # opcode -> its kind in OP_KINDS (-1: none), for the panels' `rules`
        "sources": [list(s) for s in sources.rows],
        "panels": list(panels),
    }


def static_text(name: str) -> str:
    """A front-end file shipped in the wheel (pipec/view/static)."""
    return resources.files("pipec.view").joinpath("static", name).read_text(encoding="utf-8")


def data_json(doc: dict[str, object]) -> str:
    """The document as JSON safe inside a <script> element (no `</script>` can end it early)."""
    return json.dumps(doc, separators=(",", ":")).replace("<", "\\u003c")


def page(doc: dict[str, object]) -> str:
    """The self-contained HTML page of a document: CSS, JS and data inlined, no network at view time."""
    from html import escape

    return (
        '<!doctype html>\n<html lang=en><head><meta charset=utf-8><link rel="icon" href="data:,">'
        f"<title>{escape(str(doc.get('title', 'pipec view')))}</title>"
        f"<style>{static_text('viewer.css')}</style></head>\n<body>\n"
        '<div id="pipec-view"></div>\n'
        f'<script id="pipec-data" type="application/json">{data_json(doc)}</script>\n'
        f"<script>{static_text('viewer.js')}</script>\n"
        "<script>PipecView.boot(document.getElementById('pipec-view'), "
        "JSON.parse(document.getElementById('pipec-data').textContent));</script>\n"
        "</body></html>\n"
    )


def new_sources() -> _Sources:
    """An empty table of source lines, shared by the panels of one document."""
    return _Sources([], {})


def is_trace_file(target: object) -> bool:
    """Whether a target names a trace file (`pipec simulate --trace`, `pipec run --trace`): a .json file whose
    head holds `traceEvents` (a Program file is JSON too, without it)."""
    import os

    if not isinstance(target, (str, os.PathLike)) or not str(target).endswith(".json") or not os.path.isfile(target):
        return False
    with open(target, "rb") as fh:
        head = fh.read(4096)
    return b'"traceEvents"' in head or b'"otherData"' in head


def view_document(
    target: object,
    params: Sequence[tuple[str, object]] = (),
    docs: Sequence[dict] = (),
    memory: dict[str, object] | None = None,
    topology: str | None = None,
    data_parallel: object = None,
    compare: object = None,
    measured: str | None = None,
    experts: object = None,
    moe_layers: Sequence[int] | None = None,
) -> dict[str, object]:
    """The document `pipec view` writes: a trace file's run; or the target simulated (beside `compare`'s, each
    taking the parameters it declares), with the `measured` run laid over it (simulated, without `docs`, in
    the run's median op times per stage, `costs_of_timeline`); a schedule refused for a deadlock
    (E401) drawn with its chain of waits instead of failing. Other refusals raise their diagnostics.
    `experts` and `moe_layers` (`pipec.driver.simulation`'s) draw each rank's all-to-alls in a lane of their own."""
    from pipec.formats.trace import read_trace
    from pipec.ir.program import Program

    sources = new_sources()
    if is_trace_file(target):
        tl = read_trace(str(target))
        kind = tl.origin
        panel = timeline_panel(tl, f"{tl.schedule or target} ({kind})", None, None, sources)
        return document([panel], sources, f"pipec view: {target}")
    targets = [target] if compare is None else [target, compare]
    objs = [_target(t, params, compare is not None) for t in targets]
    run = None
    if measured:  # checked against the Program it is laid over before anything is sized from it
        from pipec.formats.trace import Bounds

        first = objs[0][0]
        run = read_trace(measured, Bounds.of_program(first, f"`{first.name}`"))
    if run is not None and not docs:  # seconds against seconds: simulated in the run's own op times
        from pipec.sim.cost_files import costs_of_timeline

        docs = [costs_of_timeline(run, f"the medians of {measured}'s ops")]
    drawn = []
    for obj, where in objs:
        dp = None if isinstance(obj, Program) else data_parallel
        ep = None if isinstance(obj, Program) else experts
        drawn.append(target_panel(obj, where, sources, docs, memory, topology, dp, ep, moe_layers, run, not drawn))
    return drawn_document(drawn, sources, docs)


@dataclass(frozen=True)
class Drawn:
    """One target's panel and the schedule it draws; `refusal`: the deadlock (E401) a refused schedule's
    panel shows (its `sim` then None)."""

    panel: dict
    schedule: Schedule
    sim: Simulation | None = None
    refusal: PipecError | None = None


def target_panel(
    obj: Schedule | Program,
    where: str | None,
    sources: _Sources,
    docs: Sequence[dict] = (),
    memory: dict[str, object] | None = None,
    topology: str | None = None,
    data_parallel: object = None,
    experts: object = None,
    moe_layers: Sequence[int] | None = None,
    run: Timeline | None = None,
    first: bool = True,
    compiled: object = None,
) -> Drawn:
    """One panel of a view (`pipec view`'s, each of `--compare`'s two, the playground's and its baseline):
    the target simulated through the driver and titled with its parameters, `run` laid over the `first`
    panel; a Schedule refused for a deadlock (E401) drawn with its chain of waits. Other refusals raise.
    `compiled`: the target already compiled under these options (the playground keeps it between requests,
    `pipec.view.serve`), so only the simulation runs."""
    from pipec import driver
    from pipec.errors import PipecError
    from pipec.ir.schedule import Schedule

    if compiled is not None and any(x is not None for x in (where, topology, data_parallel, experts, moe_layers)):
        raise ValueError("target_panel: a target given compiled takes no compile options (they were its compile's)")
    try:
        overrides = driver.memory_overrides(docs, memory)
        if compiled is not None:
            sim = driver.measure(compiled, docs, overrides)  # type: ignore[arg-type]
        else:
            sim = driver.simulation(obj, docs, overrides, topology, where, data_parallel, experts, moe_layers)  # type: ignore[arg-type]
    except PipecError as e:
        if e.code != "E401" or not isinstance(obj, Schedule):
            raise
        return Drawn(deadlock_panel(obj, e, sources), obj, None, e)
    title = f"{sim.schedule.name} ({_params_text(sim.schedule)})"
    if run is not None and first:
        title += ": simulated (upper) and measured (lower)"
        return Drawn(simulation_panel(sim, title, sources, run), sim.schedule, sim)
    return Drawn(simulation_panel(sim, title, sources), sim.schedule, sim)


def drawn_document(drawn: Sequence[Drawn], sources: _Sources, docs: Sequence[dict] = ()) -> dict[str, object]:
    """The document of these panels on one time axis (two: the page shows the second minus the first,
    per rank); in seconds when the costs are (a cost file, a run's medians)."""
    panels = [d.panel for d in drawn]
    if any(d.get("_from") not in (None, "--cost", "cost=") for d in docs):  # a cost file, a run's medians: seconds
        for p in panels:
            p["time_unit"] = "s" if p["kind"] != "deadlock" else p["time_unit"]
    return document(panels, sources, "pipec view: " + " vs ".join(d.schedule.name for d in drawn))


def _target(
    t: object, params: Sequence[tuple[str, object]], only_declared: bool
) -> tuple[Schedule | Program, str | None]:
    """A view's target as the driver reads it (with `--compare`, each takes the parameters it declares); a
    Program given as an object is validated first (a Program file is, as it is read): a damaged one is
    refused with its diagnostics (E502), never drawn."""
    import os

    from pipec import driver
    from pipec.errors import error
    from pipec.ir.program import Program
    from pipec.ir.schedule import Schedule
    from pipec.ir.validate import validate

    given = list(params)
    if only_declared and not isinstance(t, (Schedule, Program)):
        known = set(driver.param_names(driver.read_source(t)))
        given = [(k, v) for k, v in params if k in known]
    if isinstance(t, Program):
        validate(t)
    elif not isinstance(t, (Schedule, str, os.PathLike)):
        raise error("E000", f"a view takes a schedule's name or path, a Schedule or a Program, not {type(t).__name__}")
    return driver.target_of(t, given)


def _params_text(sched: Schedule) -> str:
    return " ".join(f"{k}={v}" for k, v in sched.params) or "no parameters"


def op_count(doc: dict[str, object]) -> int:
    """How many compute ops a document draws (all panels)."""
    return sum(int(p["ops"]["op"]["n"]) for p in doc["panels"])  # type: ignore[index]
