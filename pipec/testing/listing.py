"""Random valid schedules as explicit listings (`Listing`, the `schedules` strategy), and the
dependency rule they follow (`deps`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pipec.errors import Source
from pipec.ir.schedule import Schedule, Slicing

Op3 = tuple[str, int, int]  # (kind, micro-batch, stage)
COMPUTE = ("FWD", "BWD", "WGRAD")


def _hypothesis():
    try:
        import hypothesis
        from hypothesis import strategies
    except ImportError:  # pragma: no cover - hypothesis is installed with the test extra
        raise ImportError("pipec.testing's strategies need hypothesis: pip install 'pipec[test]'") from None
    return hypothesis, strategies


# ---- dependencies ------------------------------------------------------------------------------


def deps(kind: str, i: int, s: int, num_stages: int, split: bool, slices: int = 1) -> list[Op3]:
    """The ops `kind(i, s)` needs (DESIGN.md): F(i,s) <- F(i,s-1); B(i,s) <- F(i,s), B(i,s+1); W(i,s) <- B(i,s).

    With token slices (`slices` n > 1, `i` a unit: slice i % n of micro-batch i // n) also the slice rules
    on the same stage: F(i,s) <- F(i-1,s) unless i is its sequence's first slice (it attends to the earlier
    slice's keys and values), B(i,s) <- B(i+1,s) unless it is the last (which returns their gradients)."""
    if kind == "F":
        out = [("F", i, s - 1)] if s > 0 else []
        return out + ([("F", i - 1, s)] if slices > 1 and i % slices > 0 else [])
    if kind == "B":
        out = [("F", i, s)] + ([("B", i, s + 1)] if s < num_stages - 1 else [])
        return out + ([("B", i + 1, s)] if slices > 1 and i % slices < slices - 1 else [])
    return [("B", i, s)]


# ---- explicit schedules -------------------------------------------------------------------------


@dataclass(frozen=True)
class Listing:
    """A schedule written out op by op: per rank, an ordered list of (kind, micro-batch, stage).

    `pairs[r]` holds the indices j where op j of rank r is overlapped (`&`) with op j + 1.
    `text()` prints it as a .pipe file; `build()` evaluates and checks it like any schedule.
    With `slicing` (token slices, or sequence lengths: pipec.ir.schedule.Slicing) the micro-batches are units
    (`m` counts them), written `F(i, slice: j, stage: s)` under the slicing's declarations.
    """

    p: int
    m: int
    placement: tuple[int, ...]
    split: bool
    orders: tuple[tuple[Op3, ...], ...]
    pairs: tuple[frozenset[int], ...] = ()
    memory_limit: float | None = None
    name: str = "random"
    slicing: Slicing | None = None

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def slices(self) -> int:
        return self.slicing.slices if self.slicing else 1

    def _slicing_lines(self) -> list[str]:
        """The declarations that give back `slicing`: `slices`, `seqlen` and `tokens` (`length` when unsliced)."""
        sl = self.slicing
        if sl is None:
            return []
        if sl.slices > 1:
            return [f"    slices {sl.slices}", f"    seqlen {sl.seqlen}", f"    tokens j -> {_table('j', sl.tokens)}"]
        return [f"    seqlen {sl.seqlen}", f"    length i -> {_table('i', sl.lengths)}"]

    def _op(self, k: str, u: int, s: int) -> str:
        if self.slices == 1:
            return f"{k}({u}, stage: {s})"
        i, j = divmod(u, self.slices)
        return f"{k}({i}, slice: {j}, stage: {s})"

    def paired(self, r: int) -> frozenset[int]:
        return self.pairs[r] if r < len(self.pairs) else frozenset()

    def text(self) -> str:
        ops = "F, B, W" if self.split else "F, B"
        place = " else ".join(f"if s == {s} then {r}" for s, r in enumerate(self.placement[:-1]))
        place = f"{place} else {self.placement[-1]}" if place else str(self.placement[-1])
        lines = [
            f'schedule "{self.name}" (p: int = {self.p}, m: int = {self.m // self.slices}) {{',
            f"    stages {len(self.placement)}",
            f"    place s -> {place}",
            f"    ops {ops}",
            *self._slicing_lines(),
        ]
        if self.memory_limit is not None:
            lines.append(f"    memory limit = {float(self.memory_limit)!r}")
        lines.append("    rank r {")
        for r, order in enumerate(self.orders):
            pairs = self.paired(r)
            body = ""
            for j, (k, i, s) in enumerate(order):
                body += self._op(k, i, s) + (" & " if j in pairs else " " if j < len(order) - 1 else "")
            lines.append(f"        {'if' if r == 0 else 'elif'} r == {r} {{ {body} }}")
        lines += ["    }", "}"]
        return "\n".join(lines) + "\n"

    def rank_line(self, r: int) -> int:
        """The line of `text()` that lists rank r's ops."""
        return 5 + len(self._slicing_lines()) + (self.memory_limit is not None) + 1 + r

    def source(self, path: str = "listing.pipe") -> Source:
        return Source(path, self.text())

    def build(self, path: str = "listing.pipe", *, check: bool = True) -> Schedule:
        """Evaluate the text (and run `pipec.passes.checks` on it unless told not to)."""
        from pipec.driver import build

        return build(self.source(path), {}, check=check)

    @staticmethod
    def from_schedule(sched: Schedule) -> Listing:
        """The explicit form of an evaluated schedule (declared costs and memory are not carried over)."""
        orders = tuple(tuple((o.kind, o.mb, o.stage) for o in sched.ops(r)) for r in range(sched.num_ranks))
        pairs = tuple(frozenset(np.flatnonzero(sched.ranks[r].paired).tolist()) for r in range(sched.num_ranks))
        return Listing(
            sched.num_ranks,
            sched.num_microbatches,
            tuple(sched.placement),
            sched.split_backward,
            orders,
            pairs,
            None,
            sched.name,
            sched.slicing,
        )

    # Slots: an op alone, or an overlapped pair; mutations move ops between slots.
    def _slots(self, r: int) -> list[list[Op3]]:
        order, pairs, out, j = self.orders[r], self.paired(r), [], 0
        while j < len(order):
            if j in pairs and j + 1 < len(order):
                out.append([order[j], order[j + 1]])
                j += 2
            else:
                out.append([order[j]])
                j += 1
        return out

    def _with_slots(self, slots: Mapping[int, list[list[Op3]]], **changes) -> Listing:
        orders, pairs = list(self.orders), list(self.pairs) or [frozenset()] * len(self.orders)
        pairs += [frozenset()] * (len(orders) - len(pairs))
        for r, rs in slots.items():
            rs = [s for s in rs if s]
            order, pr = [], set()
            for slot in rs:
                if len(slot) == 2:
                    pr.add(len(order))
                order.extend(slot)
            orders[r], pairs[r] = tuple(order), frozenset(pr)
        fields = dict(
            p=self.p,
            m=self.m,
            placement=self.placement,
            split=self.split,
            orders=tuple(orders),
            pairs=tuple(pairs),
            memory_limit=self.memory_limit,
            name=self.name,
            slicing=self.slicing,
        )
        fields.update(changes)
        return Listing(**fields)


# ---- strategies -------------------------------------------------------------------------------------


def schedules(
    max_ranks: int = 4,
    max_stages: int = 6,
    max_mb: int = 4,
    *,
    split: bool | None = None,
    pairs: bool = True,
):
    """A hypothesis strategy of random valid `Listing`s.

    p ranks (1..max_ranks), S stages (1..max_stages) placed contiguously (s * p // S), looped (s % p),
    in a V (S = 2p), or at random (scattered, ranks may own nothing), m micro-batches (1..max_mb), split
    backward or not (`split` forces one), then random list scheduling: repeatedly one op whose
    dependencies are all done goes next on its owner. Every rank's order is then a projection of one
    global dependency order, so the schedule is valid and cannot deadlock. With `pairs`, now and then
    two ready ops of different micro-batches on one rank go together as an overlapped pair (`&`).
    """
    _, st = _hypothesis()

    @st.composite
    def build(draw) -> Listing:
        p = draw(st.integers(1, max_ranks))
        style = draw(st.sampled_from(("random", "contiguous", "looped", "v")))
        if style == "v" and 2 * p <= max_stages:
            S = 2 * p
            placement = tuple(s if s < p else 2 * p - 1 - s for s in range(S))
        elif style == "looped" and p <= max_stages:
            S = p * draw(st.integers(1, max_stages // p))
            placement = tuple(s % p for s in range(S))
        elif style == "contiguous":
            S = draw(st.integers(1, max_stages))
            placement = tuple(s * p // S for s in range(S))
        else:
            S = draw(st.integers(1, max_stages))
            placement = tuple(draw(st.lists(st.integers(0, p - 1), min_size=S, max_size=S)))
        m = draw(st.integers(1, max_mb))
        sp = draw(st.booleans()) if split is None else split
        kinds = ("F", "B", "W") if sp else ("F", "B")
        pending = {(k, i, s) for k in kinds for i in range(m) for s in range(S)}
        done: set = set()
        slots: dict[int, list[list[Op3]]] = {r: [] for r in range(p)}
        while pending:
            ready = sorted(op for op in pending if all(d in done for d in deps(*op, S, sp)))
            op = ready[draw(st.integers(0, len(ready) - 1))]
            slot = [op]
            if pairs and op[0] in "FB":
                mates = [x for x in ready if x[0] in "FB" and x[1] != op[1] and placement[x[2]] == placement[op[2]]]
                if mates and draw(st.integers(0, 3)) == 0:
                    slot.append(mates[draw(st.integers(0, len(mates) - 1))])
            for x in slot:
                pending.remove(x)
                done.add(x)
            slots[placement[op[2]]].append(slot)
        empty = Listing(p, m, placement, sp, tuple(() for _ in range(p)))
        return empty._with_slots(slots)

    return build()


def _table(var: str, values) -> str:
    """An expression of `var` with these values at 0, 1, ...: `5`, or `if j == 0 then 4 else 3`."""
    values = list(values)
    if len(set(values)) == 1:
        return str(values[0])
    head = " else ".join(f"if {var} == {x} then {v}" for x, v in enumerate(values[:-1]))
    return f"{head} else {values[-1]}"


def _fmt_op(op: Op3) -> str:
    return f"{op[0]}({op[1]}, stage {op[2]})"
