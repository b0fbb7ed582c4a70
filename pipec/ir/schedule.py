"""The evaluated Schedule: stages, placement, per-rank ordered ops, declarations, spans.

Per-rank ops are numpy arrays (kind, micro-batch, stage, source id), because
schedules reach a million ops; `Schedule.ops(r)` gives readable `Op`s for
small work and tests.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipec.errors import Source, Span
from pipec.ir.family import OrderFamily
from pipec.ir.graph import StageGraph

# The per-stage cost keys: what a schedule's `cost` declarations, cost files and `--cost` may set per stage
# (pipec.sim.costs says what each means).
# Bytes (measured by `pipec profile`; docs/memory.md): saved_bytes, what a stage's F keeps for its B (the
# `act` pool); wsaved_bytes, what its B keeps for its W (`wact`); input_bytes, what a recomputed F keeps
# (`ckpt`: its input); state_bytes, its parameters, gradients and optimizer state (`params`). `offload` is
# the seconds one OFFLOAD or RELOAD of the stage takes (else saved bytes over the host link's bandwidth).
# Token slices and sequence lengths (Slicing.weight, docs/terapipe.md): `attn`, the share (0..1) of a whole
# sequence's F, B and W time that is causal attention; `op_fixed`, the seconds of every op that do not
# shrink with its tokens (launches, the runtime's own work per op).
# Experts (docs/moe.md): `moe_layers`, the stage's MoE layers (a count; `--moe-layers` wins over it); `a2a`,
# the seconds of one of its all-to-alls; `a2a_bytes`, the bytes one rank sends to the others in one of them
# (the time is then the expert link's latency plus these bytes over its bandwidth).
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
    "attn",
    "op_fixed",
    "moe_layers",
    "a2a",
    "a2a_bytes",
)

# The memory keys a schedule's `memory` declarations, `--mem` and the API may set (pipec.sim.memory says
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
    rows of pipec.ir.opcodes) on `stage`, issued just before the rank's op at index `before` of its order
    (`before == len(rank's ops)`: after its last op). Ranks without any use the lowering's default placement."""

    op: str
    stage: int
    before: int
    span: Span | None = None


@dataclass(frozen=True)
class MemOp:
    """A memory op the schedule places (`op` in pipec.ir.opcodes.MEMOPS: "RECOMPUTE", "OFFLOAD" or "RELOAD")
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
class Slicing:
    """Token slices (TeraPipe) and sequence lengths: what the ops' micro-batch index means when either is
    declared (docs/terapipe.md).

    With `slices` n > 1 each micro-batch (sequence) i is cut along its tokens into n slices, and the ops'
    micro-batch index is the *unit* u = i * n + j of slice j (`unit`, `split`): every pass that counts,
    orders or sends per micro-batch does so per unit, unchanged, and `Schedule.num_microbatches` counts
    units. What slices add are two same-stage rules (`pipec.ir.rules`, the one place they
    live): F(i, j, s) needs F(i, j - 1, s), whose keys and values it attends to, and B(i, j, s) needs
    B(i, j + 1, s), which returns the gradients of those keys and values. W(i, j, s) needs B(i, j, s) only:
    the key/value gradients of the later slices reach slice j through its B.

    `tokens[j]` is slice j's length, `lengths[i]` micro-batch i's (variable-length micro-batches; all equal
    to `seqlen` when sliced), and `seqlen` the tokens of the sequence the stage costs and bytes are given
    for. `weight` is the one rule of what a unit costs relative to that sequence."""

    sequences: int  # micro-batches (the schedule's m)
    slices: int  # per micro-batch
    seqlen: int
    tokens: tuple[int, ...]  # per slice
    lengths: tuple[int, ...]  # per micro-batch

    @property
    def num_units(self) -> int:
        return self.sequences * self.slices

    def unit(self, mb: int, j: int) -> int:
        return mb * self.slices + j

    def split(self, unit: int) -> tuple[int, int]:
        """(micro-batch, slice) of a unit."""
        return divmod(int(unit), self.slices)

    def unit_tokens(self) -> np.ndarray:
        """Per unit, its tokens."""
        if self.slices == 1:
            return np.asarray(self.lengths, dtype=np.int64)
        return np.tile(np.asarray(self.tokens, dtype=np.int64), self.sequences)

    def unit_context(self) -> np.ndarray:
        """Per unit, the tokens of its sequence before it (what its attention also reads)."""
        before = np.concatenate([[0], np.cumsum(self.tokens)[:-1]]).astype(np.int64)
        return np.tile(before, self.sequences) if self.slices > 1 else np.zeros(self.sequences, dtype=np.int64)

    def weight(self, attn: np.ndarray | float) -> np.ndarray:
        """Per unit, its compute relative to one whole sequence of `seqlen` tokens, when a share `attn`
        (0..1) of that whole sequence's time is causal attention: (1 - attn) l / L for the per-token work
        and attn l (2c + l + 1) / (L (L + 1)) for attention (token t attends to t + 1 tokens), for a unit
        of l tokens after c of context. The units of one sequence of L tokens sum to 1 whatever the cut."""
        tok = self.unit_tokens().astype(float)
        ctx = self.unit_context().astype(float)
        L = float(self.seqlen)
        return (1.0 - np.asarray(attn)) * tok / L + np.asarray(attn) * tok * (2 * ctx + tok + 1) / (L * (L + 1))

    def share(self) -> np.ndarray:
        """Per unit, its share of a whole sequence's tokens: what its activations and messages weigh."""
        return self.unit_tokens().astype(float) / float(self.seqlen)

    def describe(self) -> dict:
        """The JSON form (Program headers, `--json` documents)."""
        return {
            "slices": self.slices,
            "seqlen": self.seqlen,
            "tokens": list(self.tokens),
            "lengths": list(self.lengths),
        }

    def op_text(self, kind: str, unit: int, stage: int) -> str:
        """An op as people read it: `F(1, slice 2, stage 0)`; `F(1, stage 0)` when unsliced."""
        if self.slices == 1:
            return f"{kind}({unit}, stage {stage})"
        i, j = self.split(unit)
        return f"{kind}({i}, slice {j}, stage {stage})"


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


@dataclass(frozen=True)
class Policy:
    """An `order` block as a value: how each rank chooses among its ready ops (`pipec.passes.policy` says what
    each field means and derives the orders). The front end leaves it on `Schedule.order`; the driver resolves
    it (`pipec.passes.policy.resolve`) before anything reads the ranks' orders."""

    prefer: tuple[str, ...] = ("B", "F", "W")
    inflight: tuple[float, ...] | None = None  # per rank; None or inf: no limit
    stage_inflight: tuple[float, ...] | None = None  # per stage
    w_mode: str = "idle"
    w_lag: tuple[int, ...] | None = None  # per rank

    def describe(self) -> str:
        parts = ["prefer " + ", ".join(self.prefer)]
        if self.inflight is not None:
            parts.append("inflight " + " ".join(_num(x) for x in self.inflight))
        if self.stage_inflight is not None:
            parts.append("stage inflight " + " ".join(_num(x) for x in self.stage_inflight))
        if self.w_lag is not None:
            parts.append("W lag " + " ".join(str(x) for x in self.w_lag))
        parts.append(f"W {self.w_mode}")
        return "; ".join(parts)


def _num(x: float) -> str:  # a limit as `describe` writes it: `-` for none
    return "-" if x is None or math.isinf(x) else f"{x:g}"


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
    """An evaluated schedule: its stages, their placement, each rank's ordered ops, costs, memory and topology.

    What `pipec.load` returns (checked op by op) and `pipec.compile` lowers; `ops(r)` lists rank r's ops in order.
    """

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
    # Token slices and sequence lengths (None: neither declared); with slices, ops' `mb` is a unit.
    slicing: Slicing | None = None
    # An `order` block not yet resolved: the ranks' orders are empty until `pipec.passes.policy.resolve`
    # derives them (then None). `order_ranks`: the ranks the orders are wanted for (None: all).
    order: Policy | None = None
    order_ranks: tuple[int, ...] | None = None
    # The stage graph from the schedule's `edge` declarations (pipec.ir.graph); None: the chain s -> s + 1.
    graph: StageGraph | None = None
    # The orders each rank may run at run time (`window`, `any`; pipec.ir.family); None: the orders above.
    family: OrderFamily | None = None

    @property
    def split_backward(self) -> bool:
        return "W" in self.kinds

    @property
    def num_ops(self) -> int:
        return sum(len(r) for r in self.ranks)

    @functools.cached_property
    def placement_array(self) -> np.ndarray:
        return frozen_array(self.placement)

    @functools.cached_property
    def _stages_by_rank(self) -> tuple[tuple[int, ...], ...]:
        by: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for s, owner in enumerate(self.placement):
            if 0 <= owner < self.num_ranks:  # a placement out of range is a check's to report
                by[owner].append(s)
        return tuple(tuple(b) for b in by)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages placed on `rank`, in order (one pass over the placement for all ranks, made once)."""
        return self._stages_by_rank[rank] if 0 <= rank < self.num_ranks else ()

    def head(self) -> dict:
        """What names this schedule in every JSON document (`check`, `simulate`, ... `--json`)."""
        return {
            "schedule": self.name,
            "source": self.source.path if self.source else None,
            "params": dict(self.params),
            "stages": self.num_stages,
            "ranks": self.num_ranks,
            "microbatches": self.num_sequences,
            **({"slicing": self.slicing.describe()} if self.slicing else {}),
        }

    @property
    def num_sequences(self) -> int:
        """Micro-batches as sequences of tokens: `num_microbatches` over the slices of each."""
        return self.slicing.sequences if self.slicing else self.num_microbatches

    def op_text(self, kind: str, mb: int, stage: int) -> str:
        """An op as diagnostics name it (`Slicing.op_text`)."""
        if self.slicing is None:
            return f"{kind}({mb}, stage {stage})"
        return self.slicing.op_text(kind, mb, stage)

    def ops(self, rank: int) -> list[Op]:
        r = self.ranks[rank]
        kinds = self.kinds
        return [Op(kinds[k], int(i), int(s)) for k, i, s in zip(r.kind.tolist(), r.mb.tolist(), r.stage.tolist())]

    def span_of(self, rank: int, index: int) -> Span:
        return self.spans[int(self.ranks[rank].sid[index])]

    def param(self, name: str):
        return dict(self.params)[name]


def unit_label(slicing: Slicing | None, unit: int) -> str:
    """A micro-batch, or with token slices a unit, in the compact form every picture uses (the grid, the text
    gantt, the trace's event names, the plots): `3` for micro-batch 3; `1s2` for slice 2 of micro-batch 1
    (unit 1 * n + 2, `Slicing.split`). `s` and not `.`: `.` already marks the stage (`F1s2.5`)."""
    if slicing is None or slicing.slices == 1:
        return str(unit)
    i, j = slicing.split(unit)
    return f"{i}s{j}"


def unit_json(slicing: Slicing | None, unit: int) -> dict[str, int]:
    """A micro-batch, or a unit, as JSON documents and trace arguments carry it: `{"mb": 3}`; with token
    slices `{"mb": 1, "slice": 2, "unit": 6}` (the micro-batch is the sequence; `unit` is the index the
    Program and the Timeline use)."""
    if slicing is None or slicing.slices == 1:
        return {"mb": int(unit)}
    i, j = slicing.split(unit)
    return {"mb": i, "slice": j, "unit": int(unit)}


def frozen_array(placement: tuple[int, ...]) -> np.ndarray:
    """A placement as a read-only int64 array, made once per Schedule or Program (their `placement_array`):
    passes that work rank by rank index it rather than convert the tuple each time (O(stages) a rank, so
    O(ranks x stages) in all)."""
    a = np.asarray(placement, dtype=np.int64)
    a.setflags(write=False)
    return a
