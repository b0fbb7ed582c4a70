"""Point-to-point transfers between the ranks of one host through shared memory (CPU tensors).

Why: on gloo a send costs the calling thread about 57 us and posting a receive about 43 us (TCP over
loopback, a rendezvous per message); on the empty model that is most of pipec's main-thread CPU per
instruction. Here a send is a copy into shared memory and a counter store, a receive a copy out.

Layout: per directed channel (src -> dst) one segment in /dev/shm, created by the receiver. Every
message the channel can carry, (kind, micro-batch, sending stage) for every stage pair of the placement
whose sender is on src and receiver on dst, has its own slot sized from the shape handshake's specs
(`prepare`), so a message is found by its key, never by order. A slot holds one message at a time: its
two counters (`written`, `read`) say how often it was filled and emptied; a sender that finds the
previous message of that key unread waits (with the run's timeout) for it. That wait cannot deadlock:
a slot's previous occupant is the same key of an earlier step, and the ranks in the earliest step never
wait on a send (everything of the step before has been read), so they progress as the Program does.

Poll first: a reader whose message has not arrived looks again for up to `POLL` seconds before it sleeps
(`PIPEC_SHM_POLL_US` sets it, 0: sleep at once). A sleep costs the reader its futex calls and the cold
caches after it, and its wake-up costs the sender a FUTEX_WAKE (on a virtual machine, an interrupt to a
halted CPU): more than most waits of a small model's pipeline last. A polled message is seen at once, and
its sender, finding no sleeper, wakes nobody. The poll yields the CPU between looks (`sched_yield`): where
the rank it waits for shares its CPU (more ranks than CPUs, or two ranks the scheduler put on one CPU,
which a wake-up tends to do) that rank runs at once; where nothing else wants the CPU, the yield returns at
once. `benchmarks/executor_profile.py --polls` and `benchmarks/runtime_vs_torch.py --only-dispatch`
measure it beside sleeping at once (docs/runtime.md "Poll first").

Notify: a reader whose message has not arrived sets the channel's `sleeping` word and sleeps on the
channel's futex word (FUTEX_WAIT with the value it read, in slices of `TICK` seconds up to the timeout);
a sender bumps that word after every message and, when it sees `sleeping` set, wakes the reader
(FUTEX_WAKE). The kernel compares the word before sleeping, so a message sent after the reader's look is
not slept through; only when both sides read the other's old `sleeping` at once (the check is not
fenced) does the reader wake at its next tick. Each channel also has a FIFO from the sender that nothing
is written to: the sender holds its only write end, so a sender that exits or dies hangs it up, and the
reader, polling it at every tick, fails at once with a named-rank CommError, not at the timeout. x86-64
only: the data-before-counter order relies on its store ordering (and the futex call number is its).

Names: the receiver publishes its segment's and FIFO's names through the job's store; the sender opens
both and acknowledges; the receiver then unlinks both names. From then on nothing is left in /dev/shm
whatever way the processes end; before it, a failed set-up unlinks what it made.

A re-run of the handshake (variable shapes, an evaluation pass's own Program) that changes a channel's
slots makes a new segment for it (a new generation), between steps, when every earlier message is read.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import platform
import re
import secrets
import select
import socket
import time
from collections.abc import Generator
from datetime import timedelta
from typing import Any

import torch

from pipec.ir.program import Program
from pipec.runtime.errors import CommError, PipelineError
from pipec.runtime.exec.comm import ACT, GRAD, Key, PeerNames, Recv, key_str, short_error
from pipec.runtime.exec.shapes import Specs

_syscall = ctypes.CDLL(None, use_errno=True).syscall


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_TICK = ctypes.byref(_Timespec(0, 10_000_000))  # TICK
DIR = "/dev/shm"
TICK = 0.01  # seconds a blocked reader sleeps before looking again (a missed wake-up costs at most this)
POLL = 50e-6  # seconds a reader polls for its message before it sleeps (the module docstring's "Poll first")
ALIGN = 64
HEADER = 16  # int64 words before the slots' counters: [layout hash, slots, .., sleeping at word 8, futex word 12]
SLEEPING = 8
WAKE = 24  # the futex word, as an int32 index (int64 word 12): bumped by every message, waited on by the reader
SYS_FUTEX, FUTEX_WAIT, FUTEX_WAKE = 202, 0, 1  # x86-64 Linux
CHOICES = ("auto", "gloo", "shm")


def poll_seconds() -> float:
    """How long a reader polls before sleeping: `PIPEC_SHM_POLL_US` (microseconds) when set, else `POLL`."""
    text = os.environ.get("PIPEC_SHM_POLL_US")
    if text is None:
        return POLL
    try:
        us = float(text)
    except ValueError:
        raise PipelineError(f"PIPEC_SHM_POLL_US must be a number of microseconds, got {text!r}") from None
    if not 0 <= us <= 1e6:
        raise PipelineError(f"PIPEC_SHM_POLL_US must be between 0 and 1000000 microseconds, got {text}")
    return us * 1e-6


def channel_keys(placement: tuple[int, ...], num_microbatches: int, src: int, dst: int, graph: Any = None) -> list[Key]:
    """Every message rank `src` may send rank `dst`, in one order both ends compute: activations of each
    stage s on src whose next stage is on dst, gradients of each stage s on src whose previous is on dst.
    On a stage graph, per edge (u, v) in edge order: its activations when u is on src and v on dst, its
    gradients when v is on src and u on dst."""
    if graph is not None:
        out: list[Key] = []
        for u, v in graph.edges:
            if placement[u] == src and placement[v] == dst:
                out += [(ACT, mb, (u, v)) for mb in range(num_microbatches)]
            if placement[v] == src and placement[u] == dst:
                out += [(GRAD, mb, (u, v)) for mb in range(num_microbatches)]
        return out
    S = len(placement)
    keys: list[Key] = []
    for s in range(S):
        if placement[s] != src:
            continue
        if s + 1 < S and placement[s + 1] == dst:
            keys += [(ACT, mb, s) for mb in range(num_microbatches)]
        if s > 0 and placement[s - 1] == dst:
            keys += [(GRAD, mb, s) for mb in range(num_microbatches)]
    return keys


def _nbytes(spec: Any) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


def _layout(keys: list[Key], specs: dict[Key, Specs]) -> tuple[list[int], int]:
    """Each key's slot offset in the segment, and the segment's size (counters first, slots 64-byte aligned)."""
    at = _up((HEADER + 2 * len(keys)) * 8)
    offsets = []
    for key in keys:
        offsets.append(at)
        at += sum(_up(_nbytes(s)) for s in specs.get(key, ()))
    return offsets, max(at, ALIGN)


def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _hash(keys: list[Key], specs: dict[Key, Specs]) -> int:
    """Both ends' view of the layout, compared at attach (a disagreement is a bug, said, never a corruption)."""
    text = repr([(k, [(s.shape, str(s.dtype)) for s in specs.get(k, ())]) for k in keys])
    h = 1469598103934665603
    for b in text.encode():
        h = ((h ^ b) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h


class Channel:
    """One direction between two ranks: the mapped segment, its counters, each slot's tensors, the FIFO."""

    __slots__ = (
        "peer",
        "keys",
        "index",
        "mm",
        "ctrl",
        "word",
        "addr",
        "views",
        "fd",
        "poller",
        "count",
        "gen",
        "specs",
    )

    def __init__(self, peer: int, keys: list[Key], specs: dict[Key, Specs], gen: int) -> None:
        self.peer, self.keys, self.gen = peer, keys, gen
        self.index = {k: i for i, k in enumerate(keys)}
        self.specs = {k: specs[k] for k in keys if k in specs}
        self.mm: mmap.mmap | None = None
        self.ctrl: Any = None
        self.views: list[tuple[torch.Tensor, ...]] = []
        self.fd = -1
        self.poller: Any = None
        self.count = [0] * len(keys)  # per slot: messages written (sender) or posted (receiver) so far

    def map(self, fd: int, size: int) -> None:
        self.mm = mmap.mmap(fd, size)
        self.ctrl = memoryview(self.mm)[: (HEADER + 2 * len(self.keys)) * 8].cast("q")
        self.word = memoryview(self.mm)[: HEADER * 8].cast("i")
        self.addr = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(self.mm)) + 4 * WAKE)
        offsets, _ = _layout(self.keys, self.specs)
        views = []
        for key, at in zip(self.keys, offsets):
            ts = []
            for s in self.specs.get(key, ()):
                numel = math.prod(s.shape)
                if numel:
                    ts.append(torch.frombuffer(self.mm, dtype=s.dtype, count=numel, offset=at).view(s.shape))
                else:
                    ts.append(torch.empty(s.shape, dtype=s.dtype))
                at += _up(numel * s.dtype.itemsize)
            views.append(tuple(ts))
        self.views = views

    def close(self) -> None:
        self.views = []
        if self.ctrl is not None:
            self.ctrl.release()
            self.word.release()
            self.ctrl = self.word = self.addr = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a tensor still views it: it goes with the last view
                pass
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ShmRecv(Recv):
    """A posted receive on shared memory: its channel, slot and the count its message will bring."""

    __slots__ = ("chan", "slot", "want")


def host_id() -> str:
    """This machine, as two processes on it agree and two machines do not: host name and boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def supported() -> str | None:
    """Why this machine cannot use the transport (None: it can)."""
    if not platform.system() == "Linux" or not os.path.isdir(DIR):
        return f"it needs Linux and {DIR}"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"it relies on x86-64's store order, and this is {platform.machine()}"
    return None


def choose(kind: str, device: torch.device, emulated: bool, store: Any, rank: int, world: int, timeout: float) -> str:
    """The point-to-point transport of a pipeline: "shm" when every rank is on this host and tensors are on
    the CPU (and links are not emulated), else "gloo" (CUDA: NCCL, through DistComm). `kind` "gloo" or
    "shm" forces one; forcing shm where it cannot work is a CommError. Every rank publishes its host
    under the store and reads the others', so all ranks decide alike."""
    if kind not in CHOICES:
        raise ValueError(f"transport must be one of {', '.join(CHOICES)}, got {kind!r}")
    if kind == "gloo":
        return "gloo"
    why = supported()
    if why is None and device.type != "cpu":
        why = f"its tensors are on {device.type}, not the CPU"
    if why is None and emulated:
        why = "emulated links hold messages back on the gloo path"
    if why is None and world > 1:
        me = host_id()
        store.set(f"shm/host/{rank}", me)
        for r in range(world):
            if r == rank:
                continue
            try:
                store.wait([f"shm/host/{r}"], timedelta(seconds=timeout))
                theirs = store.get(f"shm/host/{r}").decode()
            except Exception as e:
                raise CommError(f"reading rank {r}'s host: {str(e).splitlines()[0]}", r) from e
            if theirs != me:
                why = f"rank {r} is on another host"
                break
    if why is None:
        return "shm"
    if kind == "shm":
        raise CommError(f"--transport shm: the shared-memory transport cannot be used here: {why}", rank)
    return "gloo"


LEFTOVER = re.compile(r"pipec-(\d+)-[0-9a-f]+-\d+to\d+-g\d+(\.fifo)?")


def sweep_leftovers(folder: str = DIR) -> list[str]:
    """Remove the segments and FIFOs that processes which no longer exist left in `folder`; the names
    removed. A rank killed between making its channel and its peer attaching (a fault at start-up, a
    launcher ending the others at once) cannot unlink what it made; the creator's PID in each name lets
    the next job on the host, and `pipec run` when its job ends, find what is stale. A live process's
    (this job's, another job's, or a reused PID's) is left alone."""
    gone = []
    try:
        names = os.listdir(folder)
    except OSError:
        return gone
    for name in names:
        m = LEFTOVER.fullmatch(name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            gone.append(name)
        except OSError:
            pass  # another sweeper took it, or it is not ours to remove
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


class ShmComm(PeerNames):
    """The DistComm interface (post, send, exchange, wait, finish_sends) over shared memory, for the ranks of
    one pipeline on one host. `prepare` (called by the executor after each shape handshake) sizes the slots."""

    pg = None  # not gloo's process group: receives need no posting ahead
    one_by_one = True  # an exchange is its transfers in any order: the executor hands them over singly

    def __init__(self, program: Program, rank: int, timeout: float, group: Any, store: Any) -> None:
        self.program, self.rank, self.timeout, self.group, self.store = program, rank, timeout, group, store
        sweep_leftovers()  # what earlier jobs' killed ranks could not remove
        self.set_group(group)
        place, m = program.placement, program.num_microbatches
        others = sorted({r for r in place if r != rank})
        g = program.graph
        self.incoming = {p: Channel(p, channel_keys(place, m, p, rank, g), {}, -1) for p in others}
        self.outgoing = {p: Channel(p, channel_keys(place, m, rank, p, g), {}, -1) for p in others}
        self.incoming = {p: c for p, c in self.incoming.items() if c.keys}
        self.outgoing = {p: c for p, c in self.outgoing.items() if c.keys}
        self.recv_specs: dict[Key, Specs] = {}
        self.send_specs: dict[Key, Specs] = {}
        self.links = None
        self.slots: Any = None  # the receive buffers (pipec.runtime.exec.buffers.Slots), set by the executor
        self.sends: list = []  # completed in the call: nothing is ever pending
        self.poll = poll_seconds()

    # ---- set-up -------------------------------------------------------------------------------------
    def prepare(self, recv_specs: dict[Key, Specs], send_specs: dict[Key, Specs]) -> None:
        """(Re)build every channel whose slots the specs change: create the incoming segments, attach the
        outgoing ones, then unlink the names once each sender has attached. Both ends see the same specs
        (the handshake's), so both rebuild the same channels under the same generation."""
        self.recv_specs = {**self.recv_specs, **recv_specs}
        self.send_specs = {**self.send_specs, **send_specs}
        made: list[tuple[Channel, str, str]] = []
        try:
            for p, ch in self.incoming.items():
                if self._changed(ch, self.recv_specs):
                    self.incoming[p] = new = Channel(p, ch.keys, self.recv_specs, ch.gen + 1)
                    ch.close()
                    made.append((new, *self._create(new, p, self.rank)))
            for p, ch in self.outgoing.items():
                if self._changed(ch, self.send_specs):
                    self.outgoing[p] = new = Channel(p, ch.keys, self.send_specs, ch.gen + 1)
                    ch.close()
                    self._attach(new, self.rank, p)
            for ch, path, fifo in made:
                key = self._skey(ch.peer, self.rank, ch.gen)
                self._wait_key(key + "/ok", ch.peer, "to attach the shared-memory channel")
                for name in (path, fifo):
                    os.unlink(name)
                for k in (key, key + "/ok"):  # read by both ends: the store needs them no more
                    self.store.delete_key(k)
            made = []
        finally:
            for _, path, fifo in made:  # a failed set-up leaves nothing behind
                for name in (path, fifo):
                    try:
                        os.unlink(name)
                    except FileNotFoundError:
                        pass

    @staticmethod
    def _changed(ch: Channel, specs: dict[Key, Specs]) -> bool:
        return ch.gen < 0 or any(specs.get(k) != ch.specs.get(k) for k in ch.keys)

    def _skey(self, src: int, dst: int, gen: int) -> str:
        return f"shm/{src}>{dst}/{gen}"

    def _wait_key(self, key: str, peer: int, what: str) -> str:
        try:
            self.store.wait([key], timedelta(seconds=self.timeout))
            value = self.store.get(key)
        except Exception as e:
            why = short_error(e, self.timeout)
            raise CommError(f"waiting for {self.name(peer)} {what}: {why}", peer) from e
        return value.decode() if isinstance(value, bytes) else value

    def _create(self, ch: Channel, src: int, dst: int) -> tuple[str, str]:
        offsets, size = _layout(ch.keys, ch.specs)
        base = f"pipec-{os.getpid()}-{secrets.token_hex(4)}-{src}to{dst}-g{ch.gen}"
        path, fifo = os.path.join(DIR, base), os.path.join(DIR, base + ".fifo")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # no space in /dev/shm is an error now, not a SIGBUS later
            ch.map(fd, size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            who = self.name(src)
            raise CommError(f"could not make the {size}-byte shared-memory channel from {who}: {e}", src) from e
        os.close(fd)
        ch.ctrl[0], ch.ctrl[1] = _hash(ch.keys, ch.specs), len(ch.keys)
        try:
            os.mkfifo(fifo, 0o600)
            ch.fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            os.unlink(path)
            raise
        ch.poller = select.poll()
        ch.poller.register(ch.fd, select.POLLIN)
        self.store.set(self._skey(src, dst, ch.gen), base)
        return path, fifo

    def _attach(self, ch: Channel, src: int, dst: int) -> None:
        key = self._skey(src, dst, ch.gen)
        base = self._wait_key(key, dst, "to make the shared-memory channel")
        path = os.path.join(DIR, base)
        _, size = _layout(ch.keys, ch.specs)
        fd = os.open(path, os.O_RDWR)
        try:
            ch.map(fd, size)
        finally:
            os.close(fd)
        if ch.ctrl[0] != _hash(ch.keys, ch.specs) or ch.ctrl[1] != len(ch.keys):
            raise CommError(f"the shared-memory channel to {self.name(dst)} has another layout than this rank's", dst)
        ch.fd = os.open(path + ".fifo", os.O_WRONLY | os.O_NONBLOCK)
        self.store.set(key + "/ok", "1")

    def close(self) -> None:
        for ch in (*self.incoming.values(), *self.outgoing.values()):
            ch.close()

    # ---- the hot path -------------------------------------------------------------------------------
    def post(self, key: Key, peer: int, specs: Specs) -> Recv:
        ch = self.incoming[peer]
        i = ch.index[key]
        slots = self.slots
        bufs = slots.get(key, specs) if slots is not None else tuple(s.empty(torch.device("cpu")) for s in specs)
        r = ShmRecv(key, peer, bufs, None)
        r.chan, r.slot = ch, i
        r.want = ch.count[i] = ch.count[i] + 1
        return r

    def send(self, key: Key, peer: int, tensors: tuple[torch.Tensor, ...]) -> None:
        ch = self.outgoing[peer]
        i = ch.index[key]
        n = ch.count[i]
        ctrl = ch.ctrl
        at = HEADER + 2 * i
        if ctrl[at + 1] < n:  # the previous message of this key is not read yet
            self._wait_read(ch, at, n, key)
        views = ch.views[i]
        if len(views) == 1:
            views[0].copy_(tensors[0])
        else:
            for v, t in zip(views, tensors):
                v.copy_(t)
        ctrl[at] = ch.count[i] = n + 1
        word = ch.word
        word[WAKE] = (word[WAKE] + 1) & 0x3FFFFFFF
        if ctrl[SLEEPING]:
            _syscall(SYS_FUTEX, ch.addr, FUTEX_WAKE, 1, None, None, 0)

    def exchange(self, items: list[tuple[str, Key, int, Any]]) -> list[Recv | None]:
        return [self.send(key, peer, x) if what == "send" else self.post(key, peer, x) for what, key, peer, x in items]

    def wait(self, recv: Recv) -> Generator[object, None, tuple[torch.Tensor, ...]]:
        return self.take(recv)
        yield  # a generator that never yields

    def take(self, recv: Recv) -> tuple[torch.Tensor, ...]:
        """The message of a posted receive, copied out of the channel's slot into the receive's buffers (its
        slot of pipec.runtime.exec.buffers), blocking until it is there."""
        ch, i, n = recv.chan, recv.slot, recv.want
        at = HEADER + 2 * i
        ctrl = ch.ctrl
        if ctrl[at] < n:
            self._block(ch, at, n, recv)
        views, out = ch.views[i], recv.tensors
        if len(views) == 1:
            out[0].copy_(views[0])
        else:
            for b, v in zip(out, views):
                b.copy_(v)
        ctrl[at + 1] = n
        return out

    def finish_sends(self) -> None:
        """Every send completed in its call (the data is in the peer's segment)."""

    # ---- waiting ------------------------------------------------------------------------------------
    def _block(self, ch: Channel, at: int, n: int, recv: Recv) -> None:
        """Sleep on the channel's futex word until the message is there: the kernel compares the word
        with the value read before sleeping, so a message sent in between is not slept through. Every
        `TICK` the FIFO is polled for a hang-up: a sender that died holds it no more."""
        ctrl, word, addr = ch.ctrl, ch.word, ch.addr
        if self.poll:  # the module docstring's "Poll first"
            clock, yield_cpu = time.perf_counter, os.sched_yield
            end = clock() + self.poll
            while ctrl[at] < n:
                yield_cpu()
                if clock() > end:
                    break
            else:
                return
        deadline = time.monotonic() + self.timeout
        ctrl[SLEEPING] = 1
        try:
            while ctrl[at] < n:
                seen = word[WAKE]
                if ctrl[at] >= n:
                    break
                if _syscall(SYS_FUTEX, addr, FUTEX_WAIT, seen, _TICK, None, 0) == 0 or ctrl[at] >= n:
                    continue  # woken (or the word had changed): look again
                if time.monotonic() > deadline:
                    raise CommError(
                        f"receiving {key_str(recv.key)} from {self.name(recv.peer)} failed: timed out after "
                        f"{self.timeout:g} s",
                        recv.peer,
                    )
                if ch.poller.poll(0):  # the sender never writes the FIFO: an event is its hang-up
                    raise CommError(
                        f"receiving {key_str(recv.key)} from {self.name(recv.peer)} failed: the peer closed "
                        "its end of the shared-memory channel (it exited or died)",
                        recv.peer,
                    )
        finally:
            ctrl[SLEEPING] = 0

    def _wait_read(self, ch: Channel, at: int, n: int, key: Key) -> None:
        deadline = time.monotonic() + self.timeout
        pause = 1e-5
        while ch.ctrl[at + 1] < n:
            if time.monotonic() > deadline:
                raise CommError(
                    f"sending {key_str(key)} to {self.name(ch.peer)} failed: timed out after {self.timeout:g} s "
                    "(its previous message of this key was never read)",
                    ch.peer,
                )
            time.sleep(pause)
            pause = min(2 * pause, TICK)
