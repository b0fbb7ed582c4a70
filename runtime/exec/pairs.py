"""Overlapped pairs (`F & B`, DualPipe's overlapped forward-backward): two ops on two threads passing a
baton at their all-to-alls, so the all-to-all of one travels while the other computes.

Why threads: an op's all-to-alls sit deep inside its forward (an MoE layer's dispatch and combine) or its
backward (their gradients, run by autograd on the thread that called backward, for CPU tensors); cutting
the ops into phases would mean cutting the user's model and autograd's graph. Two threads that meet at the
all-to-alls need neither: each runs its op as it always does, and `pipec.runtime.exec.alltoall` calls
`Baton.handoff` right after issuing an all-to-all asynchronously.

The baton follows `pipec.ir.experts.pair_order` exactly: compute segment k of op o runs only when the
pair's order says (o, k) is next; after it the op issues its k-th all-to-all (or ends) and the order moves
on. The order is fixed by the two ops' all-to-all counts alone, so every rank of an expert group, running
the same pair, issues its all-to-alls in the same order (a collective issued in different orders on one
group deadlocks: the odd-layer-count bug of Megatron-LM's overlapped 1F1B). Only one segment computes at a
time (the baton), so the ops never compete for the CPU; what overlaps is the all-to-all in flight.

Every wait has the run's timeout and an error naming the rank and both instructions. When one op fails,
the other is woken and stops at its next turn, and the first failure is the one raised.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipec.ir.experts import pair_order
from pipec.runtime.errors import PipelineError


class PairAborted(PipelineError):
    """The pair's other op failed; this one stops (the other's error is the one reported)."""


class Baton:
    """Whose compute segment may run: the pair's order of (op, segment), and how far it has got."""

    def __init__(self, first: int, second: int, timeout: float, who: Callable[[], str]) -> None:
        self.order = pair_order(first, second)
        self.pos = 0
        self.seg = [0, 0]  # per op: the segment it runs (or waits to run) next
        self.timeout = timeout
        self.who = who
        self.cond = threading.Condition()
        self.failed: BaseException | None = None
        self.handed = 0.0  # time.perf_counter() of the last turn handed over
        self.waits: list[float] = []  # per turn taken from the other op: handed over to running (wake-up)

    def start(self, op: int) -> None:
        """Wait until op's first segment is the pair's next."""
        self._wait_turn(op)

    def handoff(self, op: int) -> None:
        """Op has issued an all-to-all: its segment is over, the order moves on; wait for its next turn."""
        self._advance(op)
        self._wait_turn(op)

    def finish(self, op: int) -> None:
        """Op's last segment is over."""
        self._advance(op)

    def fail(self, e: BaseException) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = e
            self.cond.notify_all()

    def _advance(self, op: int) -> None:
        with self.cond:
            here = self.order[self.pos] if self.pos < len(self.order) else None
            if here != (op, self.seg[op]):
                self.failed = self.failed or PipelineError(
                    f"{self.who()}: op {op} of the pair ended segment {self.seg[op]} out of the pair's order "
                    f"{list(self.order)} at position {self.pos} (it issued more all-to-alls than its stage's MoE "
                    "layers imply)"
                )
                self.cond.notify_all()
                raise self.failed
            self.pos += 1
            self.seg[op] += 1
            self.handed = time.perf_counter()
            self.cond.notify_all()

    def _wait_turn(self, op: int) -> None:
        deadline = time.monotonic() + self.timeout
        slept = False
        with self.cond:
            while True:
                if self.failed is not None:
                    raise PairAborted(f"{self.who()}: stopped, the pair's other op failed: {self.failed}")
                if self.pos < len(self.order) and self.order[self.pos] == (op, self.seg[op]):
                    if slept:  # the other op handed the turn over while this one slept: its wake-up
                        self.waits.append(time.perf_counter() - self.handed)
                    return
                slept = True
                left = deadline - time.monotonic()
                if left <= 0:
                    nxt = self.order[self.pos] if self.pos < len(self.order) else "none"
                    e = PipelineError(
                        f"{self.who()}: op {op} of the overlapped pair waited {self.timeout:g} s for its turn "
                        f"(segment {self.seg[op]}; the pair's next segment is {nxt}): the other op is stuck"
                    )
                    self.failed = self.failed or e
                    self.cond.notify_all()
                    raise e
                self.cond.wait(left)


class PairRunner:
    """Runs the two ops of overlapped pairs: the first on the calling thread, the second on one worker
    thread kept for the run (started at the first pair)."""

    def __init__(self) -> None:
        self.pool: ThreadPoolExecutor | None = None

    def run(self, first: Callable[[], Any], second: Callable[[], Any], baton: Baton) -> None:
        """first() and second() each run one op, calling baton.start/finish around it (the caller's
        functions do); returns when both are done, raising the first failure."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipec-pair")

        def guarded(fn: Callable[[], Any]) -> None:
            try:
                fn()
            except BaseException as e:
                baton.fail(e)
                raise

        fut = self.pool.submit(guarded, second)
        err: BaseException | None = None
        try:
            guarded(first)
        except BaseException as e:  # noqa: BLE001 - the first failure of either op is raised below
            err = e
        try:
            fut.result(timeout=baton.timeout + 5.0)
        except BaseException as e:  # noqa: BLE001
            err = err or e
        if err is not None:
            failed = baton.failed or err
            raise failed if not isinstance(failed, PairAborted) or err is failed else err

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
