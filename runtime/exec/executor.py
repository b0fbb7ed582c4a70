"""The instruction loop of one rank for one training step: exactly the Program's order.

Values live in one table keyed like messages, (kind, micro-batch, producing stage): a stage's output
waits there for its SEND_ACT (or for the next stage's FWD when that stage is on this rank: a local
hand-off, nothing copied), and a posted receive waits there for the compute that consumes it. At the end
of the step the table must be empty and every stage's backward done.

Dispatch is one table, `Executor.HANDLERS`: opcode -> the method that executes it (pipec.ir.opcodes declares
the vocabulary; adding an opcode is a row there and a method here). The loop itself only takes each
compute's input message (the table's `needs`) and calls the opcode's method.

`run` is a generator: over torch.distributed it never yields (waits block); in --local mode it yields
whenever a message has not arrived, so one thread can interleave all ranks.

`recv_ahead` posts each receive up to that many receives before the Program places it (0: where the
Program says). gloo needs it: its point-to-point protocol is a rendezvous, so a message whose receive
is posted after the send is only written when the sender's background thread handles the receiver's
"ready" notice, and on a rank busy computing that thread may wait for the next scheduler tick
(milliseconds). Posted ahead, the receive is known to the sender when it sends and the data goes out
at once. NCCL must not post ahead: a pending receive holds up later transfers with the same peer on
its stream, which the Program's channel order (`pipec.passes.lower`) accounts for and an early post does not.

Memory ops: a FWD whose (micro-batch, stage) has a RECOMPUTE in this rank's stream keeps only its input
(`Stage.forward(keep_input_only=True)`), and the RECOMPUTE reruns it (`Stage.recompute`). OFFLOAD and
RELOAD move the saved tensors of a (micro-batch, stage) through the rank's `Pool` of saved-tensor holders
(pipec.runtime.exec.saved), which exists when the Program offloads or when `measure_memory` asked for the
peak saved bytes of each step (`peaks`, per pool).

Expert parallelism (`moe`, a pipec.runtime.exec.alltoall.ExpertGroup, with each stage's MoE layer count in
`moe_layers`): every compute runs inside `ExpertGroup.running`, which counts its all-to-alls against what
its kind and its stage imply (pipec.ir.experts.all_to_alls); an overlapped pair (two computes bound by the
group bit, class OVERLAP of the table) runs on two threads passing a baton at their all-to-alls
(pipec.runtime.exec.pairs), unless `overlap` is off (`--no-overlap`: one op after the other, the baseline).
Both ops' input messages are taken before the pair starts.

Token slices: the instructions' micro-batch is a unit (slice j of sequence i; the inputs and targets lists
are per unit), and everything above holds per unit; the cache of keys and values across the slices of a
sequence lives in each Stage (pipec.runtime.exec.slices). Messages name their unit as `where` does.

A stage graph (`program.graph`, pipec.ir.graph): values are keyed by (kind, micro-batch, edge)
(pipec.runtime.exec.comm.edge_key), each transfer's edge from its `other` stage (RankProgram.other). A FWD
takes the activation of every in-edge (spread in the order of `graph.inputs(s)`; a source stage takes the
micro-batch) and leaves one message per out-edge; a BWD takes the gradient of every out-edge and leaves
the gradient of each in-edge's message, on that edge. An edge between two stages of this rank is a local
hand-off, as on the chain.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from types import MethodType
from typing import Any

import torch

from pipec.ir.experts import all_to_alls
from pipec.ir.opcodes import (
    BWD,
    FWD,
    GROUP_CLASS,
    IS_RECV,
    KIND_OF,
    OFFLOAD,
    OP_KINDS,
    OPCODES,
    OVERLAP,
    RECOMPUTE,
    REDUCE_GRAD,
    RELOAD,
    UNSHARD,
    WGRAD,
)
from pipec.ir.program import Instr, Program
from pipec.ir.validate import validate
from pipec.runtime.errors import PipelineError, ShapeError
from pipec.runtime.exec import buffers
from pipec.runtime.exec.alltoall import OpRun
from pipec.runtime.exec.comm import ACT, GRAD, Key, Recv, key_str
from pipec.runtime.exec.pairs import Baton, PairRunner
from pipec.runtime.exec.rankplan import Many, RankPlan
from pipec.runtime.exec.saved import Peaks, Pool
from pipec.runtime.exec.shapes import Specs, TensorSpec, fmt
from pipec.runtime.exec.stage import Stage

_IS_RECV = IS_RECV.tolist()  # a list: indexing a numpy array per instruction costs more
_ALONE = object()  # a transfer handler's `got` when `_one` runs one transfer of a batched pair alone


def _own(comm: Any, name: str, default: Any) -> Any:
    """A transport's own attribute, not one a wrapper forwards from the transport inside it (EmulatedComm's
    `__getattr__`): the inner transport's `take` would skip the wrapper's `wait`, which holds messages back."""
    return getattr(comm, name) if hasattr(type(comm), name) else default


class Executor:
    def __init__(
        self,
        program: Program,
        rank: int,
        stages: dict[int, Stage],
        comm: Any,
        on_reduce_grad: Callable[[int, torch.nn.Module], None] | None = None,
        recv_ahead: int = 0,
    ) -> None:
        if recv_ahead < 0:
            raise ValueError(f"recv_ahead must be at least 0, got {recv_ahead}")
        validate(program)  # nothing runs unproven: the loop below relies on every rule of the table
        self.program = program
        self.rank = rank
        # per instruction, everything that does not change between steps (pipec.runtime.exec.rankplan): the
        # message a compute consumes (`needs`: on a graph a `Many`, one per edge), the message a transfer names
        # (`tkeys`), what a compute leaves (`leaves`), each receive's place in stream order (`recv_ord`)
        plan = self.plan = RankPlan(program, rank)
        self.instrs, self.others = plan.instrs, plan.others
        self.needs, self.tkeys, self.leaves = plan.needs, plan.tkeys, plan.leaves
        self.recvs, self.recv_ord = plan.recvs, plan.recv_ord
        self.peers = [ins[3] for ins in self.instrs]
        self.grouped = [bool(ins[4]) for ins in self.instrs]  # the group bit: a batched pair, or an overlapped pair
        self.S = program.num_stages
        self.graph = program.graph
        self.in_sizes: dict[tuple[int, int], list[int]] = {}  # a graph's FWD: tensors per in-edge, for its BWD
        self.stages = stages
        self.comm = comm
        self.on_reduce_grad = on_reduce_grad
        self.recv_specs: dict[Key, Specs] = {}
        self.send_specs: dict[Key, Specs] = {}
        self.values: dict[Key, Any] = {}
        self.step = -1
        self.at = -1  # index of the instruction being executed; read by the fault monitor
        self.handshaking = False
        self.record: list[tuple] | None = None  # measured events of this step when not None
        self.sync: Callable[[], None] = lambda: None  # CUDA: synchronize before reading the clock
        self.recv_ahead = recv_ahead
        # data parallelism (pipec.runtime.exec.replicas.StageDP): UNSHARD, RESHARD, REDUCE_GRAD and STEP's wait
        self.dp: Any = None
        # a blocking transport's wait as a plain call (no generator per message); None: `wait`, which may yield
        self.take = _own(comm, "take", None)
        self.one_by_one = bool(_own(comm, "one_by_one", False))
        table = Executor.FORWARD_ONLY if program.forward_only else Executor.HANDLERS
        self.handlers = [MethodType(table[name], self) for name in OPCODES]
        self.outputs: dict[int, Any] = {}  # a forward-only step's last-stage outputs, by micro-batch
        self.inputs: list | None = None  # this step's micro-batch inputs (stage 0) and targets (last stage)
        self.targets: list | None = None
        self.posted = 0  # receives of this step posted so far (a prefix of self.recvs)
        self.reached = 0  # receive instructions of this step the loop has reached
        # memory ops: the (mb, stage) pairs whose FWD keeps only its input, and the saved-tensor pool
        self.recomputed, self.keep_only = plan.recomputed, plan.keep_only
        offloaded = plan.offloaded
        self.pool: Pool | None = None
        self.peaks: Peaks | None = None  # the last step's peak saved bytes, when a pool exists
        # expert parallelism: the expert group (None without), MoE layers per stage, whether pairs overlap
        self.moe: Any = None
        self.moe_layers: dict[int, int] = {}
        self.expert_grads: Any = None  # pipec.runtime.model.moe.ExpertGrads: expert gradients at REDUCE_GRAD
        self.overlap = True
        self.timeout = 60.0  # the run's, for a pair's waits
        self.pairs = PairRunner()
        # receive buffers (pipec.runtime.exec.buffers): slots from the plan after each shape exchange; `fixed`
        # False (the runner's, when shapes may change between steps): a buffer per message
        self.fixed_shapes = True
        self.slots: buffers.Slots | None = None
        self.unalias: Callable[[Any], Any] | None = None  # Slots.unaliased while receives land in slots
        # per stage of this rank, `unalias` where the stage takes received messages (its outputs may share a
        # slot's memory), else None: the outputs of a stage fed by no slot are not looked up in the slots
        self.unalias_of: dict[int, Callable[[Any], Any] | None] = dict.fromkeys(stages)
        self.made: list[int] = []  # receive-buffer tensors created in each step run so far
        # the sends' shapes are checked against the exchange's in the first step after each exchange only: a
        # stage's output shape follows from its input's, which the runner holds to the exchange's every step
        self.checking = True
        if offloaded:
            self._use_pool()

    def measure_memory(self) -> None:
        """Count every saved activation from the next step on: `peaks` is then each step's (saved-tensor
        hooks on every forward; without this and without OFFLOAD, the forwards run without hooks)."""
        self._use_pool()

    def _use_pool(self) -> None:
        if self.pool is None:
            self.pool = Pool()
            for st in self.stages.values():
                st.pool = self.pool

    # ---- where we are, for error messages -----------------------------------------------------
    def instr(self, j: int) -> Instr:
        op, mb, s, peer, g = self.instrs[j]
        return Instr(OPCODES[op], mb, s, peer, bool(g), self.others[j])

    def where(self) -> str:
        if self.at < 0:
            if self.step < 0:
                return "start-up"
            what = "the shape handshake" if self.handshaking else "before the first instruction"
            return f"step {self.step + 1}, {what}"
        if self.at >= len(self.instrs):
            return f"step {self.step + 1}, after the last instruction"
        text = f"step {self.step + 1}, instruction #{self.at} `{self.instr(self.at)}`"
        sl = self.program.slicing
        if sl is not None and sl.slices > 1:
            i, j = sl.split(self.instrs[self.at][1])
            text += f" (micro-batch {i}, slice {j})"
        return text

    # ---- shapes ---------------------------------------------------------------------------------
    def set_specs(self, ins: dict[int, list[Specs]], outs: dict[int, list[Specs]]) -> None:
        for s in self.stages:
            for mb, specs in enumerate(ins[s]):
                if s > 0:
                    self.recv_specs[(ACT, mb, s - 1)] = specs
                    self.send_specs[(GRAD, mb, s)] = specs
            for mb, specs in enumerate(outs[s]):
                if s < self.S - 1:
                    self.send_specs[(ACT, mb, s)] = specs
                    self.recv_specs[(GRAD, mb, s + 1)] = specs
        self._prepare()

    def set_edge_specs(self, edge_in: dict[tuple[int, int], list[Specs]], edge_out: dict) -> None:
        """`set_specs` on a stage graph: the specs of each in-edge and out-edge of this rank's stages, per
        micro-batch (pipec.runtime.exec.shapes.handshake_graph)."""
        for (u, v), per_mb in edge_in.items():
            for mb, specs in enumerate(per_mb):
                self.recv_specs[(ACT, mb, (u, v))] = specs
                self.send_specs[(GRAD, mb, (u, v))] = specs
        for (u, v), per_mb in edge_out.items():
            for mb, specs in enumerate(per_mb):
                self.send_specs[(ACT, mb, (u, v))] = specs
                self.recv_specs[(GRAD, mb, (u, v))] = specs
        self._prepare()

    def _prepare(self) -> None:
        prepare = getattr(self.comm, "prepare", None)  # a transport that sizes its buffers from the shapes (shm)
        if prepare is not None:
            prepare(self.recv_specs, self.send_specs)
        inner = getattr(self.comm, "inner", self.comm)  # under emulated links, the transport inside
        self.checking = True
        if hasattr(inner, "slots"):  # a transport that receives into buffers (gloo, NCCL, shared memory)
            made = self.slots.made if self.slots is not None else 0
            self.slots = buffers.build(self, getattr(inner, "device", torch.device("cpu")), self.fixed_shapes)
            self.slots.made += made
            inner.slots = self.slots
            self.unalias = self.slots.unaliased if self.slots.fixed else None
            self.unalias_of = {s: self.unalias if s in self.plan.slot_fed else None for s in self.stages}

    # ---- the loop -------------------------------------------------------------------------------
    def run(self, step: int, inputs: list | None, targets: list | None) -> Generator[object, None, None]:
        """Execute this rank's instructions for one step, in the Program's order: each through its opcode's
        method (`HANDLERS`), after taking the message it consumes (the opcode table's `needs`) when the
        stage that sends it exists; a wait for that message is the only place the loop yields."""
        self.step, self.at = step, -1
        self.inputs, self.targets = inputs, targets
        self.outputs = {}
        rec = self.record
        n = len(self.instrs)
        instrs, needs, handlers = self.instrs, self.needs, self.handlers
        t_run = time.perf_counter() if rec is not None else 0.0
        self.posted = self.reached = 0
        pool = self.pool
        if pool is not None:
            pool.reset_peaks()
        self._post_upto(self.recv_ahead)
        moe = self.moe
        if moe is not None:
            moe.step, moe.record = step, rec
        take, values = self.take, self.values
        j = 0
        while j < n:
            self.at = j
            op, mb, s, _, g = instrs[j]
            key = needs[j]
            if key is None:
                got = None
            elif key.__class__ is Many:  # a stage graph's compute: one message per edge
                got = yield from self._take_need(key)
            elif take is not None and rec is None:  # the common case inline: a blocking transport, no record
                got = values.pop(key, None)
                if got.__class__ is not tuple:
                    got = take(got) if isinstance(got, Recv) else (yield from self._take(key, got))
            else:
                got = yield from self._take_need(key)
            if moe is None:
                j += handlers[op](j, mb, s, got)
            elif g and GROUP_CLASS[op] == OVERLAP and self.overlap:
                key = needs[j + 1]
                other = None if key is None else (yield from self._take_need(key))
                j += self._pair(j, got, other)
            else:
                j += self._counted(j, got, None, 0)
        self.at = n
        self.inputs = self.targets = None
        self.comm.finish_sends()  # every send of the step has completed (after STEP's, none is left)
        self.checking = False
        if self.slots is not None:  # the step's new receive buffers (its exchange's pools included)
            self.made.append(self.slots.made - sum(self.made))
        if pool is not None:
            self.peaks = pool.peaks()
        if rec is not None:  # the instructions' span, for the time of the step outside them
            rec.append(("run", t_run, time.perf_counter()))
        self.check_consumed()

    def check_consumed(self) -> None:
        """At a step's end every value was consumed and every micro-batch had its backward; else the Program
        is inconsistent (both the static and the dynamic executor end their steps with this)."""
        left = [key_str(k) for k in self.values]
        undone = {s: st.check_done() for s, st in self.stages.items() if st.check_done()}
        if left or undone:
            raise PipelineError(
                f"rank {self.rank}: the step ended with unconsumed values ({', '.join(left) or 'none'}) or "
                f"micro-batches without backward ({undone or 'none'}): the Program is inconsistent"
            )

    # ---- one method per opcode: (index, micro-batch, stage, the message taken) -> instructions consumed ----
    def _fwd(self, j: int, mb: int, s: int, got: Any) -> int:
        if self.graph is not None:
            return self._fwd_graph(j, mb, s, got)
        args = self.inputs[mb] if got is None else got
        if self.dp is not None:
            self.dp.ready(s)
        rec = self.record
        if rec is not None:
            t0, c0 = time.perf_counter(), time.thread_time()  # its CPU: ranks that share cores (insitu)
        target = self.targets[mb] if s == self.S - 1 else None
        out = self.stages[s].forward(mb, args, target, keep_input_only=self.keep_only[j])
        if out is not None:
            un = self.unalias_of[s]
            self.values[self.leaves[j]] = out if un is None else un(out)
        if rec is not None:
            self.sync()
            rec.append(("compute", FWD, mb, s, t0, time.perf_counter(), time.thread_time() - c0))
        return 1

    def _infer(self, j: int, mb: int, s: int, got: Any) -> int:
        """FWD in a forward-only Program: no graph; the last stage's output is kept in `outputs`."""
        if self.graph is not None and got is not None:
            got = tuple(t for msg in got for t in msg)
        args = self.inputs[mb] if got is None else got
        last = s == self.S - 1
        target = self.targets[mb] if last and self.targets is not None else None
        out = self.stages[s].infer(mb, args, target)
        if self.unalias is not None:  # what leaves the step must not be a slot's memory
            out = self.unalias((out,))[0] if last and isinstance(out, torch.Tensor) else out
            out = out if last else [self.unalias(m) for m in out] if self.graph is not None else self.unalias(out)
        if last:
            self.outputs[mb] = out
        elif self.graph is not None:
            for v, msg in zip(self.graph.outputs(s), out):
                self.values[(ACT, mb, (s, v))] = msg
        else:
            self.values[(ACT, mb, s)] = out
        return 1

    def _fwd_graph(self, j: int, mb: int, s: int, got: list | None) -> int:
        """FWD on a stage graph: the in-edges' messages spread in order (a source: the micro-batch), one
        message left per out-edge."""
        if got is None:
            args = self.inputs[mb]
        else:
            args = tuple(t for msg in got for t in msg)
            self.in_sizes[(mb, s)] = [len(msg) for msg in got]
        if self.dp is not None:
            self.dp.ready(s)
        rec = self.record
        t0 = time.perf_counter() if rec is not None else 0.0
        c0 = time.thread_time() if rec is not None else 0.0
        target = self.targets[mb] if s == self.S - 1 else None
        out = self.stages[s].forward(mb, args, target, keep_input_only=self.keep_only[j])
        if out is not None:
            un = self.unalias_of[s]
            for key, msg in zip(self.leaves[j], out):
                self.values[key] = msg if un is None else un(msg)
        if rec is not None:
            self.sync()
            rec.append(("compute", FWD, mb, s, t0, time.perf_counter(), time.thread_time() - c0))
        return 1

    def _bwd(self, j: int, mb: int, s: int, got: Any) -> int:
        if self.dp is not None:
            self.dp.ready(s)
        rec = self.record
        if rec is not None:
            t0, c0 = time.perf_counter(), time.thread_time()  # its CPU: ranks that share cores (insitu)
        if self.graph is None:
            dargs = self.stages[s].backward(mb, got)
            key = self.leaves[j]
            if key is not None:
                un = self.unalias_of[s]
                self.values[key] = dargs if un is None or dargs is None else un(dargs)
        else:  # the out-edges' gradients in edge order; the input gradient cut back into the in-edges'
            dargs = self.stages[s].backward(mb, None if got is None else tuple(t for msg in got for t in msg))
            sizes = self.in_sizes.pop((mb, s), None)
            if dargs is not None and self.unalias_of[s] is not None:
                dargs = self.unalias(dargs)
            if sizes is not None and dargs is not None:
                at = 0
                for key, n in zip(self.leaves[j], sizes):
                    self.values[key] = dargs[at : at + n]
                    at += n
        if rec is not None:
            self.sync()
            rec.append(("compute", BWD, mb, s, t0, time.perf_counter(), time.thread_time() - c0))
        return 1

    def _wgrad(self, j: int, mb: int, s: int, got: Any) -> int:
        if self.dp is not None:
            self.dp.ready(s)
        rec = self.record
        t0 = time.perf_counter() if rec is not None else 0.0
        c0 = time.thread_time() if rec is not None else 0.0  # its CPU: ranks that share cores (insitu)
        self.stages[s].wgrad(mb)
        if rec is not None:
            self.sync()
            rec.append(("compute", WGRAD, mb, s, t0, time.perf_counter(), time.thread_time() - c0))
        return 1

    def _step(self, j: int, mb: int, s: int, got: Any) -> int:
        self.comm.finish_sends()
        rec = self.record
        t0 = time.perf_counter() if rec is not None else 0.0
        if self.dp is not None:
            self.dp.finish(s)  # waits for REDUCE_GRAD's reduction
        self.stages[s].step()
        if rec is not None:
            self.sync()
            rec.append(("step", s, t0, time.perf_counter()))
        return 1

    def _reduce_grad(self, j: int, mb: int, s: int, got: Any) -> int:
        rec = self.record
        t0 = time.perf_counter() if rec is not None else 0.0
        if self.dp is not None:
            self.dp.reduce_grad(s)
        if self.expert_grads is not None:
            self.expert_grads.reduce(s)
        if self.on_reduce_grad is not None:
            self.on_reduce_grad(s, self.stages[s].module)
        if rec is not None:
            rec.append(("collective", REDUCE_GRAD, s, t0, time.perf_counter()))
        return 1

    def _unshard(self, j: int, mb: int, s: int, got: Any) -> int:
        rec = self.record
        t0 = time.perf_counter() if rec is not None else 0.0
        if self.dp is not None:
            self.dp.unshard(s)
        if rec is not None:
            rec.append(("collective", UNSHARD, s, t0, time.perf_counter()))
        return 1

    def _reshard(self, j: int, mb: int, s: int, got: Any) -> int:
        if self.dp is not None:
            self.dp.reshard(s)
        return 1

    def _recompute(self, j: int, mb: int, s: int, got: Any) -> int:
        rec = self.record
        t0 = time.perf_counter() if rec is not None else 0.0
        self.stages[s].recompute(mb)
        if rec is not None:
            self.sync()
            rec.append(("memop", RECOMPUTE, mb, s, t0, time.perf_counter()))
        return 1

    def _offload(self, j: int, mb: int, s: int, got: Any) -> int:
        return self._move(OFFLOAD, self.pool.offload, mb, s)

    def _reload(self, j: int, mb: int, s: int, got: Any) -> int:
        return self._move(RELOAD, self.pool.reload, mb, s)

    def _move(self, op: int, move: Callable[[int, int], None], mb: int, s: int) -> int:
        rec = self.record
        t0 = time.perf_counter() if rec is not None else 0.0
        move(mb, s)
        if rec is not None:
            rec.append(("memop", op, mb, s, t0, time.perf_counter()))
        return 1

    def _send(self, j: int, mb: int, s: int, got: Any) -> int:
        """SEND_ACT, SEND_GRAD: the message leaves the values table for its peer. With the group bit, a batched
        exchange of it and the next instruction (`_pair_transfer`), unless `got` is `_ALONE` (`_one`)."""
        if got is not _ALONE and self.grouped[j]:
            return self._pair_transfer(j)
        key, peer = self.tkeys[j], self.peers[j]
        self.comm.send(key, peer, self._leaving(key, peer, s))
        if self.recv_ahead:
            self._post_upto(self.reached + self.recv_ahead)
        return 1

    def _recv(self, j: int, mb: int, s: int, got: Any) -> int:
        """RECV_ACT, RECV_GRAD: the receive is posted (unless posted ahead already); the compute that consumes
        the message waits for it. The group bit as in `_send`."""
        if got is not _ALONE and self.grouped[j]:
            return self._pair_transfer(j)
        k = self.recv_ord[j]
        self.reached = k + 1
        if k >= self.posted:  # not posted ahead: posted now
            self.posted = k + 1
            key, peer = self.tkeys[j], self.peers[j]
            if self.record is not None:
                self.record.append(("post", *key, peer, time.perf_counter()))
            self.values[key] = self.comm.post(key, peer, self.recv_specs[key])
        if self.recv_ahead:
            self._post_upto(self.reached + self.recv_ahead)
        return 1

    def _pair_transfer(self, j: int) -> int:
        """Transfers j and j + 1 (the group bit: validate allows exactly two transfers with one peer) as one
        batched exchange. A transport that issues an exchange's transfers one by one anyway (`one_by_one`:
        gloo, shared memory) takes them as two single ones."""
        if self.one_by_one:
            self._one(j)
            self._one(j + 1)
        else:
            self._exchange([j, j + 1])
        return 2

    def _one(self, j: int) -> None:
        """One send or receive, alone (its group bit ignored)."""
        op, mb, s, _, _ = self.instrs[j]
        (self._recv if _IS_RECV[op] else self._send)(j, mb, s, _ALONE)

    def _item(self, j: int) -> tuple[str, Key, int, Any] | None:
        """Transfer j as ("send", key, peer, tensors) or ("recv", key, peer, specs); None for a receive
        posted ahead already."""
        op, _, s, peer, _ = self.instrs[j]
        if _IS_RECV[op]:
            k = self.recv_ord[j]
            self.reached = k + 1
            if k < self.posted:
                return None
            self.posted = k + 1  # not posted ahead: posted now
            return self._recv_item(j)
        key = self.tkeys[j]
        return ("send", key, peer, self._leaving(key, peer, s))

    def _leaving(self, key: Key, peer: int, s: int) -> tuple:
        """A message about to be sent, alone or in an exchange: taken from the values table, its shapes held to
        the handshake's (when checking), its send recorded (when recording)."""
        tensors = self.values.pop(key)
        if self.checking:
            self._check_send(key, s, tensors)
        if self.record is not None:
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            self.record.append(("send", *key, peer, time.perf_counter(), nbytes))
        return tensors

    def _check_send(self, key: Key, s: int, tensors: tuple) -> None:
        """A stage's output must have the shapes the handshake established (a transport's buffers have them)."""
        expected = self.send_specs.get(key)
        if expected is None:
            return
        if len(tensors) == len(expected) == 1:  # the common case without a generator
            if tensors[0].shape == expected[0].shape and tensors[0].dtype == expected[0].dtype:
                return
        elif len(tensors) == len(expected) and all(
            t.shape == e.shape and t.dtype == e.dtype for t, e in zip(tensors, expected)
        ):
            return
        got = tuple(TensorSpec.of(t) for t in tensors)
        raise ShapeError(
            f"stage {s} produced {fmt(got)} as {key_str(key)} at step {self.step + 1}, but the shape "
            f"exchange established {fmt(expected)} (a stage's output shape must follow from its input "
            "shape alone)"
        )

    # The one dispatch table: opcode name -> the method that executes it (every opcode of
    # pipec.ir.opcodes has one; `handlers` is it indexed by opcode number, bound to this executor).
    HANDLERS: dict[str, Callable[..., int]] = {
        "FWD": _fwd,
        "BWD": _bwd,
        "WGRAD": _wgrad,
        "RECV_ACT": _recv,
        "SEND_ACT": _send,
        "RECV_GRAD": _recv,
        "SEND_GRAD": _send,
        "REDUCE_GRAD": _reduce_grad,
        "STEP": _step,
        "UNSHARD": _unshard,
        "RESHARD": _reshard,
        "RECOMPUTE": _recompute,
        "OFFLOAD": _offload,
        "RELOAD": _reload,
    }
    # A forward-only Program (an evaluation pass, `Program.forward_only`) differs in one row.
    FORWARD_ONLY: dict[str, Callable[..., int]] = {**HANDLERS, "FWD": _infer}

    def _take(self, key: Key, v: Any = None) -> Generator[object, None, Any]:
        """The message `key` (popped from the table unless given as `v`), its receive completed."""
        if v is None:
            v = self.values.pop(key, None)
        if v is None:
            raise PipelineError(
                f"rank {self.rank}: {key_str(key)} is needed but was never received or produced here: "
                "the Program is inconsistent"
            )
        if isinstance(v, Recv):
            peer = v.peer
            v = yield from self.comm.wait(v)
            if self.record is not None:
                self.record.append(("recv", *key, peer, time.perf_counter()))
        return v

    # ---- expert parallelism: counted ops and overlapped pairs ------------------------------------------
    def _expected(self, j: int) -> int:
        """All-to-alls instruction j issues: by its kind and its stage's MoE layers (a RECOMPUTE is a forward)."""
        op, _, s, _, _ = self.instrs[j]
        k = int(KIND_OF[op])
        if op == RECOMPUTE:
            k = OP_KINDS.index("F")
        return all_to_alls(OP_KINDS[k], self.moe_layers.get(s, 0)) if k >= 0 else 0

    def _counted(self, j: int, got: Any, baton: Baton | None, slot: int) -> int:
        """Instruction j with its all-to-alls counted (and, in a pair, its turns taken from the baton)."""
        op, mb, s, _, _ = self.instrs[j]
        run = OpRun(j, str(self.instr(j)), s, op, self._expected(j), baton, slot, mb=mb)
        with self.moe.running(run):
            if baton is not None:
                baton.start(slot)
            used = self.handlers[op](j, mb, s, got)
            if baton is not None:
                baton.finish(slot)
        return used

    def _pair(self, j: int, first: Any, second: Any) -> int:
        """The overlapped pair j, j + 1 (pipec.runtime.exec.pairs): j on this thread, j + 1 on the pair
        thread, taking turns at their all-to-alls in pipec.ir.experts.pair_order."""
        who = f"rank {self.rank}, step {self.step + 1}, pair #{j} `{self.instr(j)}` & #{j + 1} `{self.instr(j + 1)}`"
        baton = Baton(self._expected(j), self._expected(j + 1), self.timeout, lambda: who)
        self.pairs.run(lambda: self._counted(j, first, baton, 0), lambda: self._counted(j + 1, second, baton, 1), baton)
        if self.record is not None:  # each turn's wake-up, for the in-situ profile's `pair_handoff`
            self.record.extend(("handoff", w) for w in baton.waits)
        return 2

    def _take_need(self, key: Any) -> Generator[object, None, Any]:
        """What a compute consumes: one message (the chain), or on a stage graph each edge's, in edge order."""
        if key.__class__ is not Many:
            return (yield from self._take(key))
        got = []
        for k in key:
            got.append((yield from self._take(k)))
        return got

    def _recv_item(self, j: int) -> tuple[str, tuple[int, int, int], int, Any]:
        peer, key = self.instrs[j][3], self.tkeys[j]
        if self.record is not None:
            self.record.append(("post", *key, peer, time.perf_counter()))
        return ("recv", key, peer, self.recv_specs[key])

    def _post_upto(self, count: int) -> None:
        """Post the step's receives, in stream order, until `count` of them are posted."""
        count = min(count, len(self.recvs))
        while self.posted < count:
            _, key, peer, specs = self._recv_item(self.recvs[self.posted])
            self.values[key] = self.comm.post(key, peer, specs)
            self.posted += 1

    def _exchange(self, js: list[int]) -> None:
        """Transfers js as one batched exchange (NCCL's batch_isend_irecv)."""
        items = [item for item in map(self._item, js) if item is not None]
        if len(items) > 1:
            handles = self.comm.exchange(items)
        elif not items:
            handles = []
        elif items[0][0] == "send":
            handles = [self.comm.send(*items[0][1:])]
        else:
            handles = [self.comm.post(*items[0][1:])]
        for (what, key, _, _), h in zip(items, handles):
            if what == "recv":
                self.values[key] = h
        if self.recv_ahead:
            self._post_upto(self.reached + self.recv_ahead)
