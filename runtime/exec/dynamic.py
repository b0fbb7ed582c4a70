"""One rank's step in an order of its family, chosen at run time (docs/language.md section 20; issue 44).

A Program whose rank has an order family (`program.family.of(rank)`, pipec.ir.family) runs here instead of
`Executor.run`'s fixed order, through the executor's own handlers (`Executor.handlers`, the one dispatch
table) and its message table: nothing of an op's meaning is restated.

- Every receive of the step is posted at its start (gloo and shared memory match by key, so posting order
  does not matter; NCCL, which matches by issue order, runs a family only when the compiler found it keeps
  every channel's order, `OrderFamily.nccl` None; the runner refuses the others at start with that reason).
- Op q of the rank's static order (its compute instructions) may run once every op its family forces
  before it has run (the window of the first op not run, f: q < reach[f] in f's segment; an instruction
  that is neither a compute nor a transfer, REDUCE_GRAD or STEP, is a barrier between the ops around it)
  and it is *ready*: its local inputs are there (a BWD after its FWD, a WGRAD after its BWD, a local
  hand-off produced) and each message it consumes has arrived (`arrived`: gloo's `is_completed()`, the
  shared-memory slot's counter, --local's queue; and no emulated link or jitter still holds it).
- Among the ready ops it takes the one the family's `prefer` ranks first (`choose`;
  pipec.sim.machine.prefer_key restates it for the simulator), runs it and, right after, the sends of what
  it produced.
- When none is ready it waits: in --local it yields the first op's receive (the proof's op that must become
  ready); on a blocking transport it polls (50 us to 1 ms between looks) until one is, for at most the run's
  timeout, then fails naming the rank, the step and each instruction it waited at.

pipec.passes.family proves that an executor that runs only ready ops of the family never stalls when the
static order does not (`compile_schedule` proved that). The order taken is recorded as ("order", [the
instruction indices in the order run]) when the step records (`pipec run --trace`), besides each compute's
own event, whose times `pipec view --measured` draws.
"""

from __future__ import annotations

import json
import time
from collections.abc import Generator
from typing import Any

from pipec.formats import family_field
from pipec.ir.family import OrderFamily, RankFamily
from pipec.ir.opcodes import BWD, FWD, IS_COMPUTE, IS_RECV, IS_SEND, KIND_OF, WGRAD
from pipec.runtime.errors import CommError, PipelineError
from pipec.runtime.exec.comm import ACT, Key, Recv, key_str

POLL_MIN, POLL_MAX = 5e-5, 1e-3  # seconds between looks when no op is ready (blocking transports)


def choose(prefer: str, ready: list[int], kinds: list[int], mbs: list[int]) -> int:
    """The op to run among the ready ones (static positions): `order` the earliest, `depth` the lowest
    micro-batch (a backward first), `breadth` a forward first (then the lowest micro-batch)."""
    if prefer == "depth":
        return min(ready, key=lambda q: (mbs[q], -kinds[q], q))
    if prefer == "breadth":
        return min(ready, key=lambda q: (kinds[q], mbs[q], q))
    return min(ready)


def _base(comm: Any) -> tuple[Any, list[Any]]:
    """The transport under the wrappers that stamp messages (EmulatedComm, JitterComm), and the wrappers."""
    layers = []
    while hasattr(comm, "inner") and hasattr(type(comm), "wait"):
        layers.append(comm)
        comm = comm.inner
    return comm, layers


def family_json(family: OrderFamily, num_ranks: int) -> str:
    """The order family as the deprecated `family.json` of `pipec run`'s workers held it (hidden `--family`,
    until 0.3.0): the Program file's `family` field (pipec.formats.family_field), which now carries it."""
    return json.dumps(family_field.to_doc(family, num_ranks))


def family_of_json(text: str) -> OrderFamily:
    """A `family.json` back as an OrderFamily, read as the Program file's field is (ValueError when malformed)."""
    d = json.loads(text)
    if not isinstance(d, dict) or isinstance(d.get("num_ranks"), bool) or not isinstance(d.get("num_ranks"), int):
        raise ValueError("a family file must hold the `family` object of a Program file")
    return family_field.from_doc(family_field.PLAN_VERSION, d, d.get("num_ranks"))


def refuse_nccl(program: Any, rank: int, comm: Any) -> None:
    """On NCCL (a torch.distributed transport that is not gloo), a family that may reorder a channel cannot
    run: refused at start with the compiler's reason (`OrderFamily.nccl`, E429's message)."""
    base, _ = _base(comm)
    why = program.family.nccl if program.family is not None else None
    nccl = hasattr(base, "pg") and base.pg is None and getattr(getattr(base, "device", None), "type", "") == "cuda"
    if why and nccl:
        raise PipelineError(
            f"rank {rank}: `{program.name}`'s order family cannot run on NCCL, which matches a channel's "
            f"messages by issue order: {why}; run it on gloo or shared memory, or in its compiled order (--static)"
        )


class DynamicOrder:
    """Runs executor `ex`'s steps in orders of `family` (its rank's); see the module's docstring."""

    def __init__(self, ex: Any, family: RankFamily) -> None:
        self.ex, self.family = ex, family
        instrs = ex.instrs
        if ex.moe is not None or ex.program.slicing is not None and ex.program.slicing.slices > 1:
            raise PipelineError(f"rank {ex.rank}: an order family runs without expert parallelism or token slices")
        comp = [j for j, ins in enumerate(instrs) if IS_COMPUTE[ins[0]]]
        if len(comp) != family.num_ops:
            raise PipelineError(
                f"rank {ex.rank}: the order family covers {family.num_ops} ops but the Program has {len(comp)} "
                "computes on this rank: the family is not this Program's"
            )
        self.comp = comp
        # every receive is posted at the step's start: the receive buffers' lifetimes (pipec.runtime.exec.buffers,
        # built at the shape exchange) must count them all alive from there, so no two share a slot
        ex.recv_ahead = len(ex.recvs)
        pos = {(instrs[j][0], instrs[j][1], instrs[j][2]): q for q, j in enumerate(comp)}
        n = len(comp)
        self.kinds = [int(KIND_OF[instrs[j][0]]) for j in comp]
        self.mbs = [instrs[j][1] for j in comp]
        self.local: list[list[int]] = []  # per op, the ops of this rank it needs besides messages
        for j in comp:
            op, mb, s = instrs[j][:3]
            need = {BWD: (FWD, mb, s), WGRAD: (BWD, mb, s)}.get(op)
            self.local.append([pos[need]] if need in pos else [])
        # the sends after each op: those of what it produced (its FWD's activation, its BWD's gradient)
        self.sends: list[list[int]] = [[] for _ in range(n)]
        self.barriers: list[list[int]] = [[] for _ in range(n + 1)]  # before op q: other instructions
        seen = 0
        for j, ins in enumerate(instrs):
            op = ins[0]
            if IS_COMPUTE[op]:
                seen += 1
            elif IS_SEND[op]:
                kind, mb, where = ex.tkeys[j]
                if where.__class__ is tuple:
                    where = where[0] if kind == ACT else where[1]
                q = pos.get((FWD if kind == ACT else BWD, mb, where))
                if q is None:
                    raise PipelineError(f"rank {ex.rank}: no compute produces the message of #{j} `{ex.instr(j)}`")
                self.sends[q].append(j)
            elif not IS_RECV[op]:
                self.barriers[seen].append(j)
        self.next_bar = [n] * (n + 1)  # per op, the first barrier position after it
        nxt = n
        for q in range(n, -1, -1):
            self.next_bar[q] = nxt
            if self.barriers[q] and q > 0:
                nxt = q
        _, self.reach, _ = family.arrays()
        self.reach = self.reach.tolist()
        base, self.layers = _base(ex.comm)
        self.base = base
        self.local_mode = hasattr(base, "hub")
        # gloo: a receive's work says it completed only once waited on, so a pool of threads waits on every
        # posted receive (they sleep in C++, the GIL released) and the loop looks at their futures
        self.waiters: Any = None
        self.futures: dict[int, Any] = {}
        if getattr(base, "pg", None) is not None:
            from concurrent.futures import ThreadPoolExecutor

            self.waiters = ThreadPoolExecutor(max(1, len(ex.recvs)), thread_name_prefix=f"pipec-recv-{ex.rank}")
        self.order: list[int] = []  # the last step's order (instruction indices)

    # ---- readiness ----------------------------------------------------------------------------------
    def _raw(self, v: Recv) -> Any:
        """The message of posted receive `v` as the transport has it, or None before it arrived."""
        b = self.base
        if self.local_mode:
            return b.peek(v)
        fut = self.futures.get(id(v))
        if fut is not None:
            if not fut.done():
                return None
            fut.result()  # a failed receive raises here, named
            return v.tensors
        works = getattr(v, "works", None)
        if hasattr(v, "chan"):  # shared memory: the slot's counter
            from pipec.runtime.exec.shm import HEADER

            ch = v.chan
            return ch.views[v.slot] if ch.ctrl[HEADER + 2 * v.slot] >= v.want else None
        if works is not None and all(w.is_completed() for w in works):
            return v.tensors
        return None

    def _await(self, v: Recv) -> None:
        """On a waiter thread: the receive's works waited on (the base transport's timeout and message), then
        dropped, so that the loop's own take does not wait on them again."""
        self.base.take(v)
        v.works = []

    def arrived(self, v: Recv) -> bool:
        raw = self._raw(v)
        if raw is None:
            return False
        if self.layers:
            stamps = sum(1 for c in self.layers if self._stamps(c, v.peer))
            now = time.monotonic()
            if any(float(raw[-1 - i].item()) > now for i in range(stamps)):
                return False
        return True

    def _stamps(self, c: Any, peer: int) -> bool:
        links = getattr(c, "links", None)
        return links.emulated(peer, self.ex.rank) if links is not None else True

    def _ready(self, q: int, done: bytearray) -> bool:
        if not all(done[p] for p in self.local[q]):
            return False
        key = self.ex.needs[self.comp[q]]
        if key is None:
            return True
        values = self.ex.values
        for k in key if key.__class__ is not tuple else (key,):
            v = values.get(k)
            if v is None or (isinstance(v, Recv) and not self.arrived(v)):
                return False
        return True

    def _pending(self, q: int) -> list[tuple[Key, Recv]]:
        key = self.ex.needs[self.comp[q]]
        if key is None:
            return []
        ks = key if key.__class__ is not tuple else (key,)
        return [(k, v) for k in ks if isinstance(v := self.ex.values.get(k), Recv) and not self.arrived(v)]

    # ---- the step -----------------------------------------------------------------------------------
    def run(self, step: int, inputs: list | None, targets: list | None) -> Generator[object, None, None]:
        ex = self.ex
        ex.step, ex.at = step, -1
        ex.inputs, ex.targets = inputs, targets
        ex.outputs = {}
        rec = ex.record
        t_run = time.perf_counter() if rec is not None else 0.0
        ex.posted = ex.reached = 0
        pool = ex.pool
        if pool is not None:
            pool.reset_peaks()
        ex._post_upto(len(ex.recvs))  # every receive of the step, matched by key
        ex.reached = len(ex.recvs)
        self.futures = {}
        if self.waiters is not None:
            for v in ex.values.values():
                if isinstance(v, Recv) and v.works:
                    self.futures[id(v)] = self.waiters.submit(self._await, v)
        n, comp, instrs, handlers = len(self.comp), self.comp, ex.instrs, ex.handlers
        done = bytearray(n)
        order: list[int] = []
        f = b = 0
        prefer = self.family.prefer
        while True:
            while b <= f:  # the barriers at f run once every op before f has
                for j in self.barriers[b]:
                    ex.at = j
                    handlers[instrs[j][0]](j, *instrs[j][1:3], None)
                b += 1
            if f == n:
                break
            hi = min(self.reach[f], self.next_bar[f])
            ready = [q for q in range(f, hi) if not done[q] and self._ready(q, done)]
            if not ready:
                yield from self._wait(f, hi, done)
                continue
            q = choose(prefer, ready, self.kinds, self.mbs) if len(ready) > 1 else ready[0]
            j = comp[q]
            ex.at = j
            op, mb, s = instrs[j][:3]
            key = ex.needs[j]
            got = None if key is None else (yield from ex._take_need(key))
            handlers[op](j, mb, s, got)
            for js in self.sends[q]:
                ex.at = js
                ex._one(js)
            done[q] = 1
            order.append(j)
            while f < n and done[f]:
                f += 1
        ex.at = len(instrs)
        ex.inputs = ex.targets = None
        ex.comm.finish_sends()
        if pool is not None:
            ex.peaks = pool.peaks()
        self.order = order
        if rec is not None:
            rec.append(("order", tuple(order)))
            rec.append(("run", t_run, time.perf_counter()))
        ex.check_consumed()

    def _wait(self, f: int, hi: int, done: bytearray) -> Generator[object, None, None]:
        """Until an op of the window f .. hi is ready: --local yields the first op's pending receive; a
        blocking transport polls, and fails past the timeout naming each instruction waited at."""
        if self.local_mode:
            pending = self._pending(f)
            yield pending[0][1] if pending else None
            return
        deadline = time.monotonic() + self.ex.timeout
        pause = POLL_MIN
        while True:
            time.sleep(pause)
            if any(not done[q] and self._ready(q, done) for q in range(f, hi)):
                return
            pause = min(2 * pause, POLL_MAX)
            if time.monotonic() > deadline:
                raise self._timeout(f, hi, done)

    def _timeout(self, f: int, hi: int, done: bytearray) -> CommError:
        ex = self.ex
        waits = []
        peer = -1
        for q in range(f, hi):
            if done[q]:
                continue
            j = self.comp[q]
            for k, v in self._pending(q):
                peer = v.peer if peer < 0 else peer
                waits.append(f"#{j} `{ex.instr(j)}` for {key_str(k)} from rank {v.peer}")
        what = "; ".join(waits) or "no message (its local inputs never came)"
        return CommError(
            f"rank {ex.rank}, step {ex.step + 1}: no op of its order family became ready in {ex.timeout:g} s, "
            f"waiting at {what}",
            peer if peer >= 0 else ex.rank,
        )
