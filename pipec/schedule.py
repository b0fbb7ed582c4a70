"""The evaluated Schedule: stages, placement, per-rank ordered ops, declarations, spans.

Per-rank ops are numpy arrays (kind, micro-batch, stage, source id), because
schedules reach a million ops; `Schedule.ops(r)` gives readable `Op`s for
small work and tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipec.errors import Source, Span

# The per-stage cost keys: what a schedule's `cost` declarations, cost files and `--cost` may set per stage
# (pipec.sim.costs says what each means).
# Bytes (measured by `pipec profile`; docs/memory.md): saved_bytes, what a stage's F keeps for its B (the
# `act` pool); wsaved_bytes, what its B keeps for its W (`wact`); input_bytes, what a recomputed F keeps
# (`ckpt`: its input); state_bytes, its parameters, gradients and optimizer state (`params`). `offload` is
# the seconds one OFFLOAD or RELOAD of the stage takes (else saved bytes over the host link's bandwidth).
STAGE_COST_KEYS = (
    "F",
    "B",
    "W",
    "comm",
    "act_bytes",
    "grad_bytes",
    "param_bytes",
    "reduce_grad",
    "unshard",
    "step",
    "saved_bytes",
    "wsaved_bytes",
    "input_bytes",
    "state_bytes",
    "offload",
)

# The memory keys a schedule's `memory` declarations, `--mem` and the API may set (pipec.passes.memory says
# what each means): per stage, and per rank.
MEMORY_STAGE_KEYS = ("act", "wact", "ckpt", "params")
MEMORY_RANK_KEYS = ("limit", "host_limit")


@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B" or "W"
    mb: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}({self.mb}, stage {self.stage})"


@dataclass(frozen=True, eq=False)
class RankOps:
    """One rank's ordered ops. `paired[j]` marks op j as overlapped with op j + 1."""

    kind: np.ndarray
    mb: np.ndarray
    stage: np.ndarray
    sid: np.ndarray
    paired: np.ndarray

    def __len__(self) -> int:
        return len(self.kind)


@dataclass(frozen=True)
class Collective:
    """A data-parallel collective the schedule places itself: `op` ("UNSHARD", "RESHARD" or "REDUCE_GRAD",
    rows of pipec.opcodes) on `stage`, issued just before the rank's op at index `before` of its order
    (`before == len(rank's ops)`: after its last op). Ranks without any use the lowering's default placement."""

    op: str
    stage: int
    before: int
    span: Span | None = None


@dataclass(frozen=True)
class MemOp:
    """A memory op the schedule places (`op` in pipec.opcodes.MEMOPS: "RECOMPUTE", "OFFLOAD" or "RELOAD")
    for micro-batch `mb` on `stage`, issued just before the rank's op at index `before` of its order
    (`before == len(rank's ops)`: after its last op). A RECOMPUTE makes F(mb, stage) keep only its input;
    the forward runs again at the RECOMPUTE, which must come after that F and before its B. An OFFLOAD moves
    what F(mb, stage) keeps to the host after the F; its RELOAD brings it back before the B."""

    op: str
    mb: int
    stage: int
    before: int
    span: Span | None = None


@dataclass(frozen=True)
class Datacenter:
    name: str
    lo: int  # first rank
    hi: int  # one past the last rank


@dataclass(frozen=True)
class Link:
    """A link class between two datacenters (`None, None` for the default link)."""

    a: str | None
    b: str | None
    latency_s: float | None
    bandwidth_bps: float | None


@dataclass(frozen=True)
class Topology:
    datacenters: tuple[Datacenter, ...]
    links: tuple[Link, ...]
    # Where the data-parallel replicas sit (PP x DP): datacenters over replica indices 0 .. dp-1, named like
    # the rank datacenters so `links` between them apply; a DP group whose replicas span two of them
    # reduces over that link. Empty: all replicas share one datacenter.
    replica_dcs: tuple[Datacenter, ...] = ()


@dataclass(frozen=True, eq=False)
class Expectation:
    """An `expect` statement as evaluated for these parameters (one per rank when written in the rank block).

    `test(metrics)` returns (holds, left, right): the two sides of a comparison, or None, None; it raises
    PipecError when the condition itself fails to evaluate. `pipec.passes.expect` supplies the metrics.
    """

    span: Span
    cond_span: Span
    message: str | None
    rank: int | None
    test: Callable[[object], tuple[bool, object, object]]


@dataclass(frozen=True, eq=False)
class Schedule:
    name: str
    params: tuple[tuple[str, int | float | bool | str], ...]
    num_stages: int
    num_ranks: int
    num_microbatches: int
    kinds: tuple[str, ...]
    placement: tuple[int, ...]
    ranks: tuple[RankOps, ...]
    costs: dict[str, tuple[float, ...]] = field(default_factory=dict)  # per stage
    memory: dict[str, tuple[float, ...]] = field(default_factory=dict)  # act/wact/params per stage, limit per rank
    topology: Topology | None = None
    spans: tuple[Span, ...] = ()
    source: Source | None = None
    decl_spans: dict[str, Span] = field(default_factory=dict)
    expects: tuple[Expectation, ...] = ()
    collectives: tuple[tuple[Collective, ...], ...] = ()  # per rank, in order; () when the schedule places none
    memops: tuple[tuple[MemOp, ...], ...] = ()  # per rank, in order; () when the schedule places none

    @property
    def split_backward(self) -> bool:
        return "W" in self.kinds

    @property
    def num_ops(self) -> int:
        return sum(len(r) for r in self.ranks)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, owner in enumerate(self.placement) if owner == rank)

    def head(self) -> dict:
        """What names this schedule in every JSON document (`check`, `simulate`, ... `--json`)."""
        return {
            "schedule": self.name,
            "source": self.source.path if self.source else None,
            "params": dict(self.params),
            "stages": self.num_stages,
            "ranks": self.num_ranks,
            "microbatches": self.num_microbatches,
        }

    def ops(self, rank: int) -> list[Op]:
        r = self.ranks[rank]
        kinds = self.kinds
        return [Op(kinds[k], int(i), int(s)) for k, i, s in zip(r.kind.tolist(), r.mb.tolist(), r.stage.tolist())]

    def span_of(self, rank: int, index: int) -> Span:
        return self.spans[int(self.ranks[rank].sid[index])]

    def param(self, name: str):
        return dict(self.params)[name]
