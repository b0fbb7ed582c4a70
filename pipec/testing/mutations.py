"""Invalid variants of a valid schedule (`mutations`), each tagged with the diagnostic pipec must
report for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipec.ir.schedule import Schedule
from pipec.testing.invariants import _memory_peaks
from pipec.testing.listing import Listing, Op3, _fmt_op, _hypothesis, deps


@dataclass(frozen=True)
class Mutation:
    """An invalid variant of a valid schedule and the diagnostic pipec must report for it.

    `rank` is the rank whose line the diagnostic points at, where the code names one op (E301, E302,
    E304); None otherwise.
    """

    listing: Listing
    code: str
    what: str
    rank: int | None = None


MUTATION_CODES = ("E301", "E302", "E303", "E304", "E401", "E402")


def mutations(schedule: Listing | Schedule, codes: Sequence[str] = MUTATION_CODES):
    """A hypothesis strategy of `Mutation`s of a valid schedule (a `Listing` or an evaluated Schedule).

    - E303 an op dropped (never the only W of a split schedule: that is E307);
    - E302 an op emitted a second time on its owner;
    - E301 an op moved to a rank that does not own its stage (needs p >= 2);
    - E304 an op moved before an op of its own rank it depends on;
    - E401 a B(i, s) moved before a forward F(j, s) that the next stage's rank runs before B(i, s + 1),
      making a cycle of waits across two ranks (exists only when the schedule has such a pair);
    - E402 a memory limit at 7/8 of the highest per-rank peak (default memory model).
    """
    _, st = _hypothesis()
    base = schedule if isinstance(schedule, Listing) else Listing.from_schedule(schedule)
    available = [c for c in codes if _applicable(base, c)]
    if not available:
        return st.nothing()

    @st.composite
    def build(draw) -> Mutation:
        code = draw(st.sampled_from(available))
        return _MUTATORS[code](base, draw, st)

    return build()


def _all_ops(base: Listing) -> list[tuple[int, Op3]]:
    return [(r, op) for r, order in enumerate(base.orders) for op in order]


def _droppable(base: Listing) -> list[tuple[int, Op3]]:
    ws = sum(1 for _, op in _all_ops(base) if op[0] == "W")
    return [(r, op) for r, op in _all_ops(base) if not (op[0] == "W" and ws == 1)]


def _dependency_pairs(base: Listing) -> list[tuple[int, Op3, Op3]]:
    """(rank, needed, needer): same-rank dependencies, the needed op first in the rank's order."""
    out = []
    S = base.num_stages
    for r, order in enumerate(base.orders):
        mine = set(order)
        for op in order:
            out.extend((r, d, op) for d in deps(*op, S, base.split, base.slices) if d in mine)
    return out


def _cycle_candidates(base: Listing) -> list[tuple[int, Op3, Op3]]:
    """(rank X, w = B(i,s), u = F(j,s)) where moving w before u closes a cycle of waits with rank Y = owner(s+1):
    on X, F(i,s) < u < w; on Y, F(j,s+1) comes before B(i,s+1)."""
    S, out = base.num_stages, []
    slot_of = {}
    for r in range(base.p):
        for g, slot in enumerate(base._slots(r)):
            for op in slot:
                slot_of[op] = g
    for s in range(S - 1):
        X, Y = base.placement[s], base.placement[s + 1]
        if X == Y:
            continue
        for i in range(base.m):
            w = ("B", i, s)
            for j in range(base.m):
                if j == i:
                    continue
                u = ("F", j, s)
                # Every other op w needs on X (F(i,s); with token slices B(i+1,s) too) stays before u.
                local = [d for d in deps(*w, S, base.split, base.slices) if base.placement[d[2]] == X]
                if (
                    all(slot_of[d] < slot_of[u] for d in local)
                    and slot_of[u] < slot_of[w]
                    and slot_of[("F", j, s + 1)] < slot_of[("B", i, s + 1)]
                ):
                    out.append((X, w, u))
    return out


def _peaks(base: Listing) -> list[float]:
    """Per-rank peak memory of a listing under the default memory model (`pipec.sim.memory`)."""
    from pipec.sim.memory import memory_model

    sched = base._with_slots({}, memory_limit=None).build(check=False)
    return _memory_peaks(sched, memory_model(sched))


def _applicable(base: Listing, code: str) -> bool:
    if code == "E303":
        return bool(_droppable(base))
    if code == "E302":
        return bool(_all_ops(base))
    if code == "E301":
        return base.p >= 2 and bool(_all_ops(base))
    if code == "E304":
        return bool(_dependency_pairs(base))
    if code == "E401":
        return bool(_cycle_candidates(base))
    if code == "E402":
        return max(_peaks(base), default=0.0) > 0
    raise ValueError(f"no mutation produces {code}")


def _remove(slots: list[list[Op3]], op: Op3) -> int:
    """Take op out of its slot (a pair becomes a single op); return the slot's index."""
    for g, slot in enumerate(slots):
        if op in slot:
            slot.remove(op)
            return g
    raise ValueError(op)


def _move_before(slots: list[list[Op3]], op: Op3, target: Op3) -> None:
    """Take op out of its slot and put it, alone, in a new slot just before target's."""
    _remove(slots, op)
    at = next(g for g, slot in enumerate(slots) if target in slot)
    slots.insert(at, [op])


def _mut_drop(base, draw, st) -> Mutation:
    r, op = draw(st.sampled_from(_droppable(base)))
    slots = base._slots(r)
    _remove(slots, op)
    return Mutation(base._with_slots({r: slots}), "E303", f"dropped {_fmt_op(op)} from rank {r}")


def _mut_duplicate(base, draw, st) -> Mutation:
    r, op = draw(st.sampled_from(_all_ops(base)))
    slots = base._slots(r)
    at = draw(st.integers(0, len(slots)))
    slots.insert(at, [op])
    return Mutation(base._with_slots({r: slots}), "E302", f"{_fmt_op(op)} emitted twice on rank {r}", r)


def _mut_wrong_rank(base, draw, st) -> Mutation:
    r, op = draw(st.sampled_from(_all_ops(base)))
    other = draw(st.sampled_from([q for q in range(base.p) if q != r]))
    src, dst = base._slots(r), base._slots(other)
    _remove(src, op)
    dst.insert(draw(st.integers(0, len(dst))), [op])
    what = f"{_fmt_op(op)} moved from rank {r} to rank {other}"
    return Mutation(base._with_slots({r: src, other: dst}), "E301", what, other)


def _mut_swap(base, draw, st) -> Mutation:
    r, needed, needer = draw(st.sampled_from(_dependency_pairs(base)))
    slots = base._slots(r)
    _move_before(slots, needer, needed)
    what = f"{_fmt_op(needer)} moved before {_fmt_op(needed)}, which it needs, on rank {r}"
    return Mutation(base._with_slots({r: slots}), "E304", what, r)


def _mut_cycle(base, draw, st) -> Mutation:
    X, w, u = draw(st.sampled_from(_cycle_candidates(base)))
    slots = base._slots(X)
    _move_before(slots, w, u)
    Y = base.placement[w[2] + 1]
    what = f"{_fmt_op(w)} moved before {_fmt_op(u)} on rank {X}: a cycle of waits with rank {Y}"
    return Mutation(base._with_slots({X: slots}), "E401", what)


def _mut_memory(base, draw, st) -> Mutation:
    peak = max(_peaks(base))
    limit = peak * 0.875  # exact in binary, and clear of the checker's tolerance
    return Mutation(base._with_slots({}, memory_limit=limit), "E402", f"memory limit {limit:g} below the peak {peak:g}")


_MUTATORS = {
    "E303": _mut_drop,
    "E302": _mut_duplicate,
    "E301": _mut_wrong_rank,
    "E304": _mut_swap,
    "E401": _mut_cycle,
    "E402": _mut_memory,
}
