"""Chrome/Perfetto trace JSON of a Timeline, and back: `write_trace(timeline, path)`, `read_trace(path)`.

One process per rank, with threads for its streams: `compute`, and lanes
`send`/`recv` (`send 2`, ... when messages overlap in time, since a trace
thread must nest its slices), and with data parallelism `collectives` (each
REDUCE_GRAD and UNSHARD from when its collective stream ran it to its end; a
RESHARD as an instant) and `collective wait` (where the compute stream waited
for one), and with memory ops `host link` (each OFFLOAD and RELOAD transfer;
a RECOMPUTE is a compute slice), and with expert parallelism `all-to-all` (each
dispatch, combine or their gradient from when the expert link ran it to its
arrival, named `a2a F1#0`) and `segments` (the compute segments of ops cut at
their all-to-alls; the op's own slice spans its first segment to its last, so
an overlapped pair's two ops sit on two compute lanes). Durations are real, in microseconds. Each
message is a slice on its sender (from the send until it arrives) and on its
receiver (from when the receive was posted, or the send if later, until it
arrives), joined by a flow arrow (flow events v2: `bind_id`, `flow_out`,
`flow_in`), so Perfetto and chrome://tracing draw send -> receive. Memory per
rank is a counter track when memory curves are given (`memory`, the device
pool, and `host memory` when anything is offloaded; `otherData.memory_unit`
says "bytes" or "units"). With token slices (`Timeline.slicing`) an op is named
`F1s2` (slice 2 of micro-batch 1, `pipec.ir.schedule.unit_label`), a message
`act 1s2.0`, and their args carry `mb` (the micro-batch), `slice` and `unit`
(the Timeline's index); `otherData.slicing` holds the slicing. The exact Timeline (but its optimizer steps' rows)
rides along in each event's `args` (seconds), so `read_trace` gives it back
bit for bit; a measured Timeline and a simulated one use the same format.

Open the file at https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import heapq
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipec.errors import PipecError, Source, brief, brief_path, error
from pipec.ir.dataparallel import KINDS
from pipec.ir.program import OPCODES
from pipec.ir.schedule import Slicing, unit_json, unit_label
from pipec.sim.memtime import MemoryCurves
from pipec.sim.timeline import Timeline

FORMAT = "pipec-trace"
VERSION = 1
_KIND = ("act", "grad")
_SHORT = {"FWD": "F", "BWD": "B", "WGRAD": "W", "RECOMPUTE": "R"}
_CNAME = {"FWD": "thread_state_runnable", "BWD": "thread_state_running", "WGRAD": "thread_state_iowait"}
_CNAME["RECOMPUTE"] = "thread_state_sleeping"
_COMPUTE_TID, _SEND_TID, _RECV_TID, _COLL_TID, _WAIT_TID, _HOST_TID = 0, 1000, 2000, 3000, 3500, 4000
_SEG_TID, _A2A_TID = 4500, 5000
_HOST_CNAME = {"OFFLOAD": "olive", "RELOAD": "yellow"}
_COLL_CNAME = {"REDUCE_GRAD": "rail_response", "UNSHARD": "rail_load", "RESHARD": "rail_idle"}


def _us(t: float) -> float:
    return round(t * 1e6, 6)


def _lanes(starts: list[float], ends: list[float]) -> list[int]:
    """Greedy interval colouring in start order: the lowest lane free at each start."""
    order = sorted(range(len(starts)), key=lambda i: (starts[i], ends[i]))
    free: list[int] = []  # heap of free lane numbers
    busy: list[tuple[float, int]] = []  # heap of (end, lane)
    lane = [0] * len(starts)
    count = 0
    for i in order:
        while busy and busy[0][0] <= starts[i]:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            k = heapq.heappop(free)
        else:
            k, count = count, count + 1
        lane[i] = k
        heapq.heappush(busy, (ends[i], k))
    return lane


def _expert_events(tl: Timeline, threads: set, label, which) -> list[dict]:
    """The `all-to-all` and `segments` lanes (module docstring); none without all-to-alls."""
    out: list[dict] = []
    cols = ("rank", "op", "mb", "stage", "index", "start", "end")
    a = [getattr(tl, f"a2a_{c}").tolist() for c in cols]
    for r, op, mb, st, k, t0, t1 in zip(*a):
        name = OPCODES[op]
        threads.add((r, _A2A_TID, "all-to-all"))
        out.append(
            {
                "name": f"a2a {_SHORT.get(name, name)}{label(mb)}.{st}#{k}",
                "cat": "a2a",
                "ph": "X",
                "pid": r,
                "tid": _A2A_TID,
                "ts": _us(t0),
                "dur": _us(t1 - t0),
                "cname": "rail_animation",
                "args": {"op": name, **which(mb), "stage": st, "index": k, "start_s": t0, "end_s": t1},
            }
        )
    g = [getattr(tl, f"seg_{c}").tolist() for c in ("rank", "op", "mb", "stage", "start", "end")]
    for r, op, mb, st, t0, t1 in zip(*g):
        name = OPCODES[op]
        threads.add((r, _SEG_TID, "segments"))
        out.append(
            {
                "name": f"{_SHORT.get(name, name)}{label(mb)}.{st}",
                "cat": "segment",
                "ph": "X",
                "pid": r,
                "tid": _SEG_TID,
                "ts": _us(t0),
                "dur": _us(t1 - t0),
                "cname": _CNAME.get(name, "generic_work"),
                "args": {"op": name, **which(mb), "stage": st, "start_s": t0, "end_s": t1},
            }
        )
    return out


def trace_events(tl: Timeline, memory: MemoryCurves | dict[str, np.ndarray] | None = None) -> dict:
    """The trace as a JSON-ready dict (see the module docstring). `memory` adds counters per rank: the
    device pool (`memory`) and, when anything is offloaded, the host pool (`host memory`) of
    `pipec.sim.memtime.MemoryCurves`; a memory model alone gives the device curve of the computes."""
    events: list[dict] = []
    threads: set[tuple[int, int, str]] = set()
    R = tl.num_ranks
    multi = {r: len(set(tl.stage[tl.rank == r].tolist())) > 1 for r in range(R)}
    sl = tl.slicing

    def label(u: int) -> str:
        return unit_label(sl, u)

    def which(u: int) -> dict[str, int]:
        return unit_json(sl, u)

    c_rank, c_op, c_mb, c_s = tl.rank.tolist(), tl.op.tolist(), tl.mb.tolist(), tl.stage.tolist()
    c_start, c_end = tl.start.tolist(), tl.end.tolist()
    lanes = [0] * len(c_rank)
    for r in range(R):
        idx = np.flatnonzero(tl.rank == r).tolist()
        for j, k in zip(idx, _lanes([c_start[j] for j in idx], [c_end[j] for j in idx])):
            lanes[j] = k
    for j in range(len(c_rank)):
        op = OPCODES[c_op[j]]
        name = f"{_SHORT.get(op, op)}{label(c_mb[j])}" + (f".{c_s[j]}" if multi[c_rank[j]] else "")
        tid = _COMPUTE_TID + lanes[j]
        threads.add((c_rank[j], tid, "compute" if lanes[j] == 0 else f"compute {lanes[j] + 1}"))
        events.append(
            {
                "name": name,
                "cat": op,
                "ph": "X",
                "pid": c_rank[j],
                "tid": tid,
                "ts": _us(c_start[j]),
                "dur": _us(c_end[j] - c_start[j]),
                "cname": _CNAME.get(op, "generic_work"),
                "args": {"op": op, **which(c_mb[j]), "stage": c_s[j], "start_s": c_start[j], "end_s": c_end[j]},
            }
        )

    n = len(tl.msg_send)
    post = tl.msg_post.tolist() if len(tl.msg_post) == n else [math.nan] * n
    kind, mb, st = tl.msg_kind.tolist(), tl.msg_mb.tolist(), tl.msg_stage.tolist()
    src, dst = tl.msg_src.tolist(), tl.msg_dst.tolist()
    send, arr = tl.msg_send.tolist(), tl.msg_arrival.tolist()
    size = tl.msg_bytes.tolist() if len(tl.msg_bytes) == n else [0.0] * n
    r_start = [send[i] if math.isnan(post[i]) else max(post[i], send[i]) for i in range(n)]
    r_end = [max(arr[i], r_start[i]) for i in range(n)]
    s_lane, r_lane = [0] * n, [0] * n
    for r in range(R):
        mine = np.flatnonzero(tl.msg_src == r).tolist()
        for i, k in zip(mine, _lanes([send[i] for i in mine], [arr[i] for i in mine])):
            s_lane[i] = k
        mine = np.flatnonzero(tl.msg_dst == r).tolist()
        for i, k in zip(mine, _lanes([r_start[i] for i in mine], [r_end[i] for i in mine])):
            r_lane[i] = k
    recvs = []
    for i in range(n):
        what = f"{_KIND[kind[i]]} {label(mb[i])}.{st[i]}"
        args = {
            "kind": _KIND[kind[i]],
            **which(mb[i]),
            "stage": st[i],
            "src": src[i],
            "dst": dst[i],
            "send_s": send[i],
            "arrival_s": arr[i],
            "post_s": None if math.isnan(post[i]) else post[i],
            "bytes": size[i],
        }
        tid = _SEND_TID + s_lane[i]
        threads.add((src[i], tid, "send" if s_lane[i] == 0 else f"send {s_lane[i] + 1}"))
        events.append(
            {
                "name": f"{what} -> rank {dst[i]}",
                "cat": "send",
                "ph": "X",
                "pid": src[i],
                "tid": tid,
                "ts": _us(send[i]),
                "dur": _us(arr[i] - send[i]),
                "cname": "grey",
                "bind_id": i + 1,
                "flow_out": True,
                "args": args,
            }
        )
        tid = _RECV_TID + r_lane[i]
        threads.add((dst[i], tid, "recv" if r_lane[i] == 0 else f"recv {r_lane[i] + 1}"))
        recvs.append(
            {
                "name": f"{what} <- rank {src[i]}",
                "cat": "recv",
                "ph": "X",
                "pid": dst[i],
                "tid": tid,
                "ts": _us(r_start[i]),
                "dur": _us(r_end[i] - r_start[i]),
                "cname": "grey",
                "bind_id": i + 1,
                "flow_in": True,
                "args": {**which(mb[i]), "kind": _KIND[kind[i]], "stage": st[i], "from": src[i]},
            }
        )
    events.extend(recvs)  # after every send: a flow's start must come first at equal times

    k_rank, k_op, k_stage = tl.coll_rank.tolist(), tl.coll_op.tolist(), tl.coll_stage.tolist()
    k_issue, k_start, k_end = tl.coll_issue.tolist(), tl.coll_start.tolist(), tl.coll_end.tolist()
    k_bytes = tl.coll_bytes.tolist() if len(tl.coll_bytes) == len(k_rank) else [0.0] * len(k_rank)
    k_after = tl.coll_after.tolist() if len(tl.coll_after) == len(k_rank) else [0] * len(k_rank)
    for i in range(len(k_rank)):
        op = OPCODES[k_op[i]]
        threads.add((k_rank[i], _COLL_TID, "collectives"))
        args = {"op": op, "stage": k_stage[i], "issue_s": k_issue[i], "start_s": k_start[i], "end_s": k_end[i]}
        args["after"] = k_after[i]
        events.append(
            {
                "name": f"{op} {k_stage[i]}",
                "cat": "collective",
                "ph": "X",
                "pid": k_rank[i],
                "tid": _COLL_TID,
                "ts": _us(k_start[i]),
                "dur": _us(k_end[i] - k_start[i]),
                "cname": _COLL_CNAME.get(op, "generic_work"),
                "args": {**args, "bytes": k_bytes[i]},
            }
        )
    h_rank = getattr(tl, "host_rank", np.zeros(0, np.int64)).tolist()
    if h_rank:  # the host link: OFFLOAD/RELOAD transfers
        h_op, h_mb, h_st = tl.host_op.tolist(), tl.host_mb.tolist(), tl.host_stage.tolist()
        h_start, h_end = tl.host_start.tolist(), tl.host_end.tolist()
    for i in range(len(h_rank)):
        op = OPCODES[h_op[i]]
        threads.add((h_rank[i], _HOST_TID, "host link"))
        events.append(
            {
                "name": f"{op.lower()} {label(h_mb[i])}.{h_st[i]}",
                "cat": "host",
                "ph": "X",
                "pid": h_rank[i],
                "tid": _HOST_TID,
                "ts": _us(h_start[i]),
                "dur": _us(h_end[i] - h_start[i]),
                "cname": _HOST_CNAME.get(op, "generic_work"),
                "args": {"op": op, **which(h_mb[i]), "stage": h_st[i], "start_s": h_start[i], "end_s": h_end[i]},
            }
        )
    events += _expert_events(tl, threads, label, which)
    w_rank, w_start, w_end = tl.wait_rank.tolist(), tl.wait_start.tolist(), tl.wait_end.tolist()
    for i in range(len(w_rank)):
        threads.add((w_rank[i], _WAIT_TID, "collective wait"))
        events.append(
            {
                "name": "wait for collective",
                "cat": "collective wait",
                "ph": "X",
                "pid": w_rank[i],
                "tid": _WAIT_TID,
                "ts": _us(w_start[i]),
                "dur": _us(w_end[i] - w_start[i]),
                "cname": "bad",
                "args": {"start_s": w_start[i], "end_s": w_end[i]},
            }
        )

    unit = None
    if memory is not None and not isinstance(memory, MemoryCurves):  # a memory model: timed from the Timeline
        from pipec.sim.memtime import timeline_curves

        memory = timeline_curves(tl, memory)
    if memory is not None:  # the two pools, memory ops included (pipec.sim.memtime)
        unit = memory.unit
        pools = [("memory", memory.device)] + ([("host memory", memory.host)] if memory.offloads else [])
        for name, curves in pools:
            for r, (t, v) in enumerate(curves):
                tt, vv = t.tolist(), v.tolist()
                for k in range(len(tt)):
                    events.append({"name": name, "ph": "C", "pid": r, "ts": _us(tt[k]), "args": {name: vv[k]}})

    meta: list[dict] = []
    for r in range(R):
        meta.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}})
    for r, tid, name in sorted(threads):
        meta.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": r, "tid": tid, "args": {"sort_index": tid}})
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "format": FORMAT,
            "version": VERSION,
            "schedule": tl.schedule,
            "params": {k: v for k, v in tl.params},
            "origin": tl.origin,
            "num_ranks": R,
            "dp": tl.dp,
            "dp_kind": tl.dp_kind,
            "makespan_s": tl.makespan,
            **({"memory_unit": unit} if unit else {}),
            **({"slicing": {"sequences": sl.sequences, **sl.describe()}} if sl is not None else {}),
        },
    }


def write_trace(tl: Timeline, path: str | Path, memory: MemoryCurves | dict[str, np.ndarray] | None = None) -> None:
    """Write the Chrome/Perfetto trace of a Timeline (simulated or measured) to `path`, atomically: a kill
    or a failure midway leaves the old file (or none), never a partial trace."""
    from pipec.files import atomic_write

    if not isinstance(tl, Timeline):
        raise error("E903", f"write_trace takes a Timeline (a simulation's `.timeline`), not {type(tl).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise error("E903", f"write_trace takes a path (str or os.PathLike), not {type(path).__name__}")
    with atomic_write(path) as f:
        json.dump(trace_events(tl, memory), f, separators=(",", ":"))
        f.write("\n")


# What a trace may hold, checked event by event before anything is built from it (docs/errors.md, E802): a
# Program's sizes (pipec/formats/program_file.py bounds them alike; a sibling on this floor, so restated),
# and times of at most TIME_LIMIT seconds either side of the run's start.
MAX_SIZE = 10_000_000
TIME_LIMIT = 1e12
_COMPUTE_OPS = ("FWD", "BWD", "WGRAD", "RECOMPUTE")
_CATS = {
    **{op: _COMPUTE_OPS for op in _COMPUTE_OPS},
    "host": ("OFFLOAD", "RELOAD"),
    "a2a": _COMPUTE_OPS,
    "segment": _COMPUTE_OPS,
    "collective": ("REDUCE_GRAD", "UNSHARD", "RESHARD"),
    "collective wait": (),
    "send": (),
    "recv": (),
}


@dataclass(frozen=True)
class Bounds:
    """What a trace's events may name: ranks, stages and micro-batches (units, with token slices) below
    these. `read_trace` checks a trace against its own header, or against the Program it is laid over
    (`Bounds.of_program`), so that a run of another schedule is refused before anything is allocated or drawn."""

    ranks: int
    stages: int = MAX_SIZE
    microbatches: int = MAX_SIZE
    of: str = "the trace"

    @staticmethod
    def of_program(obj: object, name: str) -> Bounds:
        """The bounds of a Schedule or Program (anything with num_ranks, num_stages, num_microbatches)."""
        return Bounds(int(obj.num_ranks), int(obj.num_stages), int(obj.num_microbatches), name)  # type: ignore[attr-defined]


class _Where:
    """One event of a trace, for the diagnostics that name it: the file, the event's index and name."""

    def __init__(self, path: str, index: int, ev: dict) -> None:
        self.path, self.index = path, index
        self.name = ev.get("name") if isinstance(ev.get("name"), str) else None

    def fail(self, field: str, allowed: str, value: object) -> PipecError:
        what = f"event #{self.index}" + (f" (`{brief(self.name)}`)" if self.name else "")
        return error(
            "E802",
            f"{what}: `{field}` must be {allowed}, got {brief(_shown(value))}",
            source=Source(brief_path(self.path), ""),
        )


def _shown(value: object) -> str:
    """A JSON value as a message quotes it: a string in quotes, a container by its kind (never walked: it
    may nest thousands deep)."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'}"
    return "null" if value is None else "true" if value is True else "false" if value is False else str(value)


def _index(where: _Where, a: dict, field: str, below: int, of: str, prefix: str = "args.") -> int:
    """An integer field from 0 to below - 1 (an index: rank, stage, micro-batch)."""
    v = a.get(field)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < below:
        raise where.fail(prefix + field, f"an integer from 0 to {below - 1:,} ({of})", v)
    return v


def _time(where: _Where, a: dict, field: str, none: bool = False) -> float:
    """A time in seconds: a finite number within TIME_LIMIT of the start (None allowed where `none`)."""
    v = a.get(field)
    if none and v is None:
        return math.nan
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) <= TIME_LIMIT:
        raise where.fail("args." + field, f"a finite number of seconds within +-{TIME_LIMIT:g}", v)
    return float(v)


def _span(where: _Where, a: dict, first: str, last: str) -> tuple[float, float]:
    """Two times, the second no earlier than the first (an op ends after it starts)."""
    t0, t1 = _time(where, a, first), _time(where, a, last)
    if t1 < t0:
        raise where.fail("args." + last, f"at least `args.{first}` ({t0!r})", t1)
    return t0, t1


def _amount(where: _Where, a: dict, field: str) -> float:
    """A byte count: a finite number >= 0 (at most 1e18, as a cost file's quantities)."""
    v = a.get(field, 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1e18:
        raise where.fail("args." + field, "a number of bytes from 0 to 1e18", v)
    return float(v)


def _header(head: object, path: str) -> dict:
    """The trace's `otherData`, checked: format, version (exactly this reader's), sizes and names."""
    src = Source(brief_path(path), "")
    if not isinstance(head, dict):
        raise error("E802", "not a pipec trace: `otherData` is missing or not a JSON object", source=src)
    if head.get("format") != FORMAT:
        raise error("E802", f"not a pipec trace (otherData.format is {brief(_shown(head.get('format')))})", source=src)
    version = head.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version != VERSION:
        raise error(
            "E802",
            f"pipec trace version {brief(_shown(version))} is not supported (this pipec reads version {VERSION})",
            source=src,
        )

    def bad(field: str, allowed: str) -> PipecError:
        return error("E802", f"otherData.{field} must be {allowed}, got {brief(_shown(head.get(field)))}", source=src)

    for field, default in (("num_ranks", None), ("dp", 1)):
        v = head.get(field, default)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SIZE:
            raise bad(field, f"an integer from 1 to {MAX_SIZE:,}")
    if head.get("dp_kind", "ddp") not in KINDS:
        raise bad("dp_kind", " or ".join(KINDS))
    for field in ("schedule", "origin"):
        if not isinstance(head.get(field, ""), str):
            raise bad(field, "a string")
    params = head.get("params", {})
    if not isinstance(params, dict) or any(isinstance(v, (dict, list)) for v in params.values()):
        raise bad("params", "a JSON object of numbers, strings and booleans")
    return head


def _slicing(doc: object, path: str) -> Slicing | None:
    """`otherData.slicing` back as the Slicing it was written from (None when the trace has none), checked:
    whole counts, one length per slice and per sequence, at most MAX_SIZE units."""
    if doc is None:
        return None
    counts = ("sequences", "slices", "seqlen")
    ok = isinstance(doc, dict) and all(type(doc.get(k)) is int and 1 <= doc[k] <= MAX_SIZE for k in counts)
    ok = ok and doc["sequences"] * doc["slices"] <= MAX_SIZE
    for k, n in (("tokens", "slices"), ("lengths", "sequences")):
        ok = ok and isinstance(doc.get(k), list) and len(doc[k]) == doc[n]
        ok = ok and all(type(t) is int and 1 <= t <= MAX_SIZE for t in doc[k])
    if not ok:
        raise error(
            "E802",
            "otherData.slicing must hold `sequences`, `slices` and `seqlen` (integers from 1 to "
            f"{MAX_SIZE:,}), `tokens` (one per slice) and `lengths` (one per sequence)",
            source=Source(brief_path(path), ""),
        )
    return Slicing(doc["sequences"], doc["slices"], doc["seqlen"], tuple(doc["tokens"]), tuple(doc["lengths"]))


def _rows(events: object, path: str, b: Bounds) -> dict[str, list[tuple]]:
    """The rows of each kind (compute, messages, collectives, waits, host, all-to-all, segments), every field
    of every event checked against `b` first: E802 naming the event, the field and what it may be."""
    if not isinstance(events, list):
        raise error("E802", "`traceEvents` must be a JSON array", source=Source(brief_path(path), ""))
    rows: dict[str, list[tuple]] = {k: [] for k in ("comp", "msgs", "colls", "waits", "hosts", "a2as", "segs")}
    rank_of = f"{b.of}'s ranks"
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise _Where(path, i, {}).fail("event", "a JSON object", ev)
        if ev.get("ph") != "X":
            continue  # metadata, counters: drawn from the rows, not read back
        w = _Where(path, i, ev)
        cat = ev.get("cat")
        if cat not in _CATS:
            raise w.fail("cat", f"one of {', '.join(_CATS)}", cat)
        a = ev.get("args")
        if not isinstance(a, dict):
            raise w.fail("args", "a JSON object", a)
        pid = _index(w, ev, "pid", b.ranks, rank_of, prefix="")
        if cat == "recv":
            continue  # the send's event holds the message
        if _CATS[cat] and a.get("op") not in _CATS[cat]:
            raise w.fail("args.op", f"one of {', '.join(_CATS[cat])}", a.get("op"))
        op = OPCODES.index(a["op"]) if _CATS[cat] else -1
        if cat == "collective wait":
            rows["waits"].append((pid, *_span(w, a, "start_s", "end_s")))
            continue
        stage = _index(w, a, "stage", b.stages, f"{b.of}'s stages")
        if cat == "collective":
            issue = _time(w, a, "issue_s")
            t0, t1 = _span(w, a, "start_s", "end_s")
            after = a.get("after", 0)
            if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after < MAX_SIZE:
                raise w.fail("args.after", f"an integer from 0 to {MAX_SIZE - 1:,}", after)
            rows["colls"].append((pid, op, stage, issue, t0, t1, _amount(w, a, "bytes"), after))
            continue
        key = "unit" if "unit" in a else "mb"  # token slices: the Timeline's index, beside the micro-batch
        mb = _index(w, a, key, b.microbatches, f"{b.of}'s micro-batches")
        if cat == "send":
            if a.get("kind") not in _KIND:
                raise w.fail("args.kind", " or ".join(_KIND), a.get("kind"))
            src, dst = (_index(w, a, k, b.ranks, rank_of) for k in ("src", "dst"))
            send, arrival = _span(w, a, "send_s", "arrival_s")
            post = _time(w, a, "post_s", none=True)
            rows["msgs"].append(
                (_KIND.index(a["kind"]), mb, stage, src, dst, send, arrival, _amount(w, a, "bytes"), post)
            )
        elif cat == "a2a":
            k = _index(w, a, "index", MAX_SIZE, "an all-to-all's number")
            rows["a2as"].append((pid, op, mb, stage, k, *_span(w, a, "start_s", "end_s")))
        else:
            which = {"host": "hosts", "segment": "segs"}.get(cat, "comp")
            rows[which].append((pid, op, mb, stage, *_span(w, a, "start_s", "end_s")))
    if not rows["comp"]:
        raise error(
            "E802",
            f"the trace has no compute events ({', '.join(_COMPUTE_OPS)}): nothing ran, there is nothing to draw",
            source=Source(brief_path(path), ""),
        )
    return rows


def read_trace(path: str | Path, bounds: Bounds | None = None) -> Timeline:
    """Read a trace written by `write_trace` back into the Timeline it came from. E802 when it is not one:
    not JSON, another format or version, or an event with a field out of its range (a NaN or infinite time,
    an end before its start, a rank, stage or micro-batch outside the trace's, or `bounds`' when given,
    negative bytes); every event is checked before any array is built."""
    from pipec.files import read_text

    if not isinstance(path, (str, os.PathLike)):
        raise error("E802", f"read_trace takes a path (str or os.PathLike), not {type(path).__name__}")
    if bounds is not None and not isinstance(bounds, Bounds):
        raise error("E802", f"read_trace's bounds must be a Bounds, not {type(bounds).__name__}")
    try:
        doc = json.loads(read_text(Path(path), "trace"))
    except OSError as e:
        raise error("E802", f"cannot read trace `{brief_path(path)}`: {e.strerror}") from None
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: JSONDecodeError, or an int of 5,000 digits
        raise error("E802", f"trace `{brief_path(path)}` is not JSON: {brief(e, 200)}") from None
    except RecursionError:
        raise error("E802", f"trace `{brief_path(path)}` nests its JSON too deeply") from None
    if not isinstance(doc, dict):
        raise error("E802", "not a pipec trace: expected a JSON object", source=Source(brief_path(path), ""))
    head = _header(doc.get("otherData"), str(path))
    own = Bounds(head["num_ranks"])
    if bounds is not None and bounds.ranks != own.ranks:
        raise error(
            "E802",
            f"the trace has {own.ranks} ranks, but {bounds.of} has {bounds.ranks}: it is a run of another schedule",
            source=Source(brief_path(path), ""),
        )
    slicing = _slicing(head.get("slicing"), str(path))
    if bounds is None:
        units = slicing.num_units if slicing is not None else MAX_SIZE
        bounds = Bounds(own.ranks, MAX_SIZE, units)
    r = _rows(doc.get("traceEvents"), str(path), bounds)
    return _timeline(head, r, slicing)


def _timeline(head: dict, r: dict[str, list[tuple]], slicing: Slicing | None) -> Timeline:
    """The Timeline of checked rows (`_rows`) and header (`_header`)."""
    c = list(zip(*r["comp"]))
    m = list(zip(*r["msgs"])) if r["msgs"] else [[]] * 9
    k = list(zip(*r["colls"])) if r["colls"] else [[]] * 8
    w = list(zip(*r["waits"])) if r["waits"] else [[]] * 3
    ints = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    floats = lambda xs: np.asarray(xs, dtype=float)  # noqa: E731
    host = {}
    if r["hosts"]:  # only then: a Timeline without host-link rows is built as before
        h = list(zip(*r["hosts"]))
        host = {f"host_{n}": ints(h[i]) for i, n in enumerate(("rank", "op", "mb", "stage"))}
        host.update(host_start=floats(h[4]), host_end=floats(h[5]))
    if r["a2as"]:  # expert parallelism's rows, likewise only when there are some
        x = list(zip(*r["a2as"]))
        host.update({f"a2a_{n}": ints(x[i]) for i, n in enumerate(("rank", "op", "mb", "stage", "index"))})
        host.update(a2a_start=floats(x[5]), a2a_end=floats(x[6]))
    if r["segs"]:
        x = list(zip(*r["segs"]))
        host.update({f"seg_{n}": ints(x[i]) for i, n in enumerate(("rank", "op", "mb", "stage"))})
        host.update(seg_start=floats(x[4]), seg_end=floats(x[5]))
    return Timeline(
        num_ranks=head["num_ranks"],
        rank=ints(c[0]),
        op=ints(c[1]),
        mb=ints(c[2]),
        stage=ints(c[3]),
        start=floats(c[4]),
        end=floats(c[5]),
        msg_kind=ints(m[0]),
        msg_mb=ints(m[1]),
        msg_stage=ints(m[2]),
        msg_src=ints(m[3]),
        msg_dst=ints(m[4]),
        msg_send=floats(m[5]),
        msg_arrival=floats(m[6]),
        msg_bytes=floats(m[7]),
        msg_post=floats(m[8]),
        coll_rank=ints(k[0]),
        coll_op=ints(k[1]),
        coll_stage=ints(k[2]),
        coll_issue=floats(k[3]),
        coll_start=floats(k[4]),
        coll_end=floats(k[5]),
        coll_bytes=floats(k[6]),
        coll_after=ints(k[7]),
        wait_rank=ints(w[0]),
        wait_start=floats(w[1]),
        wait_end=floats(w[2]),
        dp=head.get("dp", 1),
        dp_kind=head.get("dp_kind", "ddp"),
        origin=head.get("origin", "simulated"),
        schedule=head.get("schedule", ""),
        params=tuple(head.get("params", {}).items()),
        slicing=slicing,
        **host,
    )
