"""Receive buffers allocated once (issue 43, part 2): a pool of slots per message class, every receive landing
in its slot, no new receive buffer after the first step.

A class is a message's specs (its tensors' shapes and dtypes, from the shape handshake); its pool holds as
many slots as the most messages of that class alive at once on this rank, each slot its tensors allocated
once. Which slot a received message takes comes from, in this order:

1. the compiler's buffer plan (`Program.buffers`, pipec.passes.bufferplan): the `input` and `grad` tensors
   that this rank receives, each slot what the plan says, a bank's slots shared by its classes. The plan's
   rule (`bufferplan.lifetimes`) is the runtime's: a receive is born where the transport posts it (the
   plan's `ahead`; gloo posts `recv_ahead` receives early) and, with split backward, a received gradient
   lives until W (the runtime's B keeps it: W's captured gradients can be that very tensor, and the first
   stage defers its whole backward to W). A Program's own plan is taken when it was made for at least this
   run's `recv_ahead`; else (no plan carried, or one for fewer receives ahead) the same pass's rule is run
   here for this run's `recv_ahead`, its banks joining the classes whose handshake shapes agree (the
   colouring needs no sizes). A carried plan whose bank joins messages of different shapes is planned again
   that way too. Either way the slots are checked against the runtime's own lifetimes below; where they
   do not hold (token slices: the runtime keeps a sequence's receives to the step's end), the reason is
   said (`note`) and
2. the runtime's own lifetime colouring is used: a message lives from the moment its receive is posted (a
   receive posted `ahead` receives early is born at the receive that many before it) to the last compute of
   its (micro-batch, consuming stage) on this rank (FWD, RECOMPUTE, BWD, WGRAD; with token slices to the end
   of the step: the key/value cache of a sequence spans its slices), slots reused greedily by birth.

Handed out, a slot's tensors are fresh aliases (`detach`: a new tensor object on the slot's storage, no
new memory), so a stage's `requires_grad_` and the input gradient accumulated on a leaf never carry over
from the slot's previous message. A stage's output that is its input (an identity stage, a view) would
outlive the slot: `unaliased` copies such outputs before they leave (sent, handed on, returned).

Shapes that change between steps (a batch given as micro-batches, pipec.runtime.exec.microbatch) are
exchanged again; there the runtime allocates a buffer per message (`Slots.fixed` False) and says so. The
all-to-all buffers of expert parallelism (data-dependent token counts) are not receive buffers of this
pool: allocated per call (pipec.runtime.exec.alltoall).

`Slots.made` counts every receive-buffer tensor created (the pools' and any per-message fallback), the
figure `tests/runtime/test_buffers.py` holds at zero after the first step.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipec.ir.opcodes import ACT_MSG as ACT
from pipec.ir.opcodes import BWD, FWD, RECOMPUTE, WGRAD
from pipec.ir.opcodes import GRAD_MSG as GRAD
from pipec.runtime.exec.shapes import Specs

_COMPUTES = (FWD, RECOMPUTE, BWD, WGRAD)


class Slots:
    """One rank's receive buffers: `get(key, specs)` gives the message's slot (aliases of its tensors), or, for
    a message without a slot or whose specs differ from its slot's, new tensors (counted in `made`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.of: dict[Any, tuple[Specs, tuple[torch.Tensor, ...]]] = {}
        self.made = 0  # receive-buffer tensors created so far
        self.fixed = False  # slots assigned (False: a buffer per message)
        self.source = ""  # "plan" (the compiler's buffer plan) or "runtime" (the runtime's own lifetimes)
        self.note = "a buffer per message"  # how the buffers are made, for the run's output
        self.pools = 0
        self.slots = 0
        self.nbytes = 0
        self.starts: list[int] = []  # the slot tensors' start and end addresses, sorted, for `unaliased`
        self.ends: list[int] = []

    def get(self, key: Any, specs: Specs) -> tuple[torch.Tensor, ...]:
        hit = self.of.get(key)
        if hit is not None and (hit[0] is specs or hit[0] == specs):
            b = hit[1]
            return (b[0].detach(),) if len(b) == 1 else tuple(t.detach() for t in b)
        self.made += len(specs)
        return tuple(s.empty(self.device) for s in specs)

    def assign(self, keys: Sequence[Any], specs: dict[Any, Specs], slot_of: dict[Any, tuple[Any, int]]) -> None:
        """Allocate every (pool, slot) once and give each key its slot (`slot_of`: key -> (pool, slot))."""
        made: dict[tuple[Any, int], tuple[torch.Tensor, ...]] = {}
        self.of = {}
        for key in keys:
            where = slot_of[key]
            bufs = made.get(where)
            if bufs is None:
                bufs = made[where] = tuple(s.empty(self.device) for s in specs[key])
                self.made += len(bufs)
            self.of[key] = (specs[key], bufs)
        self.fixed = True
        self.pools = len({p for p, _ in made})
        self.slots = len(made)
        self.nbytes = sum(t.numel() * t.element_size() for bufs in made.values() for t in bufs)
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for b in made.values() for t in b)
        self.starts, self.ends = [a for a, _ in spans], [b for _, b in spans]

    def describe(self) -> str:
        if not self.fixed:
            return self.note
        what = "the compiler's buffer plan" if self.source == "plan" else "the runtime's lifetimes"
        plural = lambda n, w: f"{n} {w}" + ("" if n == 1 else "s")  # noqa: E731
        text = f"{plural(self.slots, 'slot')} in {plural(self.pools, 'pool')}, {self.nbytes} bytes, by {what}"
        return text + (f" ({self.note})" if self.note else "")

    def on_slot(self, t: torch.Tensor) -> bool:
        a = t.data_ptr()
        i = bisect_right(self.starts, a) - 1
        return i >= 0 and a < self.ends[i]

    def unaliased(self, tensors: Any) -> Any:
        """`tensors` (a message: a tuple of tensors) with any tensor on a slot's memory copied off it."""
        on = self.on_slot
        for t in tensors:
            if on(t):
                return tuple(x.clone() if on(x) else x for x in tensors)
        return tensors


def lifetimes(
    instrs: Sequence[tuple[int, int, int, int, int]],
    recvs: Sequence[int],
    tkeys: Sequence[Any],
    consumer: dict[Any, int],
    ahead: int,
    whole_step: bool,
) -> dict[Any, tuple[int, int]]:
    """Per received key, (birth, death) in instruction positions under the runtime's rule (the docstring)."""
    last: dict[tuple[int, int], int] = {}
    for j, (op, mb, s, _, _) in enumerate(instrs):
        if op in _COMPUTES:
            last[(mb, s)] = j
    n = len(instrs)
    out = {}
    for k, j in enumerate(recvs):
        key = tkeys[j]
        birth = recvs[k - ahead] if k >= ahead else -1
        death = n if whole_step else last.get((key[1], consumer[key]), n)
        out[key] = (birth, death)
    return out


def colour(life: dict[Any, tuple[int, int]], cls: dict[Any, Any]) -> dict[Any, tuple[Any, int]]:
    """Greedy interval colouring by birth per class: key -> (class, slot), the lowest free slot first."""
    busy: dict[Any, list[tuple[int, int]]] = {}
    free: dict[Any, list[int]] = {}
    count: dict[Any, int] = {}
    out = {}
    for key, (a, b) in sorted(life.items(), key=lambda kv: kv[1]):
        c = cls[key]
        q, f = busy.setdefault(c, []), free.setdefault(c, [])
        while q and q[0][0] < a:
            heapq.heappush(f, heapq.heappop(q)[1])
        if f:
            s = heapq.heappop(f)
        else:
            s = count.get(c, 0)
            count[c] = s + 1
        heapq.heappush(q, (b, s))
        out[key] = (c, s)
    return out


def clash(life: dict[Any, tuple[int, int]], slot_of: dict[Any, tuple[Any, int]]) -> tuple[Any, Any] | None:
    """Two keys sharing a slot while both live under `life`, or None."""
    by: dict[tuple[Any, int], list[Any]] = {}
    for key, where in slot_of.items():
        by.setdefault(where, []).append(key)
    for keys in by.values():
        keys.sort(key=lambda k: life[k])
        for a, b in zip(keys, keys[1:]):
            if life[a][1] >= life[b][0]:
                return a, b
    return None


def plan_slots(
    program: Any, rank: int, specs: dict[Any, Specs], edge_key: Any, ahead: int = 0
) -> tuple[dict[Any, tuple[Any, int]], str] | None:
    """The compiler's buffer plan for this rank's received messages (`specs`: key -> its specs), and how it was
    had ("": the Program's own): key -> (the slots it shares: a bank, else its class; slot). None when a
    received key has no tensor in the plan."""
    from pipec.passes import bufferplan

    plan = getattr(program, "buffers", None)
    if plan is not None and plan.ahead >= ahead:
        rp = plan.ranks[rank]
        space = [("bank", p.bank) if p.bank >= 0 else p.key for p in rp.pools]
        out = _received(program, [p.key for p in rp.pools], rp.pool, rp.mb, rp.slot, space, specs, edge_key)
        if out is None or all(specs[a] == specs[b] for a, b in _same_pool(out)):
            return None if out is None else (out, "")
        note = "the Program's plan shares slots between messages of different shapes here: planned again by its rule"
    elif plan is not None:
        note = f"the Program's plan is for receives posted {plan.ahead} ahead: planned again by its rule for {ahead}"
    else:
        note = ""
    life = bufferplan.lifetimes(program, rank, ahead)
    keys = list(life.keys)
    first = _received(program, keys, life.pool, life.mb, np.zeros(len(life.pool), np.int64), keys, specs, edge_key)
    if first is None:
        return None
    shape: dict[Any, Any] = {}
    for key, (k, _) in first.items():
        if shape.setdefault(k, specs[key]) != specs[key]:
            shape[k] = ("mixed", k)  # a class of several shapes: its own slots (then refused below)
    bank = bufferplan.banks(life.keys, lambda k: shape.get(k, ("own", k)))
    slot, _ = bufferplan.colour(life, bank)
    space = [("bank", int(b)) for b in bank.tolist()]
    out = _received(program, keys, life.pool, life.mb, slot, space, specs, edge_key)
    return None if out is None else (out, note)


def _received(program, keys, pool, mb, slot, space, specs, edge_key) -> dict[Any, tuple[Any, int]] | None:
    """Per received key (those of `specs`), its first device tensor's (space, slot) of the plan's columns (the
    one its receive lands in); None unless every received key has one."""
    from pipec.ir.graph import graph_of

    g = graph_of(program)
    graph = program.graph
    out: dict[Any, tuple[Any, int]] = {}
    for k, i, s in zip(pool.tolist(), mb.tolist(), slot.tolist()):
        kind, stage, e, tokens, host = keys[k]
        if host or e < 0 or kind not in ("input", "grad"):
            continue
        u, v = (int(x) for x in g.edges[e])
        key = edge_key(ACT if kind == "input" else GRAD, i, u, v, graph)
        if key in specs and key not in out:
            out[key] = (space[k], s)
    return out if specs.keys() <= out.keys() else None


def build(ex: Any, device: torch.device, fixed: bool) -> Slots:
    """The receive slots of executor `ex` after a shape exchange: the plan's where it holds, else the runtime's."""
    from pipec.runtime.exec.comm import edge_key

    slots = Slots(device)
    if not fixed:
        slots.note = "shapes may change between steps (micro-batches given): a buffer per message"
        return slots
    recvs = [j for j in ex.recvs if ex.tkeys[j] in ex.recv_specs]
    if not recvs:
        slots.note = "no receives on this rank"
        return slots
    consumer = {}
    for j in recvs:
        key = ex.tkeys[j]
        kind, _, edge = key
        if edge.__class__ is tuple:
            consumer[key] = edge[1] if kind == ACT else edge[0]
        else:
            consumer[key] = edge + 1 if kind == ACT else edge - 1
    sliced = ex.program.slicing is not None and ex.program.slicing.slices > 1
    life = lifetimes(ex.instrs, recvs, ex.tkeys, consumer, ex.recv_ahead, sliced)
    why = ""
    try:
        got = plan_slots(ex.program, ex.rank, {k: ex.recv_specs[k] for k in life}, edge_key, ex.recv_ahead)
    except Exception as e:  # the plan pass on a Program it does not cover: said, the runtime's own instead
        got, why = None, f"the plan pass failed: {type(e).__name__}: {e}"
    planned = None if got is None else got[0]
    if got is not None:
        bad = clash(life, planned)
        if bad is None and all(ex.recv_specs[a] == ex.recv_specs[b] for a, b in _same_pool(planned)):
            slots.assign(list(life), ex.recv_specs, planned)
            slots.source, slots.note = "plan", got[1]
            return slots
        if bad is not None:
            why = _clash_reason(ex, bad)
        else:
            why = "a pool of the plan holds messages of different shapes"
    elif not why:
        why = "the plan has no slot for some received message"
    slots.assign(list(life), ex.recv_specs, colour(life, {k: ex.recv_specs[k] for k in life}))
    slots.source, slots.note = "runtime", f"not the plan's: {why}"
    return slots


def _same_pool(planned: dict[Any, tuple[Any, int]]) -> list[tuple[Any, Any]]:
    first: dict[Any, Any] = {}
    pairs = []
    for key, (pool, _) in planned.items():
        if pool in first:
            pairs.append((first[pool], key))
        else:
            first[pool] = key
    return pairs


def _clash_reason(ex: Any, bad: tuple[Any, Any]) -> str:
    """Why the plan's slots do not hold under the runtime's lifetimes: the two rules differ somewhere (the plan's
    rule counts receives posted ahead and split backward's kept gradients, so not there)."""
    from pipec.runtime.exec.comm import key_str

    a, b = bad
    sl = ex.program.slicing
    if sl is not None and sl.slices > 1:
        return (
            f"token slices: the runtime keeps {key_str(a)} to the step's end (a sequence's key/value cache), past "
            f"the plan's last use, when {key_str(b)} takes its slot"
        )
    return f"{key_str(a)} and {key_str(b)} would share a slot while both are in use"
