"""The search's input: `Spec` (sizes, placement, costs, memory model and limit, topology) and the
Schedule and machine it stands for. Every other module of pipec.synth starts from these, so they sit
at the bottom, with the names the search's modules share (`Progress`, `MemOps`, `MEMOP_KINDS`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipec.ir.schedule import Datacenter, MemOp, RankOps, Schedule, Topology
from pipec.passes.policy import Machine, machine
from pipec.sim.costs import cost_model
from pipec.sim.memory import memory_model

Progress = Callable[[str], None]


MEMOP_KINDS = ("recompute", "offload")


MemOps = tuple[tuple[MemOp, ...], ...]  # per rank, as `Schedule.memops`


@dataclass(frozen=True)
class Spec:
    """What to search for: sizes, placement, cost documents, memory model and limit, topology."""

    p: int
    m: int
    v: int = 1
    placement: str = "loop"  # "loop": stage s on rank s % p; "v": chunks in a V (v = 2)
    split: bool = True  # ops F, B, W
    cost_docs: tuple[Mapping, ...] = ()
    memory: Mapping[str, float] = field(default_factory=dict)  # act, wact, params for a rank's share
    limit: tuple[float, ...] | None = None  # per rank
    topology: Topology | None = None
    host_limit: tuple[float, ...] | None = None  # per rank: the host pool that OFFLOAD fills (None: no limit)
    memops: tuple[str, ...] = MEMOP_KINDS  # the memory ops the search may place under a limit ("recompute", "offload")

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def place(self) -> tuple[int, ...]:
        p, S = self.p, self.num_stages
        if self.placement == "v":
            return tuple((s % p) if (s // p) % 2 == 0 else p - 1 - s % p for s in range(S))
        return tuple(s % p for s in range(S))


def shape(spec: Spec, ranks: Sequence[RankOps] | None = None, name: str = "synth", memops: MemOps = ()) -> Schedule:
    """A Schedule with the spec's sizes, placement and declarations (and these per-rank ops and memory ops,
    or none)."""
    S, R = spec.num_stages, spec.p
    z = np.zeros(0, dtype=np.int64)
    empty = RankOps(z, z, z, z, np.zeros(0, dtype=bool))
    # act, wact and params are given for a rank's share of the model, as pipec.sim.memory's defaults are
    mem = {k: (float(v) * R / S,) * S for k, v in spec.memory.items() if k != "limit"}
    if spec.limit is not None:
        mem["limit"] = tuple(float(x) for x in spec.limit)
    if spec.host_limit is not None:
        mem["host_limit"] = tuple(float(x) for x in spec.host_limit)
    return Schedule(
        name=name,
        params=(("p", spec.p), ("m", spec.m)) + ((("v", spec.v),) if spec.v > 1 else ()),
        num_stages=S,
        num_ranks=R,
        num_microbatches=spec.m,
        kinds=("F", "B", "W") if spec.split else ("F", "B"),
        placement=spec.place(),
        ranks=tuple(ranks) if ranks is not None else tuple(empty for _ in range(R)),
        memory=mem,
        topology=spec.topology,
        memops=tuple(tuple(x) for x in memops) if any(memops) else (),
    )


def spec_machine(spec: Spec) -> Machine:
    sched = shape(spec)
    return machine(sched, cost_model(sched, spec.cost_docs), memory_model(sched))


def to_schedule(
    spec: Spec, orders: Sequence[Sequence[tuple[int, int, int]]], name: str = "synth", memops: MemOps = ()
) -> Schedule:
    """The spec's Schedule with these per-rank orders (kind index, micro-batch, stage) and memory ops."""
    ranks = []
    for ops in orders:
        a = np.asarray(ops, dtype=np.int64).reshape(-1, 3)
        ranks.append(
            RankOps(
                a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), np.zeros(len(a), np.int64), np.zeros(len(a), dtype=bool)
            )
        )
    return shape(spec, ranks, name, memops)


def topology_of(items: Sequence[tuple[str, int, int]]) -> Topology | None:
    """A topology of datacenters (name, first rank, one past the last) for the cost model."""
    if not items:
        return None
    return Topology(tuple(Datacenter(n, lo, hi) for n, lo, hi in items), ())


def _g(x: float) -> str:
    return f"{x:.6g}"
