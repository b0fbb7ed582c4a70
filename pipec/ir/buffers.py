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

Pools of one `bank` share their slots: slot k of each is one piece of memory, so a rank's classes that
peak at different moments (interleaving's stages s and s + p, a V's two chunks, saved vs kept for W)
take turns in it instead of each holding its own busiest moment. A bank joins classes of one size and
one family (messages with messages: the runtime's receive slots; saved tensors with saved tensors), so
that storage can be reused as it is (docs/memory.md, "Buffer plan", says why banks rather than one arena
by offsets).

`ahead` is the receives posted ahead the plan was made for (gloo posts each receive that many receives
before the Program places it, `GLOO_RECV_AHEAD`): a received tensor is born where it is posted. The
slots of a plan for `ahead` hold for any smaller count too (every lifetime only shrinks), so the runtime
takes a plan made for at least its own count; `prove` checks a plan for its own `ahead`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Receives the runtime posts ahead on gloo by default (pipec.runtime.runner; the plan's `ahead` for such a run):
# gloo's rendezvous protocol writes a message at once only when its receive is already posted.
GLOO_RECV_AHEAD = 4

# The kinds of tensor, in words for reports (pipec.passes.bufferplan says when each is born and dies).
KINDS = {
    "input": "received or handed input",
    "grad": "gradient of the output",
    "saved": "saved activations",
    "wsaved": "kept for W",
    "ckpt": "kept for RECOMPUTE",
}
# The family of each kind: only classes of one family share a bank. Messages are what the runtime allocates
# (receive slots, storage it owns and hands out again); saved tensors are autograd's.
FAMILY = {"input": "message", "grad": "message", "saved": "saved", "wsaved": "saved", "ckpt": "saved"}


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
    bank: int = -1  # pools of one bank (>= 0) share their slots (`slots` is then the bank's); -1: its own

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

    def spaces(self) -> list[Pool]:
        """One pool per set of slots: each pool of its own and the first of each bank (its members share
        its slots and size)."""
        seen: set[int] = set()
        out = []
        for p in self.pools:
            if p.bank < 0 or p.bank not in seen:
                seen.add(p.bank)
                out.append(p)
        return out

    def amount(self, host: bool = False) -> float:
        """That side's total: every slot at its size, a bank's slots once."""
        return float(sum(p.slots * p.size for p in self.spaces() if p.host == host))

    @property
    def slots(self) -> int:
        return sum(p.slots for p in self.spaces() if not p.host)


@dataclass(frozen=True)
class BufferPlan:
    """Per rank, its `RankPlan`; `unit` is the memory model's ("units" or "bytes"); `ahead` the receives
    posted ahead it was made for (the module docstring)."""

    unit: str
    ranks: tuple[RankPlan, ...]
    ahead: int = 0

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
