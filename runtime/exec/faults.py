"""Faults emulated in a run (`pipec run --straggler`, `--jitter`; the models are pipec.sim.faults.Faults).

- The straggler: `slow_handlers` wraps the executor's compute handlers (its dispatch table, bound per
  executor) so that an op the model slows (factor f) sleeps (f - 1) times what it took: the rank is f times
  slower on exactly the ops `Faults.slow` draws, the same in a static and in a dynamic run.
- Link jitter: `JitterComm` wraps a transport; every message to another rank carries one float64 more, the
  time (CLOCK_MONOTONIC, one clock for the processes of a host) before which its receiver may not use it:
  the send's time plus `Faults.delay`'s draw for that message. `wait` holds it until then (sleeps on a
  blocking transport, yields in --local); the dynamic executor reads the stamp before it takes the
  message. On shared memory `prepare` sizes every slot one stamp larger.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import torch

from pipec.ir.opcodes import IS_COMPUTE, KIND_OF, OPCODES
from pipec.runtime.exec.comm import Key, Recv
from pipec.runtime.exec.shapes import Specs, TensorSpec
from pipec.sim.faults import Faults

STAMP = TensorSpec((1,), torch.float64)


def slow_handlers(ex: Any, faults: Faults) -> None:
    """Make executor `ex`'s compute ops slow where `faults` says (a no-op without a straggler on its rank)."""
    s = faults.straggler
    if s is None or s.rank != ex.rank or s.factor <= 1 or s.share <= 0:
        return
    for op in range(len(OPCODES)):
        if IS_COMPUTE[op]:
            ex.handlers[op] = _slowed(ex, ex.handlers[op], int(KIND_OF[op]), faults)


def _slowed(ex: Any, handler: Any, kind: int, faults: Faults) -> Any:
    def run(j: int, mb: int, s: int, got: Any) -> int:
        t0 = time.perf_counter()
        used = handler(j, mb, s, got)
        f = faults.slow(ex.step, ex.rank, kind, mb, s)
        if f > 1:
            time.sleep((f - 1) * (time.perf_counter() - t0))
        return used

    return run


def _edge(key: Key) -> tuple[int, int]:
    where = key[2]
    return (where[0], where[1]) if where.__class__ is tuple else (where, -1)


class JitterComm:
    """A transport whose messages to other ranks arrive `Faults.delay` later (see the module's docstring)."""

    def __init__(self, inner: Any, rank: int, faults: Faults, *, blocking: bool = True) -> None:
        self.inner, self.rank, self.faults, self.blocking = inner, rank, faults, blocking
        self.step = 0  # the executor's, set by the runner each step (the draws are per step)
        self.device = getattr(inner, "device", torch.device("cpu"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _stamp(self, key: Key, peer: int, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        u, v = _edge(key)
        due = time.monotonic() + self.faults.delay(self.step, key[0], key[1], u, v, self.rank, peer)
        return (*tensors, torch.tensor([due], dtype=torch.float64, device=self.device))

    def prepare(self, recv_specs: dict[Key, Specs], send_specs: dict[Key, Specs]) -> None:
        """A transport that sizes its buffers from the shapes (shared memory): every message one stamp more."""
        prepare = getattr(self.inner, "prepare", None)
        if prepare is not None:
            prepare({k: (*v, STAMP) for k, v in recv_specs.items()}, {k: (*v, STAMP) for k, v in send_specs.items()})

    def post(self, key: Key, peer: int, specs: Specs) -> Recv:
        return self.inner.post(key, peer, (*specs, STAMP))

    def send(self, key: Key, peer: int, tensors: tuple[torch.Tensor, ...]) -> None:
        return self.inner.send(key, peer, self._stamp(key, peer, tensors))

    def exchange(self, items: list[tuple[str, Key, int, object]]) -> list[Recv | None]:
        out = []
        for what, key, peer, x in items:
            out.append((what, key, peer, self._stamp(key, peer, x) if what == "send" else (*x, STAMP)))
        return self.inner.exchange(out)

    def wait(self, recv: Recv) -> Generator[object, None, tuple[torch.Tensor, ...]]:
        tensors = yield from self.inner.wait(recv)
        due = float(tensors[-1].item())
        if self.blocking:
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        else:
            while time.monotonic() < due:
                yield due
        return tuple(tensors[:-1])

    def finish_sends(self) -> None:
        self.inner.finish_sends()
