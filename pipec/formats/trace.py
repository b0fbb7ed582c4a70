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
from pathlib import Path

import numpy as np

from pipec.errors import brief, error
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

    with atomic_write(path) as f:
        json.dump(trace_events(tl, memory), f, separators=(",", ":"))
        f.write("\n")


def _slicing(doc: dict | None) -> Slicing | None:
    """`otherData.slicing` back as the Slicing it was written from (None when the trace has none)."""
    if doc is None:
        return None
    return Slicing(
        int(doc["sequences"]),
        int(doc["slices"]),
        int(doc["seqlen"]),
        tuple(int(t) for t in doc["tokens"]),
        tuple(int(t) for t in doc["lengths"]),
    )


def read_trace(path: str | Path) -> Timeline:
    """Read a trace written by `write_trace` back into the Timeline it came from (E802 when it is not one)."""
    from pipec.files import read_text

    try:
        doc = json.loads(read_text(Path(path), "trace"))
    except OSError as e:
        raise error("E802", f"cannot read trace `{path}`: {e.strerror}") from None
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: JSONDecodeError, or an int of 5,000 digits
        raise error("E802", f"trace `{path}` is not JSON: {brief(e, 200)}") from None
    except RecursionError:
        raise error("E802", f"trace `{path}` nests its JSON too deeply") from None
    try:
        head = doc["otherData"]
        if head.get("format") != FORMAT:
            raise error("E802", f"`{path}` is not a pipec trace (otherData.format is {head.get('format')!r})")
        if head.get("version") != VERSION:
            raise error("E802", f"pipec trace version {head.get('version')} is not supported (this reads {VERSION})")
        comp: list[tuple] = []
        msgs: list[tuple] = []
        colls: list[tuple] = []
        waits: list[tuple] = []
        hosts: list[tuple] = []
        a2as: list[tuple] = []
        segs: list[tuple] = []
        for ev in doc["traceEvents"]:
            if ev.get("ph") != "X":
                continue
            a = ev["args"]
            if "unit" in a:  # token slices: the Timeline's index, beside the micro-batch and slice people read
                a = {**a, "mb": a["unit"]}
            if ev["cat"] in ("FWD", "BWD", "WGRAD", "RECOMPUTE"):
                comp.append((int(ev["pid"]), OPCODES.index(a["op"]), a["mb"], a["stage"], a["start_s"], a["end_s"]))
            elif ev["cat"] == "host":
                hosts.append((int(ev["pid"]), OPCODES.index(a["op"]), a["mb"], a["stage"], a["start_s"], a["end_s"]))
            elif ev["cat"] == "a2a":
                a2as.append(
                    (int(ev["pid"]), OPCODES.index(a["op"]), a["mb"], a["stage"], a["index"], a["start_s"], a["end_s"])
                )
            elif ev["cat"] == "segment":
                segs.append((int(ev["pid"]), OPCODES.index(a["op"]), a["mb"], a["stage"], a["start_s"], a["end_s"]))
            elif ev["cat"] == "collective":
                colls.append(
                    (
                        int(ev["pid"]),
                        OPCODES.index(a["op"]),
                        a["stage"],
                        a["issue_s"],
                        a["start_s"],
                        a["end_s"],
                        a["bytes"],
                        a.get("after", 0),
                    )
                )
            elif ev["cat"] == "collective wait":
                waits.append((int(ev["pid"]), a["start_s"], a["end_s"]))
            elif ev["cat"] == "send":
                post = math.nan if a["post_s"] is None else a["post_s"]
                msgs.append(
                    (
                        _KIND.index(a["kind"]),
                        a["mb"],
                        a["stage"],
                        a["src"],
                        a["dst"],
                        a["send_s"],
                        a["arrival_s"],
                        a["bytes"],
                        post,
                    )
                )
        c = list(zip(*comp)) if comp else [[]] * 6
        m = list(zip(*msgs)) if msgs else [[]] * 9
        k = list(zip(*colls)) if colls else [[]] * 8
        w = list(zip(*waits)) if waits else [[]] * 3
        ints = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
        floats = lambda xs: np.asarray(xs, dtype=float)  # noqa: E731
        host = {}
        if hosts:  # only then: a Timeline without host-link rows is built as before
            h = list(zip(*hosts))
            host = {f"host_{n}": ints(h[i]) for i, n in enumerate(("rank", "op", "mb", "stage"))}
            host.update(host_start=floats(h[4]), host_end=floats(h[5]))
        if a2as:  # expert parallelism's rows, likewise only when there are some
            x = list(zip(*a2as))
            host.update({f"a2a_{n}": ints(x[i]) for i, n in enumerate(("rank", "op", "mb", "stage", "index"))})
            host.update(a2a_start=floats(x[5]), a2a_end=floats(x[6]))
        if segs:
            x = list(zip(*segs))
            host.update({f"seg_{n}": ints(x[i]) for i, n in enumerate(("rank", "op", "mb", "stage"))})
            host.update(seg_start=floats(x[4]), seg_end=floats(x[5]))
        return Timeline(
            num_ranks=int(head["num_ranks"]),
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
            dp=int(head.get("dp", 1)),
            dp_kind=str(head.get("dp_kind", "ddp")),
            origin=str(head.get("origin", "simulated")),
            schedule=str(head.get("schedule", "")),
            params=tuple(head.get("params", {}).items()),
            slicing=_slicing(head.get("slicing")),
            **host,
        )
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
        raise error("E802", f"malformed pipec trace `{path}`: {brief(repr(e), 200)}") from None
