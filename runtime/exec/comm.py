"""Point-to-point transfers with torch.distributed: gloo on CPU, NCCL on CUDA.

A message is keyed by (kind, micro-batch, sending stage), kind ACT or GRAD; in a Program with a stage
graph (pipec.ir.graph) by (kind, micro-batch, edge), the edge a pair (u, v) of stages: the activation of
u travels it to v, the gradient of that activation back from v to u (`edge_key`). Receives are posted into
their slots, allocated once per run (shapes come from the handshake, `pipec.runtime.exec.shapes`; which slot,
`pipec.runtime.exec.buffers`) and waited on just
before the compute that needs them; sends are non-blocking and completed before the optimizer step.
With gloo, each tensor's tag encodes the message key, so a receive can only match its own message;
NCCL matches by issue order, which the compiled Program makes equal on both ends of every pair.

The executor calls `wait` with `yield from`: here it blocks and never yields; the in-process
transport of `--local` mode (`pipec.runtime.local`) has the same interface and yields instead.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipec.ir.opcodes import ACT_MSG as ACT
from pipec.ir.opcodes import GRAD_MSG as GRAD
from pipec.ir.opcodes import MESSAGE_NOUNS as KIND
from pipec.runtime.errors import CommError
from pipec.runtime.exec.shapes import Specs

__all__ = ["ACT", "GRAD", "KIND"]  # the message kinds are the instruction table's
MAX_TENSORS = 16  # per message

Key = tuple[int, int, Any]  # (kind, micro-batch, sending stage); on a stage graph (kind, micro-batch, (u, v))


def edge_key(kind: int, mb: int, src: int, dst: int, graph: Any) -> Key:
    """The key of the message of edge (src, dst): on the chain (graph None) by its sending stage (src for an
    activation, dst for a gradient), as every chain Program names it; on a stage graph by the edge."""
    if graph is None:
        return (kind, mb, src if kind == ACT else dst)
    return (kind, mb, (src, dst))


def key_str(key: Key) -> str:
    kind, mb, stage = key
    if stage.__class__ is tuple:
        u, v = stage
        way = f"from stage {u} to stage {v}" if kind == ACT else f"from stage {v} back to stage {u}"
        return f"the {KIND[kind]} of micro-batch {mb} on edge {u} -> {v} ({way})"
    return f"the {KIND[kind]} of micro-batch {mb} from stage {stage}"


def short_error(e: BaseException, timeout: float) -> str:
    """One line from a backend error: gloo's prefixes ("[.../pair.cc:553] ") and advice cut off."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "timed out" in msg.lower() or "timeout" in msg.lower():
        return f"timed out after {timeout:g} s"
    msg = re.sub(r"^\[[^\]]*\]\s*", "", msg)
    return msg.split(". ")[0].rstrip(".")


class Recv:
    """A posted receive: its key, peer, buffers and pending works."""

    __slots__ = ("key", "peer", "tensors", "works")

    def __init__(self, key: Key, peer: int, tensors: tuple[torch.Tensor, ...], works: list) -> None:
        self.key, self.peer, self.tensors, self.works = key, peer, tensors, works


def _reverse_group(pg, timeout: timedelta):
    """A second gloo group over the same processes, created by its members only (one per DistComm, so
    that it goes when the DistComm does: a group that outlives `destroy_process_group` keeps its threads)."""
    ranks = [dist.get_global_rank(pg, r) for r in range(pg.size())]
    return dist.new_group(ranks, timeout=timeout, backend="gloo", use_local_synchronization=True)


class PeerNames:
    """How a transport names its peers: a Program's rank r is rank r of `group`, whose job rank torch's
    point-to-point calls take and messages show. Both transports (DistComm, shm.ShmComm) share it."""

    peers: list[int] | None = None  # per Program rank, its job rank (None: the same numbers)

    def set_group(self, group) -> None:
        self.peers = None if group is None else [dist.get_global_rank(group, r) for r in range(group.size())]

    def global_rank(self, rank: int) -> int:
        return rank if self.peers is None else self.peers[rank]

    def name(self, rank: int) -> str:
        """A peer in messages: the Program's rank, and the job's where they differ (a subgroup, a replica)."""
        g = self.global_rank(rank)
        return f"rank {rank}" if g == rank else f"rank {rank} (job rank {g})"


class DistComm(PeerNames):
    def __init__(
        self, num_stages: int, num_microbatches: int, device: torch.device, timeout: float, group=None
    ) -> None:
        self.S, self.m = num_stages, num_microbatches
        self.device = device
        self.group = group
        self.timeout = timedelta(seconds=timeout)
        self.blocking_wait = device.type == "cpu"  # gloo: wait with a timeout; NCCL: its watchdog times out
        self.sends: list[tuple[object, int, Key, tuple[torch.Tensor, ...]]] = []
        # gloo has no coalescing: a batched exchange is its sends and receives issued one by one. There the
        # process group is called directly (`pg.send` / `pg.recv`, what `dist.isend` / `dist.irecv` end in),
        # skipping torch.distributed's per-call Python (P2POp objects, group lookups, argument checks): tens
        # of microseconds per message. Peers are ranks of `group` (the Program's ranks).
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        self.pg = pg if device.type == "cpu" and dist.get_backend(pg) == "gloo" else None
        self.set_group(group)  # torch.distributed's P2POp names its peer by global rank
        # gloo: messages to a higher rank go over `pg`, to a lower rank over a second group, so no connection
        # carries data both ways. On one connection, a send from the main thread and the arrival of the
        # peer's message contend for the connection's lock; gloo's thread then leaves the arrival for its
        # next wake-up, which held both ranks of a 1F1B exchange idle for 1 to 9 ms (a few times a step).
        self.rank = pg.rank()
        # the receive buffers (pipec.runtime.exec.buffers.Slots), set by the executor after each shape exchange
        self.slots: Any = None
        self.pg_down = _reverse_group(pg, self.timeout) if self.pg is not None and pg.size() > 1 else self.pg

    @property
    def one_by_one(self) -> bool:
        """gloo issues a batched exchange's transfers one by one: the executor may hand them over singly."""
        return self.pg is not None

    def tag(self, key: Key, j: int) -> int:
        kind, mb, stage = key
        if stage.__class__ is tuple:  # an edge (u, v) of a stage graph
            stage = stage[0] * self.S + stage[1]
            return (((kind * self.S * self.S) + stage) * self.m + mb) * MAX_TENSORS + j
        return (((kind * self.S) + stage) * self.m + mb) * MAX_TENSORS + j

    def _recv_ops(self, key: Key, peer: int, specs: Specs) -> tuple[tuple[torch.Tensor, ...], list]:
        slots = self.slots
        bufs = slots.get(key, specs) if slots is not None else tuple(s.empty(self.device) for s in specs)
        if self.pg is not None:
            pg = self.pg if peer < self.rank else self.pg_down
            return bufs, [(pg, False, b, peer, self.tag(key, j)) for j, b in enumerate(bufs)]
        g = self.global_rank(peer)
        ops = [dist.P2POp(dist.irecv, b, g, self.group, self.tag(key, j)) for j, b in enumerate(bufs)]
        return bufs, ops

    def _send_ops(self, key: Key, peer: int, tensors: tuple[torch.Tensor, ...]) -> list:
        if self.pg is not None:
            pg = self.pg if peer > self.rank else self.pg_down
            return [(pg, True, t.contiguous(), peer, self.tag(key, j)) for j, t in enumerate(tensors)]
        g = self.global_rank(peer)
        return [dist.P2POp(dist.isend, t.contiguous(), g, self.group, self.tag(key, j)) for j, t in enumerate(tensors)]

    def post(self, key: Key, peer: int, specs: Specs) -> Recv:
        bufs, ops = self._recv_ops(key, peer, specs)
        return Recv(key, peer, bufs, self._start(ops, peer, key))

    def send(self, key: Key, peer: int, tensors: tuple[torch.Tensor, ...]) -> None:
        ops = self._send_ops(key, peer, tensors)
        for w in self._start(ops, peer, key):
            self.sends.append((w, peer, key, tensors))

    def exchange(self, items: list[tuple[str, Key, int, object]]) -> list[Recv | None]:
        """One batched exchange (`batch_isend_irecv`): items are ("send", key, peer, tensors) or
        ("recv", key, peer, specs); returns a Recv for each receive, None for each send."""
        ops: list = []
        spans = []
        for what, key, peer, x in items:
            if what == "send":
                new = self._send_ops(key, peer, x)
                spans.append((what, key, peer, x, None, len(ops), len(ops) + len(new)))
            else:
                bufs, new = self._recv_ops(key, peer, x)
                spans.append((what, key, peer, x, bufs, len(ops), len(ops) + len(new)))
            ops += new
        try:
            works = self._issue(ops) if self.pg is not None else dist.batch_isend_irecv(ops)
        except Exception as e:
            who = self.name(items[0][2])
            raise CommError(f"could not start the exchange with {who}: {e}", items[0][2]) from e
        coalesced = len(works) != len(ops)  # NCCL returns one work for the whole group
        out: list[Recv | None] = []
        for what, key, peer, x, bufs, a, b in spans:
            mine = works if coalesced else works[a:b]
            if what == "send":
                for w in mine:
                    self.sends.append((w, peer, key, x))
                out.append(None)
            else:
                out.append(Recv(key, peer, bufs, list(mine)))
        return out

    def _issue(self, ops: list[tuple[Any, bool, torch.Tensor, int, int]]) -> list:
        return [pg.send([t], peer, tag) if is_send else pg.recv([t], peer, tag) for pg, is_send, t, peer, tag in ops]

    def _start(self, ops: list, peer: int, key: Key) -> list:
        try:
            if self.pg is not None:
                return self._issue(ops)
            works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
        except Exception as e:
            raise CommError(f"could not start the transfer of {key_str(key)} with {self.name(peer)}: {e}", peer) from e
        return [w for w in works if w is not None]

    def _wait(self, work, peer: int, key: Key, sending: bool) -> None:
        try:
            if self.blocking_wait:
                work.wait(self.timeout)
            else:
                work.wait()
        except Exception as e:  # the message is made here only: a wait is on the hot path of every step
            what = f"sending {key_str(key)} to" if sending else f"receiving {key_str(key)} from"
            why = short_error(e, self.timeout.total_seconds())
            raise CommError(f"{what} {self.name(peer)} failed: {why}", peer) from e

    def wait(self, recv: Recv) -> Generator[object, None, tuple[torch.Tensor, ...]]:
        return self.take(recv)
        yield  # a generator that never yields

    def take(self, recv: Recv) -> tuple[torch.Tensor, ...]:
        """`wait` as a plain call: the executor's loop takes messages this way from a blocking transport."""
        for w in recv.works:
            self._wait(w, recv.peer, recv.key, False)
        return recv.tensors

    def finish_sends(self) -> None:
        sends, self.sends = self.sends, []
        seen = set()
        for w, peer, key, _ in sends:
            if id(w) not in seen:
                seen.add(id(w))
                self._wait(w, peer, key, True)
