"""The buffer plan: per rank, a slot for every tensor the Program's memory rule names, slots reused by
lifetime (data only; made and proven by `pipec.passes.bufferplan`, carried by a Program as
`Program.buffers`, written by `pipec.formats.program_file` as format version 3).

A tensor is one of a rank's buffers for one micro-batch (or unit, with token slices): what a stage
receives or is handed along an in-edge (`input`), the gradient of its output it receives or is handed
along an out-edge (`grad`), what its F keeps beyond its inputs (`saved`), what its B keeps for its W
beyond its inputs (`wsaved`), what a recomputed F keeps beyond its inputs (`ckpt`), and the host copy of
any of these an OFFLOAD makes (`host`). Tensors of one class (kind, stage, edge, tokens, pool) have one
shape in a run, so a class is a pool of interchangeable slots: the plan holds no shapes, only how many
slots each pool needs and which slot each tensor takes; the runtime sizes each pool once (from the
shape handshake) and `size` is the memory model's amount for reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The kinds of tensor, in words for reports (pipec.passes.bufferplan says when each is born and dies).
KINDS = {
    "input": "received or handed input",
    "grad": "gradient of the output",
    "saved": "saved activations",
    "wsaved": "kept for W",
    "ckpt": "kept for RECOMPUTE",
}


@dataclass(frozen=True)
class Pool:
    """One class of tensor on one rank and its slots."""

    kind: str  # a key of KINDS
    stage: int
    edge: int = -1  # input, grad: the edge id (pipec.ir.graph; the chain's edge (s, s + 1) is s); else -1
    tokens: int = -1  # with token slices: the tokens of the units it holds; -1: whole micro-batches
    host: bool = False  # the host pool (an OFFLOAD's copy); else the device pool
    slots: int = 0
    size: float = 0.0  # one slot's amount in the plan's unit (the memory model's: units or bytes)
    bound: str = ""  # "": every tensor of the class has this size; else why `size` is an upper bound

    @property
    def key(self) -> tuple[str, int, int, int, bool]:
        return (self.kind, self.stage, self.edge, self.tokens, self.host)

    def describe(self) -> str:
        """`saved activations of stage 3`, `input of stage 2 along edge 1 (host)`, for reports and errors."""
        text = f"{KINDS.get(self.kind, self.kind)} of stage {self.stage}"
        text += f" along edge {self.edge}" if self.edge >= 0 else ""
        text += f", {self.tokens}-token units" if self.tokens >= 0 else ""
        return text + (" (host)" if self.host else "")


@dataclass(frozen=True, eq=False)
class RankPlan:
    """A rank's pools and, per tensor in the plan's order (by birth: pipec.passes.bufferplan), its pool
    (an index into `pools`), its micro-batch (unit) and its slot in that pool."""

    pools: tuple[Pool, ...]
    pool: np.ndarray
    mb: np.ndarray
    slot: np.ndarray

    def __len__(self) -> int:
        return len(self.pool)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankPlan):
            return NotImplemented
        cols = ("pool", "mb", "slot")
        return self.pools == other.pools and all(np.array_equal(getattr(self, c), getattr(other, c)) for c in cols)

    def amount(self, host: bool = False) -> float:
        """The pool's total: every slot of every pool of that side at its class's size."""
        return float(sum(p.slots * p.size for p in self.pools if p.host == host))

    @property
    def slots(self) -> int:
        return sum(p.slots for p in self.pools if not p.host)


@dataclass(frozen=True)
class BufferPlan:
    """Per rank, its `RankPlan`; `unit` is the memory model's ("units" or "bytes")."""

    unit: str
    ranks: tuple[RankPlan, ...]

    def device(self) -> list[float]:
        """Per rank, the device pool's planned amount (every slot at its size)."""
        return [rp.amount() for rp in self.ranks]

    def host(self) -> list[float]:
        return [rp.amount(True) for rp in self.ranks]

    def largest_message(self) -> float:
        """The largest slot of a message pool (`input`, `grad`) over all ranks, 0 without one."""
        return max((p.size for rp in self.ranks for p in rp.pools if p.kind in ("input", "grad")), default=0.0)

    @property
    def bounded(self) -> tuple[Pool, ...]:
        """The pools whose size is an upper bound (variable-length micro-batches, MoE token counts)."""
        return tuple(p for rp in self.ranks for p in rp.pools if p.bound)
