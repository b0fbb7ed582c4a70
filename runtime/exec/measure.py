"""Measured events of one step, from every rank, as a `pipec.sim.timeline.Timeline` (origin "measured").

Each rank records ("compute", op, mb, stage, start, end, cpu: the main thread's CPU seconds in the op, which
`pipec.runtime.profile.insitu` reads and the Timeline does not), ("send", kind, mb, stage, dst, time, bytes),
("post", kind, mb, stage, src, time) and ("recv", kind, mb, stage, src, time: when the wait returned, an
upper bound of the arrival); also ("step", stage, start, end) for each STEP, ("collective", op, stage,
start, end) for each REDUCE_GRAD and UNSHARD, ("alltoall", opcode, mb, stage, number, issued, done, bytes,
cpu: the transfer thread's) for each expert all-to-all (pipec.runtime.exec.alltoall; not in the Timeline
yet), ("handoff", seconds) for each turn an overlapped pair's op took from the other after sleeping
(pipec.runtime.exec.pairs), ("run", start, end)
around the instructions and ("bounds", start, end) around the whole step (`pipec.runtime.profile.insitu`
reads those; the Timeline does not). Clocks are `time.perf_counter()`, one clock for all processes of a machine
(CLOCK_MONOTONIC); across machines they are not aligned. Times become seconds from the step's first event.
On a stage graph a message's stage field is its edge (u, v) (pipec.runtime.exec.comm.edge_key); the Timeline
gets its sending stage (u for an activation, v for its gradient).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pipec.ir.opcodes import ACT_MSG
from pipec.ir.program import Program
from pipec.sim.timeline import Timeline


def timeline(program: Program, events: list[list[tuple]]) -> Timeline:
    """Merge the ranks' event lists (index = rank) into one Timeline; messages are joined by key."""
    comp = [(r, *e[1:]) for r, evs in enumerate(events) for e in evs if e[0] == "compute"]
    sends = {_key(e): (r, e[4], e[5], e[6]) for r, evs in enumerate(events) for e in evs if e[0] == "send"}
    posts = {_key(e): e[5] for evs in events for e in evs if e[0] == "post"}
    recvs = {_key(e): (r, e[5]) for r, evs in enumerate(events) for e in evs if e[0] == "recv"}
    keys = sorted(k for k in sends if k in recvs)
    times = [e[4] for e in comp] + [sends[k][2] for k in keys] + [posts[k] for k in keys if k in posts]
    t0 = min(times) if times else 0.0
    col = lambda rows, i, dt=np.int64: np.array([row[i] for row in rows], dtype=dt)  # noqa: E731
    kw = dict(
        num_ranks=program.num_ranks,
        rank=col(comp, 0),
        op=col(comp, 1),
        mb=col(comp, 2),
        stage=col(comp, 3),
        start=col(comp, 4, float) - t0,
        end=col(comp, 5, float) - t0,
        msg_kind=np.array([k[0] for k in keys], dtype=np.int64),
        msg_mb=np.array([k[1] for k in keys], dtype=np.int64),
        msg_stage=np.array([_sender(k) for k in keys], dtype=np.int64),
        msg_src=np.array([sends[k][0] for k in keys], dtype=np.int64),
        msg_dst=np.array([recvs[k][0] for k in keys], dtype=np.int64),
        msg_send=np.array([sends[k][2] for k in keys], dtype=float) - t0,
        msg_arrival=np.array([max(recvs[k][1], sends[k][2]) for k in keys], dtype=float) - t0,
        msg_bytes=np.array([sends[k][3] for k in keys], dtype=float),
        origin="measured",
        slicing=program.slicing,
        schedule=program.name,
        params=program.params,
    )
    if "msg_post" in {f.name for f in dataclasses.fields(Timeline)} and all(k in posts for k in keys):
        kw["msg_post"] = np.array([posts[k] for k in keys], dtype=float) - t0
    return Timeline(**kw)


def _key(event: tuple) -> tuple:
    """A message event's key (kind, mb, where), hashable: a graph's edge comes back from another process as a
    list (the events travel as objects), and is made the tuple it was."""
    where = event[3]
    return (event[1], event[2], tuple(where) if isinstance(where, list) else where)


def _sender(key: tuple) -> int:
    """A message key's sending stage: the key's own on the chain, its edge's sending end on a graph."""
    kind, _, where = key
    if where.__class__ is tuple:
        return where[0] if kind == ACT_MSG else where[1]
    return where
