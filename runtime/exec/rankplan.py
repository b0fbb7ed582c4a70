"""One rank's instructions prebuilt once per Program: what the executor reads per instruction, as flat lists.

Why: the step's loop runs every instruction of every step, and on a small model what it does besides the
model's own calls is the executor's cost (`benchmarks/executor_profile.py`). Everything about an instruction
that does not change between steps is worked out here, once: the message a compute consumes (`needs`, the
instruction table's `needs`), the message a transfer names (`tkeys`), the message a compute leaves
(`leaves`), each receive's place in the stream's order of receives (`recv_ord`), whether a FWD keeps only
its input (`keep_only`, its micro-batch is recomputed), and which stages may hold receive-slot memory
(`slot_fed`). The loop then builds no key tuple, does no table lookup by opcode beyond the handler's, and
formats nothing; messages naming the rank and the instruction are built only when something fails.

The meaning of each opcode stays in the instruction table (pipec.ir.opcodes) and in the executor's one
dispatch table (`Executor.HANDLERS`); this module only indexes the Program.
"""

from __future__ import annotations

from typing import Any

from pipec.ir.opcodes import BWD, FWD, IS_RECV, KEY_STAGE, MSG_OF, NEEDS_MSG, NEEDS_STAGE, OFFLOAD, RECOMPUTE, RELOAD
from pipec.ir.program import Program
from pipec.runtime.exec.comm import ACT, GRAD, Key, edge_key


class Many(list):
    """The messages a compute of a stage graph consumes, one per edge, in edge order."""


class RankPlan:
    """Rank `rank`'s instructions of `program`, each field a list indexed by instruction (see the module)."""

    def __init__(self, program: Program, rank: int) -> None:
        rp = program.ranks[rank]
        self.S = program.num_stages
        self.graph = program.graph
        instrs = list(zip(rp.op.tolist(), rp.mb.tolist(), rp.stage.tolist(), rp.peer.tolist(), rp.group.tolist()))
        self.instrs = instrs
        self.others: list[int] = rp.other.tolist() if rp.other is not None else [-1] * len(instrs)
        is_recv = IS_RECV.tolist()
        # the receives in stream order, and each receive instruction's place in that order
        self.recvs = [j for j, ins in enumerate(instrs) if is_recv[ins[0]]]
        self.recv_ord = {j: k for k, j in enumerate(self.recvs)}
        need = self._needed if self.graph is None else self._needed_graph
        self.needs: list[Any] = [need(op, mb, s) for op, mb, s, _, _ in instrs]
        self.tkeys: list[Key | None] = [
            self._key(op, mb, s, o) if MSG_OF[op] >= 0 else None for (op, mb, s, _, _), o in zip(instrs, self.others)
        ]
        self.leaves: list[Any] = [self._leaves(op, mb, s) for op, mb, s, _, _ in instrs]
        self.recomputed = {(mb, s) for op, mb, s, _, _ in instrs if op == RECOMPUTE}
        self.offloaded = {(mb, s) for op, mb, s, _, _ in instrs if op in (OFFLOAD, RELOAD)}
        self.keep_only = [op == FWD and (mb, s) in self.recomputed for op, mb, s, _, _ in instrs]
        # The stages a received message goes into (an activation's or a gradient's consumer). Only their
        # outputs can share memory with a receive slot (a stage that returns its input, or a gradient passed
        # through): the others' outputs are not checked against the slots (`Slots.unaliased`).
        received = {self.tkeys[j] for j in self.recvs}
        self.slot_fed = {ins[2] for ins, need in zip(instrs, self.needs) if _consumes(need, received)}

    def _needed(self, op: int, mb: int, s: int) -> Key | None:
        """The message a compute consumes (the instruction table's `needs`), None when it consumes none or
        its sender would be outside the pipeline (stage 0's FWD takes the inputs, the last stage's BWD the loss)."""
        sender = s + int(NEEDS_STAGE[op])
        if NEEDS_MSG[op] < 0 or not 0 <= sender < self.S:
            return None
        return (int(NEEDS_MSG[op]), mb, sender)

    def _needed_graph(self, op: int, mb: int, s: int) -> Many | None:
        """On a stage graph: a FWD needs the activation of each in-edge, a BWD the gradient of each out-edge
        (None: a source's FWD takes the inputs, the last stage's BWD the loss)."""
        msg = int(NEEDS_MSG[op])
        if msg < 0:
            return None
        g = self.graph
        keys = [(ACT, mb, (u, s)) for u in g.inputs(s)] if msg == ACT else [(GRAD, mb, (s, v)) for v in g.outputs(s)]
        return Many(keys) if keys else None

    def _key(self, op: int, mb: int, s: int, other: int = -1) -> Key:
        """The message a transfer names: (what travels, micro-batch, sending stage); on a stage graph (what
        travels, micro-batch, its edge), the edge from the instruction's stage and its `other` end."""
        kind = int(MSG_OF[op])
        if self.graph is None:
            return (kind, mb, s + int(KEY_STAGE[op]))
        # SEND_ACT and RECV_GRAD name the edge (s, other), RECV_ACT and SEND_GRAD the edge (other, s)
        out = (kind == ACT) != bool(IS_RECV[op])
        return edge_key(kind, mb, s, other, self.graph) if out else edge_key(kind, mb, other, s, self.graph)

    def _leaves(self, op: int, mb: int, s: int) -> Any:
        """What a FWD or BWD leaves in the values table: on the chain its one key (None where nothing is
        passed on: the last stage's FWD, stage 0's BWD); on a graph the keys of its out-edges (FWD) or
        in-edges (BWD), in edge order."""
        if op not in (FWD, BWD):
            return None
        g = self.graph
        if g is None:
            if op == FWD:
                return (ACT, mb, s) if s < self.S - 1 else None
            return (GRAD, mb, s) if s > 0 else None
        if op == FWD:
            return [(ACT, mb, (s, v)) for v in g.outputs(s)]
        return [(GRAD, mb, (u, s)) for u in g.inputs(s)]


def _consumes(need: Any, received: set) -> bool:
    if need is None:
        return False
    if need.__class__ is Many:
        return any(k in received for k in need)
    return need in received
