"""Emulated links between datacenters: `pipec run --emulate-links [--link-scale X]`.

A message between ranks of two different datacenters of the schedule's topology (its own, or
`--topology`) is handed to compute no earlier than it would arrive over the declared link:

    wire start = max(send time, when the previous message from this rank to that peer left the wire)
    arrival    = wire start + bytes / bandwidth + latency

which is the simulator's model for one pair of ranks in one direction (pipec/sim/costs.py). The sender
computes the arrival time (it knows its own sends, so messages to one peer queue on the wire in issue
order) and sends it along as one extra float64 tensor; the receiver, when the compute that needs the
message waits on it, also waits until that time. Sends stay non-blocking, and the real transfer runs
underneath (a message is late if the real transfer is slower than the emulated one).

`--link-scale X` multiplies every emulated latency by X and divides every bandwidth by X (so the time on
the wire is X times longer too): 40 ms at 10 Gbps with X = 0.5 is 20 ms at 20 Gbps. Use it to put a
datacenter link in proportion to a small CPU model's compute.

Clocks: the arrival time is read on `time.monotonic()`, one clock for every process of one machine. Over
several machines the clocks are not synchronised, so emulation is for single-machine runs. Links inside a
datacenter are not emulated, nor is bandwidth shared between several pairs of ranks crossing one link.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipec.runtime.comm import Key, Recv
from pipec.runtime.shapes import Specs, TensorSpec

STAMP = TensorSpec((1,), torch.float64)


@dataclass(frozen=True)
class Links:
    """Per ordered rank pair (a, b): the emulated one-way latency (s) and bandwidth (bytes/s), or None
    where a and b are in one datacenter (not emulated)."""

    latency: tuple[tuple[float | None, ...], ...]
    bandwidth: tuple[tuple[float | None, ...], ...]

    def emulated(self, a: int, b: int) -> bool:
        return self.latency[a][b] is not None

    def to_json(self) -> str:
        return json.dumps({"latency": self.latency, "bandwidth": [[_enc(x) for x in row] for row in self.bandwidth]})

    @staticmethod
    def from_json(text: str) -> Links:
        d = json.loads(text)
        return Links(
            tuple(tuple(row) for row in d["latency"]),
            tuple(tuple(_dec(x) for x in row) for row in d["bandwidth"]),
        )

    def describe(self) -> str:
        seen = []
        for a, row in enumerate(self.latency):
            for b, lat in enumerate(row):
                if lat is not None:
                    bw = self.bandwidth[a][b]
                    text = f"{lat * 1e3:g} ms, " + ("no bandwidth cap" if math.isinf(bw) else f"{bw * 8 / 1e9:g} Gbps")
                    seen.append(f"{a}->{b} {text}")
        return "emulated links: " + ("; ".join(seen) if seen else "none (every rank in one datacenter)")


def _enc(x: float | None):
    return "inf" if x is not None and math.isinf(x) else x


def _dec(x):
    return math.inf if x == "inf" else x


def links_of(sched: Any, scale: float = 1.0) -> Links:
    """The links between the datacenters of a schedule's topology (pipec.schedule.Schedule), scaled."""
    from pipec.sim.costs import cost_model

    if scale <= 0 or not math.isfinite(scale):
        raise ValueError(f"--link-scale must be a positive number, got {scale}")
    if sched.topology is None or not sched.topology.datacenters:
        raise ValueError(
            "--emulate-links needs datacenters: declare a `topology { dc ... }` in the schedule or give --topology"
        )
    cm = cost_model(sched)
    dc = [-1] * sched.num_ranks
    for i, d in enumerate(sched.topology.datacenters):
        for r in range(d.lo, d.hi):
            dc[r] = i
    R = sched.num_ranks
    lat = [[None] * R for _ in range(R)]
    bw = [[None] * R for _ in range(R)]
    for a in range(R):
        for b in range(R):
            if dc[a] != dc[b]:
                lat[a][b] = float(cm.latency[a, b]) * scale
                bw[a][b] = float(cm.bandwidth[a, b]) / scale  # bytes/s
    return Links(tuple(map(tuple, lat)), tuple(map(tuple, bw)))


class EmulatedComm:
    """Wraps a transport (DistComm, or LocalComm of --local) so that messages crossing an emulated link
    carry their arrival time and are held back until then. `blocking`: sleep in `wait` (DistComm), or
    yield until the time has come (--local, where one thread runs every rank)."""

    def __init__(self, inner: Any, rank: int, links: Links, *, blocking: bool = True) -> None:
        self.inner, self.rank, self.links, self.blocking = inner, rank, links, blocking
        self.device = getattr(inner, "device", torch.device("cpu"))
        self.free: dict[int, float] = {}  # per peer: when the wire to it is free again

    def __getattr__(self, name: str) -> Any:  # ready(), sends, ... of the transport
        return getattr(self.inner, name)

    def _stamp(self, peer: int, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if not self.links.emulated(self.rank, peer):
            return tuple(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        now = time.monotonic()
        start = max(now, self.free.get(peer, 0.0))
        end = start + nbytes / self.links.bandwidth[self.rank][peer]
        self.free[peer] = end
        arrival = end + self.links.latency[self.rank][peer]
        return (*tensors, torch.tensor([arrival], dtype=torch.float64, device=self.device))

    def _specs(self, peer: int, specs: Specs) -> Specs:
        return (*specs, STAMP) if self.links.emulated(peer, self.rank) else specs

    def post(self, key: Key, peer: int, specs: Specs) -> Recv:
        return self.inner.post(key, peer, self._specs(peer, specs))

    def send(self, key: Key, peer: int, tensors: tuple[torch.Tensor, ...]) -> None:
        return self.inner.send(key, peer, self._stamp(peer, tensors))

    def exchange(self, items: list[tuple[str, Key, int, object]]) -> list[Recv | None]:
        out = []
        for what, key, peer, x in items:
            x = self._stamp(peer, x) if what == "send" else self._specs(peer, x)
            out.append((what, key, peer, x))
        return self.inner.exchange(out)

    def wait(self, recv: Recv) -> Generator[object, None, tuple[torch.Tensor, ...]]:
        tensors = yield from self.inner.wait(recv)
        if not self.links.emulated(recv.peer, self.rank):
            return tensors
        arrival = float(tensors[-1].item())
        if self.blocking:
            delay = arrival - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        else:
            while time.monotonic() < arrival:
                yield arrival
        return tuple(tensors[:-1])

    def finish_sends(self) -> None:
        self.inner.finish_sends()
