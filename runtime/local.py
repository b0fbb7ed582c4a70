"""`--local` mode: every rank of a Program in this one process, messages through in-memory queues.

Same matching rules as NCCL, checked strictly: on each directed channel (sender, receiver) the k-th
receive a rank posts matches the k-th message sent, and its key (kind, micro-batch, sending stage) must
be the one the receive names. Ranks are interleaved in one thread (each rank's step is a generator that
yields when a message has not arrived), so a run is deterministic and a stuck Program is reported as a
deadlock naming each rank's instruction instead of hanging. Tensors are handed over without a copy.
Runs on CPU or on one GPU (`device="cuda"`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Mapping
from typing import Any

import torch

from pipec.ir.program import Program
from pipec.runtime.errors import PipelineError
from pipec.runtime.exec.comm import Key, Recv, key_str
from pipec.runtime.exec.shapes import KV, Specs
from pipec.runtime.runner import Runner, StageOptions, StepResult, Transport


class LocalHub:
    def __init__(self) -> None:
        self.sent: dict[tuple[int, int], list[tuple[Key, tuple[torch.Tensor, ...]] | None]] = {}
        self.posted: dict[tuple[int, int], int] = {}
        self.keyed: dict[tuple[int, int, Key], tuple[torch.Tensor, ...]] = {}  # KeyedLocalComm's messages


class LocalRecv(Recv):
    __slots__ = ("index",)


class LocalComm:
    def __init__(self, hub: LocalHub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def post(self, key: Key, peer: int, specs: Specs) -> Recv:
        ch = (peer, self.rank)
        index = self.hub.posted.get(ch, 0)
        self.hub.posted[ch] = index + 1
        r = LocalRecv(key, peer, (), [])
        r.index = index
        return r

    def send(self, key: Key, peer: int, tensors: tuple[torch.Tensor, ...]) -> None:
        self.hub.sent.setdefault((self.rank, peer), []).append((key, tensors))

    def exchange(self, items: list[tuple[str, Key, int, object]]) -> list[Recv | None]:
        return [self.send(k, p, x) if what == "send" else self.post(k, p, x) for what, k, p, x in items]

    def ready(self, recv: LocalRecv) -> bool:
        return len(self.hub.sent.get((recv.peer, self.rank), ())) > recv.index

    def wait(self, recv: LocalRecv) -> Generator[object, None, tuple[torch.Tensor, ...]]:
        while not self.ready(recv):
            yield recv
        queue = self.hub.sent[(recv.peer, self.rank)]
        key, tensors = queue[recv.index]
        queue[recv.index] = None  # free it
        if key != recv.key:
            raise PipelineError(
                f"rank {self.rank}: receive #{recv.index} from rank {recv.peer} expects {key_str(recv.key)}, "
                f"but message #{recv.index} on that channel is {key_str(key)}: both ends must issue their "
                "messages in the same order"
            )
        return tuple(t.detach() for t in tensors)

    def finish_sends(self) -> None:
        pass


class KeyedLocalComm(LocalComm):
    """--local for a Program with an order family: messages matched by key, as gloo and shared memory match
    them (the ranks' orders are chosen at run time, pipec.runtime.exec.dynamic, so channel order is not
    the Program's)."""

    def post(self, key: Key, peer: int, specs: Specs) -> Recv:
        r = LocalRecv(key, peer, (), [])
        r.index = -1
        return r

    def send(self, key: Key, peer: int, tensors: tuple[torch.Tensor, ...]) -> None:
        self.hub.keyed[(self.rank, peer, key)] = tensors

    def ready(self, recv: LocalRecv) -> bool:
        return (recv.peer, self.rank, recv.key) in self.hub.keyed

    def peek(self, recv: LocalRecv) -> tuple[torch.Tensor, ...] | None:
        return self.hub.keyed.get((recv.peer, self.rank, recv.key))

    def wait(self, recv: LocalRecv) -> Generator[object, None, tuple[torch.Tensor, ...]]:
        while not self.ready(recv):
            yield recv
        return tuple(t.detach() for t in self.hub.keyed.pop((recv.peer, self.rank, recv.key)))


class LocalKV(KV):
    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value

    def get(self, key: str, waiting_for: str, peer: int) -> Generator[object, None, str]:
        while key not in self.data:
            yield key
        return self.data[key]


class LocalPipeline:
    """All ranks of a Program in one process; `step(inputs, targets)` runs one training step. `options` and
    `transport` are the Runner's (pipec.runtime.runner); the transport's `comm` and `kv` are this process's
    in-memory queues and store, whatever it says."""

    def __init__(
        self,
        program: Program,
        build_stage: Callable[[int, int], torch.nn.Module] | Mapping[int, torch.nn.Module],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        options: StageOptions | None = None,
        transport: Transport | None = None,
    ) -> None:
        hub, kv = LocalHub(), LocalKV()
        options, transport = options or StageOptions(), transport or Transport()
        self.program = program
        fam = program.family
        keyed = fam is not None and not fam.is_static and not transport.static
        Comm = KeyedLocalComm if keyed else LocalComm
        self.runners = [
            Runner(
                program,
                build_stage,
                loss_fn,
                rank=r,
                options=options,
                transport=dataclasses.replace(transport, comm=Comm(hub, r), kv=kv),
            )
            for r in range(program.num_ranks)
        ]

    def step(self, inputs: Any, targets: Any, *, record: bool = False) -> StepResult:
        gens = {r.rank: r.step_gen(inputs, targets, record=record) for r in self.runners}
        waiting: dict[int, object] = {}
        results: dict[int, StepResult] = {}
        while gens:
            progressed = False
            for rank in list(gens):
                w = waiting.get(rank)
                if w is not None and not self._ready(rank, w):
                    continue
                progressed = True
                try:
                    waiting[rank] = next(gens[rank])
                except StopIteration as stop:
                    results[rank] = stop.value
                    del gens[rank]
                    waiting.pop(rank, None)
                    progressed = True
            if gens and not progressed:
                stuck = "; ".join(f"rank {r} at {self.runners[r].where()}" for r in sorted(gens))
                raise PipelineError(f"deadlock: every remaining rank waits for a message: {stuck}")
        losses = [res.loss for res in results.values() if res.loss is not None]
        return StepResult(results[0].step, losses[0] if losses else None, max(res.seconds for res in results.values()))

    def _ready(self, rank: int, w: object) -> bool:
        if isinstance(w, LocalRecv):
            return self.runners[rank].executor.comm.ready(w)
        if isinstance(w, str):  # a handshake key
            return w in self.runners[rank].kv.data
        return True

    def events(self) -> list[list[tuple]]:
        return [r.events() for r in self.runners]

    def named_gradients(self) -> dict[tuple[int, str], torch.Tensor | None]:
        return {k: v for r in self.runners for k, v in r.named_gradients().items()}

    def named_parameters(self) -> dict[tuple[int, str], torch.Tensor]:
        return {k: v for r in self.runners for k, v in r.named_parameters().items()}
