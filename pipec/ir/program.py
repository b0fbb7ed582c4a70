"""The Program: one instruction stream per rank (data only; its two versioned serialisations are
`pipec.formats.program_file`).

Instructions are numpy columns per rank (a million-op schedule lowers to
millions of instructions); `RankProgram.instructions()` gives readable
`Instr`s. What each opcode means (operands, message key, peer, grouping) is
the instruction table's, `pipec.ir.opcodes`; `pipec.ir.validate` checks a Program
against it, and both readers (`pipec.formats.program_file`) call it, so nothing
read from a file runs unproven. `group[j]` binds instruction j to j + 1: a batched send/receive
exchange (one `batch_isend_irecv`) or an overlapped compute pair. Memory ops
(RECOMPUTE, OFFLOAD, RELOAD) are instructions like the others: both forms
write and read them by the table, with no change to either format (the JSON
form's `opcodes` list names them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from pipec.errors import Source
from pipec.ir.buffers import BufferPlan
from pipec.ir.experts import Experts
from pipec.ir.family import OrderFamily
from pipec.ir.graph import StageGraph
from pipec.ir.opcodes import (
    BWD,
    BY_NAME,
    CODE,
    COMPUTE,
    FWD,
    IS_COMPUTE,
    KIND_OF,
    OFFLOAD,
    OPCODES,
    RECOMPUTE,
    RECV_ACT,
    RECV_GRAD,
    RECVS,
    REDUCE_GRAD,
    RELOAD,
    RESHARD,
    SEND_ACT,
    SEND_GRAD,
    SENDS,
    STEP,
    UNSHARD,
    WGRAD,
)

# The vocabulary lives in pipec.ir.opcodes; these names stay importable from here for readers of a Program.
from pipec.ir.schedule import RankOps, Schedule, Slicing, frozen_array

__all__ = [
    "BWD",
    "COMPUTE",
    "FWD",
    "OFFLOAD",
    "OPCODES",
    "RECOMPUTE",
    "RECV_ACT",
    "RECV_GRAD",
    "RECVS",
    "REDUCE_GRAD",
    "RELOAD",
    "RESHARD",
    "SEND_ACT",
    "SEND_GRAD",
    "SENDS",
    "STEP",
    "UNSHARD",
    "WGRAD",
    "Instr",
    "Program",
    "RankProgram",
    "schedule_of",
]


@dataclass(frozen=True)
class Instr:
    op: str
    mb: int = -1  # -1 where it does not apply (REDUCE_GRAD, STEP)
    stage: int = -1
    peer: int = -1  # -1 for local instructions
    group: bool = False  # bound to the next instruction
    # A transfer's stage at the other end of its edge (pipec.ir.graph): SEND_ACT i s names the edge (s,
    # other), RECV_ACT i s the edge (other, s); -1 on a chain Program, where it is s + the table's
    # peer_stage. The text form writes it after the peer (`SEND_ACT 0 0 1 3`) only in a graph Program.
    other: int = -1

    def __str__(self) -> str:
        """The text form's line: the name, then the operands the instruction table gives it."""
        vals = {"mb": self.mb, "stage": self.stage, "peer": self.peer}
        words = [self.op, *(str(vals[x]) for x in BY_NAME[self.op].operands)]
        if self.other >= 0:
            words.append(str(self.other))
        return " ".join(words) + (" &" if self.group else "")


@dataclass(frozen=True, eq=False)
class RankProgram:
    op: np.ndarray
    mb: np.ndarray
    stage: np.ndarray
    peer: np.ndarray
    group: np.ndarray
    # Per instruction, a transfer's stage at the other end of its edge (Instr.other), -1 elsewhere; None in
    # a chain Program (the other end is the neighbour the instruction table names).
    other: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.op)

    def instructions(self) -> list[Instr]:
        cols = (self.op.tolist(), self.mb.tolist(), self.stage.tolist(), self.peer.tolist(), self.group.tolist())
        others = self.other.tolist() if self.other is not None else [-1] * len(self.op)
        return [Instr(OPCODES[o], m, s, p, bool(g), t) for o, m, s, p, g, t in zip(*cols, others)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankProgram):
            return NotImplemented
        same = all(np.array_equal(getattr(self, f), getattr(other, f)) for f in ("op", "mb", "stage", "peer", "group"))
        return same and (
            (self.other is None and other.other is None)
            or (self.other is not None and other.other is not None and np.array_equal(self.other, other.other))
        )

    @staticmethod
    def from_instructions(instrs: list[Instr]) -> RankProgram:
        return RankProgram(
            np.array([CODE[i.op] for i in instrs], dtype=np.int64),
            np.array([i.mb for i in instrs], dtype=np.int64),
            np.array([i.stage for i in instrs], dtype=np.int64),
            np.array([i.peer for i in instrs], dtype=np.int64),
            np.array([i.group for i in instrs], dtype=bool),
            np.array([i.other for i in instrs], dtype=np.int64) if any(i.other >= 0 for i in instrs) else None,
        )


@dataclass(frozen=True, eq=False)
class Program:
    """A compiled schedule: one instruction stream per rank (`ranks[r].instrs`), with what it was compiled for.

    What `pipec.compile` returns, `pipec.write_program` writes and `pipec.read_program` reads (docs/program.md);
    the runtime runs it as it is. Frozen: a pass makes a new one rather than changing this one.
    """

    name: str
    params: tuple[tuple[str, object], ...]
    num_stages: int
    num_ranks: int
    num_microbatches: int
    split_backward: bool
    placement: tuple[int, ...]
    ranks: tuple[RankProgram, ...]
    # Data parallelism: the replicas of each rank that run this Program (a "dp" mesh dim of that size) and
    # how they share a stage's parameters: "ddp" (replicated; REDUCE_GRAD all-reduces) or "fsdp" (sharded;
    # UNSHARD/RESHARD gather and free, REDUCE_GRAD reduce-scatters).
    dp: int = 1
    dp_kind: str = "ddp"
    # Token slices and sequence lengths (pipec.ir.schedule.Slicing; None: neither): with slices, every
    # instruction's `mb` is a unit (micro-batch * slices + slice) and `num_microbatches` counts units.
    slicing: Slicing | None = None
    # Forward only (an evaluation pass, pipec.passes.lower.forward_program): FWDs and their activations
    # alone; no backward, no gradient message, no REDUCE_GRAD or STEP.
    forward_only: bool = False
    # Expert parallelism (pipec.ir.experts): how each MoE layer's experts are spread over an expert group of
    # consecutive dp replicas, and per stage its MoE layers (empty: none). With a group of 2 ranks or more,
    # each FWD and BWD of a stage with L MoE layers issues 2L all-to-alls (the opcode table's `a2a` column),
    # an overlapped pair's in `pair_order`; the simulator charges them, the executor issues them.
    experts: Experts = Experts()
    moe_layers: tuple[int, ...] = ()
    # The stage graph (pipec.ir.graph; None: the chain s -> s + 1). With one, each transfer names its edge
    # (RankProgram.other) and the file's version is 2 (pipec.formats.program_file).
    graph: StageGraph | None = None
    family: OrderFamily | None = None  # the orders chosen at run time (pipec.ir.family); None: static
    # The buffer plan (pipec.ir.buffers, made by pipec.passes.bufferplan; None: none). With one the file's
    # version is 3 (pipec.formats.program_file).
    buffers: BufferPlan | None = None

    @property
    def a2a_layers(self) -> tuple[int, ...]:
        """Per stage, the MoE layers whose all-to-alls its ops issue: `moe_layers` with an expert group of 2
        ranks or more, else none (every rank holds every expert; tokens never leave it)."""
        if self.experts.size > 1 and any(self.moe_layers):
            return tuple(self.moe_layers)
        return (0,) * self.num_stages

    @property
    def num_sequences(self) -> int:
        return self.slicing.sequences if self.slicing else self.num_microbatches

    @functools.cached_property
    def placement_array(self) -> np.ndarray:
        return frozen_array(self.placement)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Program):
            return NotImplemented
        head = (
            "name",
            "params",
            "num_stages",
            "num_ranks",
            "num_microbatches",
            "split_backward",
            "placement",
            "dp",
            "dp_kind",
            "slicing",
            "forward_only",
            "experts",
            "moe_layers",
            "graph",
            "buffers",
        )
        same = all(getattr(self, f) == getattr(other, f) for f in head) and self.ranks == other.ranks
        return same and _reorders(self.family) == _reorders(other.family)

    @property
    def num_instructions(self) -> int:
        return sum(len(r) for r in self.ranks)


def _reorders(family: OrderFamily | None) -> tuple | None:
    """A family as equality sees it: each rank's family that reorders (a static rank's is none) and the NCCL
    reason; a family that reorders no rank is none. A Program file carries just that much."""
    if family is None or family.is_static:
        return None
    return tuple(family.of(r) for r in range(len(family.ranks))), family.nccl


def schedule_of(prog: Program, source: Source | None = None) -> Schedule:
    """The Schedule a Program executes: each rank's computes in their order (an overlapped pair stays a
    pair), with the Program's sizes, parameters and placement. A Program holds no cost, memory,
    topology or `expect` declarations, so the defaults apply to it (give costs with `cost=`). Here, below
    the formats, so that a Program file's reader can prove the order family it carries on it
    (`pipec.formats.family_field`); `pipec.driver.schedule_of` is this."""
    ranks = []
    for rp in prog.ranks:
        idx = np.flatnonzero(IS_COMPUTE[rp.op])
        ranks.append(
            RankOps(
                kind=KIND_OF[rp.op[idx]],
                mb=rp.mb[idx],
                stage=rp.stage[idx],
                sid=np.zeros(len(idx), dtype=np.int64),
                paired=rp.group[idx],
            )
        )
    return Schedule(
        name=prog.name,
        params=tuple(prog.params),
        num_stages=prog.num_stages,
        num_ranks=prog.num_ranks,
        num_microbatches=prog.num_microbatches,
        kinds=("F", "B", "W") if prog.split_backward else ("F", "B"),
        placement=tuple(prog.placement),
        ranks=tuple(ranks),
        source=source,
        slicing=prog.slicing,
        graph=prog.graph,
    )
