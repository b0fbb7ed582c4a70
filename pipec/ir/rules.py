"""The dependency rule and the slice rules: which op needs which, derived once from the instruction table.

`pipec.ir.opcodes` declares, per compute opcode, the message it consumes (`needs`: what travels and the
offset of the stage that sends it) and the op kind that must come first on its own stage and micro-batch
(`after`). Read together with `sends` (which kind's output each message is), that is the whole rule:

- F(i, s) needs F(i, s-1): FWD needs the activation sent by stage s-1, which F produces;
- B(i, s) needs F(i, s) (`after`) and B(i, s+1): BWD needs the gradient sent by stage s+1, which B produces
  (the last stage's B needs only its F: there is no stage s+1);
- W(i, s) needs B(i, s) (`after`).

On a stage graph (`pipec.ir.graph.StageGraph`) the offsets name the direction of an edge, not a neighbour:
-1 is "every stage this one reads" and +1 "every stage that reads this one". So F(i, v) needs F(i, u) for
every edge (u, v) (all its inputs), and B(i, u) needs B(i, v) for every edge (u, v) (the gradients of all
its consumers, summed at a fan-out); the last stage, the only one without outputs, holds the loss. On the
chain that is the rule above, unchanged. `dependencies`, `needs` and `feeds` take the graph (None: the
chain) and give one entry per edge.

With token slices (pipec.ir.schedule.Slicing: `slices` per micro-batch, `mb` a unit i * slices + j), each
kind that consumes a message also needs the same kind on the neighbouring slice of its sequence on its own
stage, in the direction its data flows: F(i, j, s) needs F(i, j-1, s) (slice j attends to the keys and
values of the slices before it) and B(i, j, s) needs B(i, j+1, s) (which returns their gradients). Those
are the slice rules, derived here from the sign of the message's stage offset.

Every pass that orders ops reads `RULES` (or `dependencies`, `needs`, `feeds` built on it): the checks
(E304), the Program validator's slice order, the deadlock rounds, the list scheduler's readiness, the synth
solver's precedences, the partition search's graph. The testing kit's oracle (`pipec.testing.listing`)
restates the rule independently on purpose: it is what checks this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipec.ir.graph import StageGraph
from pipec.ir.opcodes import BY_NAME, COMPUTE, MESSAGES, OP_KINDS, OPCODES, TABLE


@dataclass(frozen=True)
class Rule:
    """Op kind `kind` of (unit u, stage s) needs op kind `needs` of (unit u + unit, stage s + stage).

    kind, needs: indices into OP_KINDS. stage: the offset of the needed op's stage (-1, 0, +1). unit: the
    offset of the needed op's token slice within its sequence (0 but for a slice rule). message: the index
    (pipec.ir.opcodes.MESSAGES) of the message that carries the input between stages, None for an input on
    the same stage. why: the note a diagnostic gives for a slice rule ({j}: the slice, {p}: the one needed).
    """

    kind: int
    needs: int
    stage: int = 0
    unit: int = 0
    message: int | None = None
    why: str | None = None

    @property
    def is_slice(self) -> bool:
        return self.unit != 0


_WHY = {
    -1: "slice {j} attends to the keys and values of slice {p} of its sequence on the same stage",
    +1: "slice {j}'s backward needs the gradients of its keys and values from slice {p}'s backward",
}


def _derive() -> tuple[Rule, ...]:
    """The rules from the table: per compute kind its `after`, then its message input; then the slice rules."""
    producer = {BY_NAME[o.sends].message: o.kind for o in TABLE if o.sends}  # message -> the kind it carries
    base, sliced = [], []
    for c in COMPUTE:
        o = BY_NAME[OPCODES[c]]
        k = OP_KINDS.index(o.kind)
        if o.after:
            base.append(Rule(k, OP_KINDS.index(o.after)))
        if o.needs:
            message, offset = o.needs
            needed = OP_KINDS.index(producer[message])
            base.append(Rule(k, needed, stage=offset, message=MESSAGES.index(message)))
            # A slice rule: the same input's kind, one slice over on the stage itself, as the data flows.
            sliced.append(Rule(k, needed, unit=int(np.sign(offset)), why=_WHY[int(np.sign(offset))]))
    return tuple(base) + tuple(sliced)


RULES: tuple[Rule, ...] = _derive()
# A kind receives at most one message (the table's `needs` is one): passes that keep one remote input per op
# (the deadlock rounds, the partition graph) rely on it.
assert all(sum(r.kind == k and r.stage != 0 for r in RULES) <= 1 for k in range(len(OP_KINDS)))


def active(kinds: int, slices: int = 1) -> tuple[Rule, ...]:
    """The rules of a schedule of `kinds` op kinds (2: F, B; 3: split backward) and `slices` per micro-batch."""
    return tuple(r for r in RULES if r.kind < kinds and r.needs < kinds and (slices > 1 or not r.is_slice))


def dependencies(
    kind: np.ndarray,
    mb: np.ndarray,
    stage: np.ndarray,
    S: int,
    split: bool,
    slices: int = 1,
    graph: StageGraph | None = None,
) -> list[tuple[Rule, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """For each rule, the op each op needs by it, vectorised: (rule, kind, mb, stage, valid) arrays, where
    valid says which ops the rule applies to (their kind, and a needed op that exists: a stage in range, a
    slice in its sequence). `mb` is the unit when sliced (`slices` per micro-batch). On a stage graph a rule
    across stages gives one entry per input slot (F) or output slot (B): the j-th edge of each op's stage."""
    out = []
    j = mb % slices if slices > 1 else None
    for r in active(3 if split else 2, slices):
        valid = kind == r.kind
        if r.unit:
            valid = valid & (j + r.unit >= 0) & (j + r.unit < slices)
        if r.stage and graph is not None:
            slots = graph.max_in if r.stage < 0 else graph.max_out
            for k in range(slots):
                eid, has = graph.in_slot(stage, k) if r.stage < 0 else graph.out_slot(stage, k)
                other = (graph.src if r.stage < 0 else graph.dst)[np.maximum(eid, 0)] if graph.num_edges else eid
                out.append((r, np.full_like(kind, r.needs), mb + r.unit, np.where(has, other, -1), valid & has))
            continue
        if r.stage:
            valid = valid & (stage + r.stage >= 0) & (stage + r.stage < S)
        out.append((r, np.full_like(kind, r.needs), mb + r.unit, stage + r.stage, valid))
    return out


def _across(s: int, offset: int, S: int, graph: StageGraph | None) -> tuple[int, ...]:
    """The stages across one rule's offset from stage s: its inputs (-1) or consumers (+1); s itself (0)."""
    if offset == 0:
        return (s,)
    if graph is None:
        return (s + offset,) if 0 <= s + offset < S else ()
    return graph.inputs(s) if offset < 0 else graph.outputs(s)


def needs(
    k: int, u: int, s: int, S: int, rules: tuple[Rule, ...], slices: int = 1, graph: StageGraph | None = None
) -> list[tuple[int, int, int]]:
    """The ops (kind, unit, stage) that op (k, u, s) needs under these rules (`active`)."""
    j = u % slices
    return [
        (r.needs, u + r.unit, t)
        for r in rules
        if r.kind == k and 0 <= j + r.unit < slices
        for t in _across(s, r.stage, S, graph)
    ]


def feeds(
    k: int, u: int, s: int, S: int, rules: tuple[Rule, ...], slices: int = 1, graph: StageGraph | None = None
) -> list[tuple[Rule, tuple[int, int, int]]]:
    """The ops that need op (k, u, s) under these rules, each with the rule by which it does."""
    j = u % slices
    return [
        (r, (r.kind, u - r.unit, t))
        for r in rules
        if r.needs == k and 0 <= j - r.unit < slices
        for t in _across(s, -r.stage, S, graph)
    ]


@dataclass(frozen=True, eq=False)
class OpInputs:
    """A schedule's ops, all ranks concatenated (rank r's are `offsets[r]` to `offsets[r + 1]`, in its
    order): each op's rank, kind, micro-batch and stage, and the global indices of the ops it needs
    (`dependencies`, local and across ranks). The one dependency graph over a Schedule's ops that the
    family proof (`pipec.passes.family`) and the family machine (`pipec.sim.faults`) both walk."""

    offsets: np.ndarray
    rank: np.ndarray
    kind: np.ndarray
    mb: np.ndarray
    stage: np.ndarray
    inputs: list[list[int]]


def op_inputs(sched) -> OpInputs:
    """`OpInputs` of a `pipec.ir.schedule.Schedule` (token slices and a stage graph included); a needed op
    the schedule does not hold (the checks' E304) is left out."""
    S, m, K = sched.num_stages, sched.num_microbatches, len(sched.kinds)
    offsets = np.cumsum([0] + [len(r) for r in sched.ranks])
    n = int(offsets[-1])
    none = [np.zeros(0, dtype=np.int64)]
    kind = np.concatenate([o.kind for o in sched.ranks] or none)
    mb = np.concatenate([o.mb for o in sched.ranks] or none)
    stage = np.concatenate([o.stage for o in sched.ranks] or none)
    rank = np.repeat(np.arange(sched.num_ranks), np.diff(offsets))
    where = np.full(K * S * m, -1, dtype=np.int64)
    where[(kind * S + stage) * m + mb] = np.arange(n)
    slices = sched.slicing.slices if sched.slicing else 1
    inputs: list[list[int]] = [[] for _ in range(n)]
    for _rule, dk, di, ds, valid in dependencies(kind, mb, stage, S, K == 3, slices, sched.graph):
        key = np.where(valid, (dk * S + np.clip(ds, 0, S - 1)) * m + np.clip(di, 0, m - 1), 0)
        idx = np.flatnonzero(valid)
        for c, p in zip(idx.tolist(), where[key[idx]].tolist()):
            if p >= 0:
                inputs[c].append(p)
    return OpInputs(offsets, rank, kind, mb, stage, inputs)
