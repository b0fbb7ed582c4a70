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

Data parallelism (`--dp N`): when the topology puts the replicas in datacenters (`dc "east" replicas 0 .. 1`,
`Topology.replica_dcs`; a topology with only those is accepted), a pipeline rank's collectives over its
"dp" group cross the link between them. Each one ends no earlier than

    emulated end = when the last replica issued it + ring_time(collective, N, bytes, hops)

with `ring_time` and the hops the simulator's (pipec.sim.costs: `CostModel.ring_hops`, the slowest hop a
ring step), hops inside one replica datacenter free (not emulated), and the bytes the stage's whole
parameters (measured once per stage from its modules; a DTensor's numel is the whole tensor's).
REDUCE_GRAD is an all-reduce (ddp) or reduce-scatter (fsdp), held at STEP once the real reduction is
done; UNSHARD an all-gather, held at the stage's next compute (or RESHARD). The last replica's issue
time comes from an all-reduce (MAX) of one float64 of `time.monotonic()` over the dp group just before
the real collective: one extra small blocking collective each (a fraction of a millisecond on gloo on
one machine). A hold longer than the run's --timeout fails at once, naming the rank and instruction.
Not emulated: FSDP2's own gathers where a Program has no UNSHARD, and --check's gathers after the step.

Expert parallelism (`--ep N`): the members of an expert group are replicas too, so an all-to-all between
two of them in different replica datacenters crosses the link between those (`Links.replica`, per pair of
replicas, scaled like the rest). pipec.runtime.exec.alltoall holds each all-to-all's result until its
slowest source's emulated arrival (issue, or when the wire to that member is free again, + bytes /
bandwidth + latency); the arrival travels in the all-to-all's own header rows, so no extra collective.

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

from pipec.runtime.exec.comm import Key, Recv
from pipec.runtime.exec.shapes import Specs, TensorSpec

STAMP = TensorSpec((1,), torch.float64)


@dataclass(frozen=True)
class Links:
    """Per ordered rank pair (a, b): the emulated one-way latency (s) and bandwidth (bytes/s), or None
    where a and b are in one datacenter (not emulated). `dp_ring`: the (latency, bandwidth) of each hop of
    the ring over the data-parallel replicas, replica i to i + 1, scaled; (0, inf) for a hop inside one
    replica datacenter; empty when no hop crosses two (nothing emulated)."""

    latency: tuple[tuple[float | None, ...], ...]
    bandwidth: tuple[tuple[float | None, ...], ...]
    dp_ring: tuple[tuple[float, float], ...] = ()
    # per ordered pair of replicas (a, b): the emulated (latency s, bandwidth bytes/s) between their
    # datacenters, scaled; None inside one datacenter; empty when the replicas are in none
    replica: tuple[tuple[tuple[float, float] | None, ...], ...] = ()

    def replica_link(self, dp_rank: int, size: int) -> tuple[tuple[tuple[float, float] | None, ...], ...] | None:
        """The links between the members of dp_rank's expert group of `size` consecutive replicas (member i
        to member j), or None when none of them is emulated."""
        if not self.replica:
            return None
        lo = dp_rank - dp_rank % size
        rows = tuple(tuple(self.replica[lo + i][lo + j] for j in range(size)) for i in range(size))
        return rows if any(x is not None for row in rows for x in row) else None

    def emulated(self, a: int, b: int) -> bool:
        return self.latency[a][b] is not None

    def to_json(self) -> str:
        return json.dumps(
            {
                "latency": self.latency,
                "bandwidth": [[_enc(x) for x in row] for row in self.bandwidth],
                "dp_ring": [[lat, _enc(bw)] for lat, bw in self.dp_ring],
                "replica": [[None if x is None else [x[0], _enc(x[1])] for x in row] for row in self.replica],
            }
        )

    @staticmethod
    def from_json(text: str) -> Links:
        d = json.loads(text)
        return Links(
            tuple(tuple(row) for row in d["latency"]),
            tuple(tuple(_dec(x) for x in row) for row in d["bandwidth"]),
            tuple((float(lat), float(_dec(bw))) for lat, bw in d.get("dp_ring", ())),
            tuple(
                tuple(None if x is None else (float(x[0]), float(_dec(x[1]))) for x in row)
                for row in d.get("replica", ())
            ),
        )

    def describe(self) -> str:
        seen = []
        for a, row in enumerate(self.latency):
            for b, lat in enumerate(row):
                if lat is not None:
                    seen.append(f"{a}->{b} {_fmt(lat, self.bandwidth[a][b])}")
        if self.dp_ring:
            hops = [
                f"{i}->{(i + 1) % len(self.dp_ring)} {_fmt(lat, bw)}"
                for i, (lat, bw) in enumerate(self.dp_ring)
                if lat or math.isfinite(bw)
            ]
            seen.append("data-parallel ring " + ", ".join(hops))
        pairs = [
            f"{a}->{b} {_fmt(*hop)}"
            for a, row in enumerate(self.replica)
            for b, hop in enumerate(row)
            if hop is not None
        ]
        if pairs:
            seen.append("between replicas (expert all-to-alls) " + ", ".join(pairs))
        return "emulated links: " + ("; ".join(seen) if seen else "none (nothing crosses two datacenters)")


def _fmt(lat: float, bw: float) -> str:
    return f"{lat * 1e3:g} ms, " + ("no bandwidth cap" if math.isinf(bw) else f"{bw * 8 / 1e9:g} Gbps")


def _enc(x: float | None):
    return "inf" if x is not None and math.isinf(x) else x


def _dec(x):
    return math.inf if x == "inf" else x


def links_of(sched: Any, scale: float = 1.0, dp: int = 1) -> Links:
    """The links between the datacenters of a schedule's topology (pipec.ir.schedule.Schedule), scaled: between
    its rank datacenters, and with `dp` replicas, the ring over them across its replica datacenters."""
    from pipec.sim.costs import cost_model
    from pipec.sim.topology_links import FREE

    if scale <= 0 or not math.isfinite(scale):
        raise ValueError(f"--link-scale must be a positive number, got {scale}")
    topo = sched.topology
    if topo is None or not (topo.datacenters or topo.replica_dcs):
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
    ring: tuple[tuple[float, float], ...] = ()
    names = cm.replica_names[:dp]
    if dp > 1 and len({x for x in names if x is not None}) > 1:
        # the simulator's hops (CostModel.ring_hops, which refuses replicas left out of every replica
        # datacenter), those between two replica datacenters only, scaled
        hops = cm.ring_hops(0, dp)
        ring = tuple(
            (lt * scale, b / scale) if names[i] != names[(i + 1) % dp] else FREE for i, (lt, b) in enumerate(hops)
        )
    replica: tuple[tuple[tuple[float, float] | None, ...], ...] = ()
    if dp > 1 and len({x for x in names if x is not None}) > 1:
        rows = []
        for a in range(dp):
            row: list[tuple[float, float] | None] = []
            for b in range(dp):
                hop = cm.replica_links.get((names[a], names[b])) if names[a] != names[b] else None
                row.append(None if hop is None else (hop[0] * scale, hop[1] / scale))
            rows.append(tuple(row))
        replica = tuple(rows)
    return Links(tuple(map(tuple, lat)), tuple(map(tuple, bw)), ring, replica)


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


class DPLink:
    """The emulated link under one pipeline rank's data-parallel collectives (its "dp" group), for
    `pipec.runtime.exec.replicas.StageDP`: `issued` before the real collective, `hold` once it is done.

    A collective's emulated end is the time its last member issued it plus `ring_time` of the collective
    over `Links.dp_ring` (pipec.sim.costs, the simulator's formula) with the bytes it moves (the stage's
    whole parameters, measured here). `issued` learns the last member's time by an all-reduce (MAX) of one
    float64 over the dp group: one extra small blocking collective per REDUCE_GRAD and UNSHARD, a few
    hundred microseconds on gloo on one machine, which also lines the replicas up as the real collective
    would."""

    def __init__(
        self, links: Links, group: Any, n: int, timeout: float, rank: int, dp_rank: int, device: Any = "cpu"
    ) -> None:
        self.ring, self.group, self.n, self.timeout, self.device = links.dp_ring, group, n, timeout, device
        self.rank, self.dp_rank = rank, dp_rank
        self.sizes: dict[int, int] = {}

    def issued(self) -> float:
        """When the last member of the group issues the collective (every member calls it, in order)."""
        import torch.distributed as dist

        t = torch.tensor([time.monotonic()], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def end(self, algo: str, issued: float, module: torch.nn.Module) -> float:
        """The emulated end of collective `algo` ("all_reduce", ...) of module's parameters issued then."""
        from pipec.sim.costs import ring_time

        key = id(module)
        if key not in self.sizes:  # a DTensor's numel is the whole tensor's, shard or not
            self.sizes[key] = sum(p.numel() * p.element_size() for p in module.parameters())
        return issued + float(ring_time(algo, self.n, float(self.sizes[key]), self.ring))

    def hold(self, end: float | None, what: str, where: str) -> None:
        """Wait, after the real collective, until its emulated end (no longer than the run's timeout)."""
        if end is None:
            return
        delay = end - time.monotonic()
        if delay > self.timeout:
            from pipec.runtime.errors import PipelineError

            raise PipelineError(
                f"rank {self.rank} (replica {self.dp_rank}): {what} at {where} would end {delay:.1f} s from now "
                f"over the emulated link, past the run's timeout of {self.timeout:g} s (raise --timeout or "
                "lower --link-scale)"
            )
        if delay > 0:
            time.sleep(delay)
