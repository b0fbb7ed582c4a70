"""Property testing for pipeline schedules: hypothesis strategies, independent checks, and `pipec test`.

Five tools, for anyone who writes a schedule (see docs/testing.md):

- `params(schedule)`: parameter assignments that satisfy the schedule's
  top-level `require`s, within bounds; they shrink toward small p and m.
- `schedules()`: random valid schedules from scratch, as `Listing`s (explicit
  per-rank op lists that print as .pipe text): random stage counts and
  placements (contiguous, looped, V-shaped, scattered), split or full
  backward, optional overlapped pairs, orders from random list scheduling.
- `mutations(schedule)`: invalid variants of a valid schedule, each tagged
  with the diagnostic pipec must report (E301, E302, E303, E304, E401, E402).
- `check_invariants(x)`: checks of a Schedule, its compiled form or a bare
  Program by code independent of the compiler's: every op exactly once on its
  owner; dependency order; a deadlock-free execution exists exactly when pipec
  says so; every message sent once, received once, by the right peer, in the
  same order on both ends of every channel, batched only as send+receive
  pairs; a strict rendezvous dry run completes; memory peaks agree and stay
  within the limit; the simulated timeline respects every dependency and its
  makespan is at least the critical path; the schedule's own `expect`s hold.
- `runtime_check(x)`: train a tiny model on the runtime's `--local` mode and
  compare the loss and gradients with a single-process reference (torch).

`check_file` runs the whole property over one schedule file (what `pipec
test` and the pytest plugin do): hypothesis samples parameter sets, and the
first failure is shrunk to the smallest failing parameter set of the bounded
space (hypothesis's shrinking, then a scan of every smaller set), reported
as a `pipec check` command that reproduces it.

hypothesis is a test extra (`pip install pipec[test]`): this module imports
it only inside the functions that need it (the strategies and `check_file`),
so `import pipec.testing` and `check_invariants` work without it.
"""

from __future__ import annotations

import itertools
import shlex
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipec.checks import check_schedule
from pipec.compiler import Compiled, compile_schedule
from pipec.errors import PipecError, Source
from pipec.ir import Schedule
from pipec.program import (
    BWD,
    FWD,
    OPCODES,
    RECV_ACT,
    RECV_GRAD,
    REDUCE_GRAD,
    SEND_ACT,
    SEND_GRAD,
    STEP,
    WGRAD,
    Program,
)

Op3 = tuple[str, int, int]  # (kind, micro-batch, stage)
COMPUTE = ("FWD", "BWD", "WGRAD")

__all__ = [
    "DEFAULT_BOUNDS",
    "Checked",
    "FileResult",
    "Failure",
    "InvariantError",
    "Listing",
    "Mutation",
    "check_file",
    "check_invariants",
    "deps",
    "find_schedule_files",
    "mutations",
    "parameter_space",
    "params",
    "program_problem",
    "runtime_check",
    "schedule_problem",
    "schedules",
]


def _hypothesis():
    try:
        import hypothesis
        from hypothesis import strategies
    except ImportError:  # pragma: no cover - hypothesis is installed with the test extra
        raise ImportError("pipec.testing's strategies need hypothesis: pip install 'pipec[test]'") from None
    return hypothesis, strategies


# ---- dependencies ------------------------------------------------------------------------------


def deps(kind: str, i: int, s: int, num_stages: int, split: bool) -> list[Op3]:
    """The ops `kind(i, s)` needs (DESIGN.md): F(i,s) <- F(i,s-1); B(i,s) <- F(i,s), B(i,s+1); W(i,s) <- B(i,s)."""
    if kind == "F":
        return [("F", i, s - 1)] if s > 0 else []
    if kind == "B":
        return [("F", i, s)] + ([("B", i, s + 1)] if s < num_stages - 1 else [])
    return [("B", i, s)]


# ---- explicit schedules -------------------------------------------------------------------------


@dataclass(frozen=True)
class Listing:
    """A schedule written out op by op: per rank, an ordered list of (kind, micro-batch, stage).

    `pairs[r]` holds the indices j where op j of rank r is overlapped (`&`) with op j + 1.
    `text()` prints it as a .pipe file; `build()` evaluates and checks it like any schedule.
    """

    p: int
    m: int
    placement: tuple[int, ...]
    split: bool
    orders: tuple[tuple[Op3, ...], ...]
    pairs: tuple[frozenset[int], ...] = ()
    memory_limit: float | None = None
    name: str = "random"

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def paired(self, r: int) -> frozenset[int]:
        return self.pairs[r] if r < len(self.pairs) else frozenset()

    def text(self) -> str:
        ops = "F, B, W" if self.split else "F, B"
        place = " else ".join(f"if s == {s} then {r}" for s, r in enumerate(self.placement[:-1]))
        place = f"{place} else {self.placement[-1]}" if place else str(self.placement[-1])
        lines = [
            f'schedule "{self.name}" (p: int = {self.p}, m: int = {self.m}) {{',
            f"    stages {len(self.placement)}",
            f"    place s -> {place}",
            f"    ops {ops}",
        ]
        if self.memory_limit is not None:
            lines.append(f"    memory limit = {float(self.memory_limit)!r}")
        lines.append("    rank r {")
        for r, order in enumerate(self.orders):
            pairs = self.paired(r)
            body = ""
            for j, (k, i, s) in enumerate(order):
                body += f"{k}({i}, stage: {s})" + (" & " if j in pairs else " " if j < len(order) - 1 else "")
            lines.append(f"        {'if' if r == 0 else 'elif'} r == {r} {{ {body} }}")
        lines += ["    }", "}"]
        return "\n".join(lines) + "\n"

    def rank_line(self, r: int) -> int:
        """The line of `text()` that lists rank r's ops."""
        return 5 + (self.memory_limit is not None) + 1 + r

    def source(self, path: str = "listing.pipe") -> Source:
        return Source(path, self.text())

    def build(self, path: str = "listing.pipe", *, check: bool = True) -> Schedule:
        """Evaluate the text (and run `pipec.checks` on it unless told not to)."""
        from pipec.api import build

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
            out.extend((r, d, op) for d in deps(*op, S, base.split) if d in mine)
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
                if (
                    slot_of[("F", i, s)] < slot_of[u] < slot_of[w]
                    and slot_of[("F", j, s + 1)] < slot_of[("B", i, s + 1)]
                ):
                    out.append((X, w, u))
    return out


def _peaks(base: Listing) -> list[float]:
    """Per-rank peak memory of a listing under the default memory model (`pipec.memory`)."""
    from pipec.memory import memory_model

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


def _fmt_op(op: Op3) -> str:
    return f"{op[0]}({op[1]}, stage {op[2]})"


# ---- parameters ---------------------------------------------------------------------------------

# Bounds of the parameters `params` draws, by name; other int parameters range over 0..max(4, 2 * default).
DEFAULT_BOUNDS: dict[str, range] = {"p": range(1, 7), "m": range(1, 13), "v": range(1, 4)}
MAX_POINTS = 20_000


def _source(schedule: str | Path | Source) -> Source:
    if isinstance(schedule, Source):
        return schedule
    from pipec.library import read

    return read(str(schedule))


def _values(name: str, typ: str, default, bounds: Mapping[str, Iterable]) -> list:
    if name in bounds:
        return list(bounds[name])
    if typ == "int":
        if name in DEFAULT_BOUNDS:
            return list(DEFAULT_BOUNDS[name])
        if default is None:
            return list(range(1, 9))
        if default < 0:
            return [default]
        return sorted(set(range(0, max(4, 2 * default) + 1)))
    if typ == "bool":
        return [False, True]
    if typ == "float":
        return sorted({0.5, 1.0, 2.0} | ({float(default)} if default is not None else set()))
    if default is None:
        raise ValueError(f"string parameter `{name}` needs a default or bounds")
    return [default]


def _size(point: Mapping[str, object]) -> tuple:
    """The shrinking order: smaller sums first, then smaller values in the declared order."""
    nums = [float(v) for v in point.values() if not isinstance(v, str)]
    return (sum(nums), nums)


def parameter_space(
    schedule: str | Path | Source,
    bounds: Mapping[str, Iterable] | None = None,
    fixed: Mapping[str, object] | None = None,
) -> list[dict[str, object]]:
    """Every parameter assignment within bounds that passes the schedule's top-level `require`s,
    smallest first (see `_size`). `bounds` maps a parameter to the values to try (`DEFAULT_BOUNDS`
    otherwise); `fixed` pins parameters to one value each."""
    from pipec.api import build, compile_source

    source = _source(schedule)
    compiled = compile_source(source)
    from pipec.evaluate import _parse_value

    types = dict(zip((prm.name for prm in compiled.params), compiled.param_types))
    bounds = dict(bounds or {})
    for k in bounds:
        if k not in types:
            raise ValueError(f"the schedule has no parameter `{k}` (it takes: {', '.join(types) or 'none'})")
    for k, v in (fixed or {}).items():
        if k not in types:
            raise ValueError(f"the schedule has no parameter `{k}` (it takes: {', '.join(types) or 'none'})")
        bounds[k] = [_parse_value(v, types[k]) if isinstance(v, str) else v]
    try:
        defaults = dict(build(source, {}, check=False, ranks=()).params)
    except PipecError:  # a parameter without a default, or defaults that fail a `require`
        defaults = {}
    names, axes = [], []
    for prm, typ in zip(compiled.params, compiled.param_types):
        names.append(prm.name)
        axes.append(_values(prm.name, typ, defaults.get(prm.name), bounds))
    total = int(np.prod([len(a) for a in axes])) if axes else 1
    if total > MAX_POINTS:
        raise ValueError(f"{total:,} parameter sets within the bounds (at most {MAX_POINTS:,}): narrow them")
    points = []
    for combo in itertools.product(*axes):
        point = dict(zip(names, combo))
        try:
            build(source, point, check=False, ranks=())  # top-level statements only: requires, declarations
        except PipecError as e:
            if e.code == "E202":
                continue
        points.append(point)
    points.sort(key=_size)
    return points


def params(
    schedule: str | Path | Source,
    bounds: Mapping[str, Iterable] | None = None,
    fixed: Mapping[str, object] | None = None,
):
    """A hypothesis strategy of parameter dicts for a schedule (a path, a library name or a Source):
    those of `parameter_space`, drawn one parameter at a time in the declared order, each among the
    values that some valid set has with the ones drawn before. Nothing is rejected, and each parameter
    shrinks toward its smallest value: small p first, then small m."""
    _, st = _hypothesis()
    return _point_strategy(parameter_space(schedule, bounds, fixed), st)


def _point_strategy(points: list[dict[str, object]], st):
    if not points:
        return st.nothing()
    names = list(points[0])

    @st.composite
    def point(draw) -> dict[str, object]:
        candidates = points
        for name in names:
            values = sorted({pt[name] for pt in candidates}, key=lambda v: (isinstance(v, str), v))
            value = values[draw(st.integers(0, len(values) - 1))] if len(values) > 1 else values[0]
            candidates = [pt for pt in candidates if pt[name] == value]
        return dict(candidates[0])

    return point()


# ---- independent checks ---------------------------------------------------------------------------


class InvariantError(AssertionError):
    """pipec and an independent check disagree: a bug in pipec (or, for a bare Program, a bad Program)."""


@dataclass(frozen=True)
class Checked:
    """What `check_invariants` verified, with the numbers it measured."""

    ops: int
    instructions: int
    messages: int
    makespan: float
    critical_path: float
    expectations: int


def _fail(message: str) -> None:
    raise InvariantError(message)


def _keys(sched: Schedule) -> list[Op3]:
    return [(k, i, s) for k in sched.kinds for s in range(sched.num_stages) for i in range(sched.num_microbatches)]


def schedule_problem(sched: Schedule) -> str | None:
    """Why the schedule is invalid or deadlocks, by direct enumeration (None when it is fine)."""
    S, placement = sched.num_stages, sched.placement
    where: dict[Op3, tuple[int, int]] = {}
    for r in range(sched.num_ranks):
        ops = sched.ops(r)
        paired = sched.ranks[r].paired.tolist()
        pos = 0
        for j, o in enumerate(ops):
            key = (o.kind, o.mb, o.stage)
            if not (0 <= o.stage < S and 0 <= o.mb < sched.num_microbatches):
                return f"{o} is out of range on rank {r}"
            if placement[o.stage] != r:
                return f"{o} is on rank {r}, but stage {o.stage} is placed on rank {placement[o.stage]}"
            if key in where:
                return f"{o} occurs twice"
            where[key] = (r, pos)
            if not (j < len(ops) - 1 and paired[j]):
                pos += 1
    missing = [k for k in _keys(sched) if k not in where]
    if missing:
        return f"{_fmt_op(missing[0])} never occurs"
    for key, (r, pos) in where.items():
        for d in deps(*key, S, sched.split_backward):
            dr, dpos = where[d]
            if dr == r and dpos >= pos:
                return f"{_fmt_op(key)} comes no later than {_fmt_op(d)}, which it needs, on rank {r}"
    # Deadlock: ranks run in order; an op (or overlapped pair) runs once everything it needs has run.
    done: set[Op3] = set()
    pc = [0] * sched.num_ranks
    orders = [[(o.kind, o.mb, o.stage) for o in sched.ops(r)] for r in range(sched.num_ranks)]
    pairs = [sched.ranks[r].paired.tolist() for r in range(sched.num_ranks)]
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while pc[r] < len(order):
                j = pc[r]
                group = order[j : j + 2] if pairs[r][j] and j + 1 < len(order) else order[j : j + 1]
                if not all(d in done for op in group for d in deps(*op, S, sched.split_backward) if d not in group):
                    break
                done.update(group)
                pc[r] += len(group)
                progress = True
    stuck = [r for r in range(sched.num_ranks) if pc[r] < len(orders[r])]
    if stuck:
        return "deadlock: ranks " + ", ".join(f"{r} at {_fmt_op(orders[r][pc[r]])}" for r in stuck) + " wait forever"
    return None


def _needs(op: int, i: int, s: int, S: int, placement: Sequence[int], r: int):
    """Local op keys a compute instruction needs, and the message (kind, mb, sending stage) it awaits."""
    local, msg = [], None
    if op == FWD and s > 0:
        if placement[s - 1] == r:
            local.append((FWD, i, s - 1))
        else:
            msg = ("act", i, s - 1)
    elif op == BWD:
        local.append((FWD, i, s))
        if s < S - 1:
            if placement[s + 1] == r:
                local.append((BWD, i, s + 1))
            else:
                msg = ("grad", i, s + 1)
    elif op == WGRAD:
        local.append((BWD, i, s))
    return local, msg


def program_problem(prog: Program, sched: Schedule | None = None) -> str | None:
    """What is wrong with a Program, by direct enumeration (None when nothing is)."""
    S, m, placement = prog.num_stages, prog.num_microbatches, prog.placement
    split = prog.split_backward
    instrs = [rp.instructions() for rp in prog.ranks]
    kinds = (FWD, BWD, WGRAD) if split else (FWD, BWD)
    seen: dict[tuple[int, int, int], tuple[int, int]] = {}
    sends: dict[tuple, tuple[int, int, int]] = {}  # message -> (rank, index, peer)
    recvs: dict[tuple, tuple[int, int, int]] = {}
    for r, ins in enumerate(instrs):
        for j, x in enumerate(ins):
            code = OPCODES.index(x.op)
            if code in (FWD, BWD, WGRAD):
                key = (code, x.mb, x.stage)
                if code not in kinds or not (0 <= x.stage < S and 0 <= x.mb < m):
                    return f"rank {r}: `{x}` is not an op of this program"
                if placement[x.stage] != r:
                    return f"rank {r}: `{x}` computes a stage placed on rank {placement[x.stage]}"
                if key in seen:
                    return f"`{x}` computed twice"
                seen[key] = (r, j)
            elif code in (SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD):
                is_send = code in (SEND_ACT, SEND_GRAD)
                kind = "act" if code in (SEND_ACT, RECV_ACT) else "grad"
                sender = x.stage if is_send else (x.stage - 1 if kind == "act" else x.stage + 1)
                receiver = sender + 1 if kind == "act" else sender - 1
                if not (0 <= sender < S and 0 <= receiver < S and 0 <= x.mb < m):
                    return f"rank {r}: `{x}` names a stage out of range"
                me, other = (sender, receiver) if is_send else (receiver, sender)
                if placement[me] != r or placement[other] != x.peer or x.peer == r:
                    return f"rank {r}: `{x}` does not connect the owners of stages {sender} and {receiver}"
                table = sends if is_send else recvs
                msg = (kind, x.mb, sender)
                if msg in table:
                    return f"rank {r}: `{x}` {'sends' if is_send else 'receives'} a message a second time"
                table[msg] = (r, j, x.peer)
    missing = [(k, i, s) for k in kinds for s in range(S) for i in range(m) if (k, i, s) not in seen]
    if missing:
        k, i, s = missing[0]
        return f"{OPCODES[k]} {i} {s} is never computed"
    if sched is not None:
        for r in range(sched.num_ranks):
            want = [(("F", "B", "W").index(o.kind), o.mb, o.stage) for o in sched.ops(r)]
            got = [(OPCODES.index(x.op), x.mb, x.stage) for x in instrs[r] if OPCODES.index(x.op) <= WGRAD]
            if want != got:
                return f"rank {r}: the program computes in another order than the schedule"
    # Every remote input is sent after it is produced and received before it is consumed; every message
    # that is sent is needed and received, and the reverse.
    needed = set()
    for (code, i, s), (r, j) in seen.items():
        local, msg = _needs(code, i, s, S, placement, r)
        for d in local:
            if d not in seen or seen[d][1] >= j:
                return f"rank {r}: {OPCODES[code]} {i} {s} runs before {OPCODES[d[0]]} {d[1]} {d[2]}, which it needs"
        if msg is not None:
            needed.add(msg)
            if msg not in recvs or recvs[msg][0] != r or recvs[msg][1] > j:
                return f"rank {r}: {OPCODES[code]} {i} {s} has no receive of its input before it"
            if msg not in sends:
                return f"the {msg[0]} of micro-batch {i} from stage {msg[2]} is never sent"
            producer = (FWD if msg[0] == "act" else BWD, i, msg[2])
            pr, pj = seen[producer]
            if sends[msg][0] != pr or sends[msg][1] < pj:
                return f"rank {pr}: the {msg[0]} of micro-batch {i} from stage {msg[2]} is sent before it is computed"
    for table, what in ((sends, "sent"), (recvs, "received")):
        extra = [msg for msg in table if msg not in needed]
        if extra:
            kind, i, s = extra[0]
            return f"the {kind} of micro-batch {i} from stage {s} is {what} but no compute needs it"
    # Batches: a group is two adjacent compute instructions, or a send and a receive with one peer.
    for r, ins in enumerate(instrs):
        for j, x in enumerate(ins):
            if not x.group:
                continue
            if j + 1 >= len(ins):
                return f"rank {r}: `{x}` is bound to nothing"
            y = ins[j + 1]
            a, b = OPCODES.index(x.op), OPCODES.index(y.op)
            if a <= WGRAD and b <= WGRAD:
                if y.group:
                    return f"rank {r}: more than two compute instructions overlapped at `{x}`"
                continue
            comm = (SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD)
            if (
                a not in comm
                or b not in comm
                or x.peer != y.peer
                or ((a in (SEND_ACT, SEND_GRAD)) == (b in (SEND_ACT, SEND_GRAD)))
            ):
                return f"rank {r}: `{x}` and `{y}` are batched but are not a send and a receive with one peer"
            if y.group:
                return f"rank {r}: more than two transfers batched at `{x}`"
        # One reduction and one step per owned stage, after all of that stage's compute.
        owned = [s for s in range(S) if placement[s] == r]
        for code in (REDUCE_GRAD, STEP):
            at = [j for j, x in enumerate(ins) if x.op == OPCODES[code]]
            stages = sorted(ins[j].stage for j in at)
            if stages != owned:
                return f"rank {r}: {OPCODES[code]} for stages {stages}, but the rank owns {owned}"
        for j, x in enumerate(ins):
            if x.op == "STEP":
                last = max((jj for (k, i, s), (rr, jj) in seen.items() if s == x.stage), default=-1)
                if last > j:
                    return f"rank {r}: `STEP {x.stage}` comes before the last compute of stage {x.stage}"
    # Both ends of every channel issue its messages in one order.
    seqs: dict[tuple[int, int], list] = defaultdict(list)
    for r, ins in enumerate(instrs):
        for x in ins:
            if x.op in ("SEND_ACT", "SEND_GRAD", "RECV_ACT", "RECV_GRAD"):
                kind = "act" if x.op.endswith("ACT") else "grad"
                sender = x.stage if x.op.startswith("SEND") else (x.stage - 1 if kind == "act" else x.stage + 1)
                seqs[(r, x.peer)].append((kind, x.mb, sender))
    for (a, b), seq in seqs.items():
        if seq != seqs.get((b, a), []):
            return f"ranks {a} and {b} issue their messages to each other in different orders"
    return _rendezvous(prog, instrs)


def _rendezvous(prog: Program, instrs) -> str | None:
    """Run the Program with sends that block until matched (after the checks above): None if it finishes."""
    S, R, placement = prog.num_stages, prog.num_ranks, prog.placement
    comm = ("SEND_ACT", "SEND_GRAD", "RECV_ACT", "RECV_GRAD")
    kpos: list[dict[int, int]] = []  # per rank: instruction index -> position on its channel
    recv_k: dict[tuple, tuple[int, int]] = {}  # message -> (peer, position) on the receiving rank
    for r, ins in enumerate(instrs):
        count: Counter = Counter()
        pos = {}
        for j, x in enumerate(ins):
            if x.op in comm:
                pos[j] = count[x.peer]
                count[x.peer] += 1
                if x.op.startswith("RECV"):
                    kind = "act" if x.op.endswith("ACT") else "grad"
                    recv_k[(r, kind, x.mb, x.stage - 1 if kind == "act" else x.stage + 1)] = (x.peer, pos[j])
        kpos.append(pos)
    issued: Counter = Counter()  # (rank, peer) -> transfers the rank issued towards the peer

    def matched(a: int, b: int) -> int:
        return min(issued[(a, b)], issued[(b, a)])

    computed: set[tuple[int, int, int]] = set()
    pc, issued_upto = [0] * R, [0] * R
    progress = True
    while progress:
        progress = False
        for r, ins in enumerate(instrs):
            while pc[r] < len(ins):
                j = pc[r]
                end = j
                while ins[end].group and end + 1 < len(ins):
                    end += 1
                group = range(j, end + 1)
                if ins[j].op in comm:
                    for g in group:
                        if g >= issued_upto[r]:
                            issued[(r, ins[g].peer)] += 1
                            issued_upto[r] = g + 1
                    if any(ins[g].op.startswith("SEND") and matched(r, ins[g].peer) <= kpos[r][g] for g in group):
                        break
                elif ins[j].op in ("FWD", "BWD", "WGRAD"):
                    ready = True
                    for g in group:
                        x = ins[g]
                        local, msg = _needs(OPCODES.index(x.op), x.mb, x.stage, S, placement, r)
                        if any(d not in computed for d in local):
                            ready = False
                        if msg is not None:
                            peer, k = recv_k[(r, *msg)]
                            if matched(r, peer) <= k:
                                ready = False
                    if not ready:
                        break
                    computed.update((OPCODES.index(ins[g].op), ins[g].mb, ins[g].stage) for g in group)
                pc[r] = end + 1
                issued_upto[r] = max(issued_upto[r], pc[r])
                progress = True
    stuck = [r for r in range(R) if pc[r] < len(instrs[r])]
    if stuck:
        at = ", ".join(f"rank {r} at `{instrs[r][pc[r]]}`" for r in stuck)
        return f"the program deadlocks when sends block until received: {at}"
    return None


def _memory_peaks(sched: Schedule, model: dict[str, np.ndarray]) -> list[float]:
    act, wact, par = model["act"], model["wact"], model["params"]
    out = []
    for r in range(sched.num_ranks):
        base = float(sum(par[s] for s in sched.stages_of(r)))
        live = peak = 0.0
        for o in sched.ops(r):
            if o.kind == "F":
                live += act[o.stage]
            elif o.kind == "B":
                live += (wact[o.stage] if sched.split_backward else 0.0) - act[o.stage]
            else:
                live -= wact[o.stage]
            peak = max(peak, live)
        out.append(float(base + peak))
    return out


def _timeline_check(prog: Program, costs, tl) -> float:
    """Check a simulated timeline against the program and costs; return the critical path."""
    S, m, placement = prog.num_stages, prog.num_microbatches, prog.placement
    eps = 1e-9 * max(1.0, float(tl.end.max()) if len(tl.end) else 1.0)
    events = {}
    for r, o, i, s, a, b in zip(
        tl.rank.tolist(), tl.op.tolist(), tl.mb.tolist(), tl.stage.tolist(), tl.start.tolist(), tl.end.tolist()
    ):
        if (o, i, s) in events:
            _fail(f"the simulation runs {OPCODES[o]} {i} {s} twice")
        events[(o, i, s)] = (r, a, b)
    want = {(OPCODES.index(x.op), x.mb, x.stage) for rp in prog.ranks for x in rp.instructions() if x.op in COMPUTE}
    if set(events) != want:
        _fail("the simulation does not run exactly the program's compute instructions")
    full_b = costs.B if prog.split_backward else costs.B + costs.W
    dur = {FWD: costs.F, BWD: full_b, WGRAD: costs.W}

    def wire(src_stage: int, a: int, b: int, kind: str) -> float:
        if a == b:
            return 0.0
        size = (costs.act_bytes if kind == "act" else costs.grad_bytes)[src_stage]
        bw = costs.bandwidth[a, b]
        return float(costs.comm[src_stage] + costs.latency[a, b] + (size / bw if np.isfinite(bw) and size else 0.0))

    for (o, i, s), (r, a, b) in events.items():
        if abs((b - a) - dur[o][s]) > eps:
            _fail(f"simulated {OPCODES[o]} {i} {s} takes {b - a:g}, its cost is {dur[o][s]:g}")
        local, msg = _needs(o, i, s, S, placement, r)
        for d in local:
            if a < events[d][2] - eps:
                _fail(f"simulated {OPCODES[o]} {i} {s} starts before {OPCODES[d[0]]} {d[1]} {d[2]} ends")
        if msg is not None:
            kind, _, src = msg
            d = (FWD if kind == "act" else BWD, i, src)
            dr, _, dend = events[d]
            if a < dend + wire(src, dr, r, kind) - eps:
                _fail(f"simulated {OPCODES[o]} {i} {s} starts before its input can arrive")
    for rp_index, rp in enumerate(prog.ranks):
        prev_end = 0.0
        for x in rp.instructions():
            if x.op in COMPUTE:
                _, a, b = events[(OPCODES.index(x.op), x.mb, x.stage)]
                if a < prev_end - eps:
                    _fail(f"rank {rp_index}: simulated `{x}` overlaps the compute before it")
                prev_end = b
    # Critical path: the longest chain of dependencies, with the least time each message can take.
    finish: dict[tuple[int, int, int], float] = {}
    for i in range(m):
        for s in range(S):
            t = 0.0
            if s > 0:
                t = finish[(FWD, i, s - 1)] + wire(s - 1, placement[s - 1], placement[s], "act")
            finish[(FWD, i, s)] = t + dur[FWD][s]
        for s in reversed(range(S)):
            t = finish[(FWD, i, s)]
            if s < S - 1:
                t = max(t, finish[(BWD, i, s + 1)] + wire(s + 1, placement[s + 1], placement[s], "grad"))
            finish[(BWD, i, s)] = t + dur[BWD][s]
            if prog.split_backward:
                finish[(WGRAD, i, s)] = finish[(BWD, i, s)] + dur[WGRAD][s]
    critical = max(finish.values(), default=0.0)
    busy = np.bincount(tl.rank, weights=tl.end - tl.start, minlength=prog.num_ranks)
    if tl.makespan < critical - eps:
        _fail(f"simulated makespan {tl.makespan:g} is below the critical path {critical:g}")
    if len(busy) and tl.makespan < float(busy.max()) - eps:
        _fail(f"simulated makespan {tl.makespan:g} is below the busiest rank's compute time {busy.max():g}")
    return critical


def _schedule_of(prog: Program) -> Schedule:
    """A Schedule with the program's shape (no ops): enough for the default cost model."""
    return Schedule(
        name=prog.name,
        params=prog.params,
        num_stages=prog.num_stages,
        num_ranks=prog.num_ranks,
        num_microbatches=prog.num_microbatches,
        kinds=("F", "B", "W") if prog.split_backward else ("F", "B"),
        placement=prog.placement,
        ranks=(),
    )


_PIPEC_CODES = ("E301", "E302", "E303", "E304", "E305", "E306", "E307", "E308", "E401", "E402", "E403", "E404")


def check_invariants(
    target: Schedule | Compiled | Program | Listing,
    memory: Mapping[str, float] | None = None,
    *,
    expectations: bool = True,
) -> Checked:
    """Check a schedule (or its compiled form, or a bare Program) by code independent of the compiler.

    For a schedule, pipec's own checks and lowering run first; their diagnostic is raised (PipecError)
    when the independent checks agree that the schedule is broken, and InvariantError when they
    disagree (pipec accepts a broken schedule or rejects a valid one). Then the Program, its strict
    rendezvous dry run, memory (`memory` overrides as in `pipec check --mem`), the simulated timeline
    under the schedule's costs, and (unless told not to) the schedule's `expect`s (E405).
    """
    from pipec.costs import cost_model
    from pipec.expect import check_expectations
    from pipec.memory import memory_model
    from pipec.simulate import simulate, stats

    if isinstance(target, Listing):
        target = target.build()
    if isinstance(target, Program):
        problem = program_problem(target)
        if problem:
            _fail(problem)
        sched = _schedule_of(target)
        costs = cost_model(sched)
        tl = simulate(target, costs)
        critical = _timeline_check(target, costs, tl)
        return Checked(0, target.num_instructions, len(tl.msg_send), tl.makespan, critical, 0)
    if isinstance(target, Compiled):
        sched, compiled = target.schedule, target
        problem = schedule_problem(sched)
        if problem:
            _fail(f"pipec compiled a schedule that is broken: {problem}")
    else:
        sched = target
        problem = schedule_problem(sched)
        over = []
        if problem is None or problem.startswith("deadlock"):
            model = memory_model(sched, memory)
            limit = model["limit"]
            peaks = _memory_peaks(sched, model)
            over = [r for r, peak in enumerate(peaks) if not np.isnan(limit[r]) and peak > limit[r] + 1e-9]
        # What pipec must say: E3xx for a broken schedule (checked first), then E402 (memory is checked
        # before deadlock), then E401.
        if problem is not None and not problem.startswith("deadlock"):
            expected, why = "E30", problem
        elif over:
            expected, why = "E402", f"rank {over[0]} is over its memory limit"
        elif problem is not None:
            expected, why = "E401", problem
        else:
            expected, why = None, None
        try:
            check_schedule(sched)
            compiled = compile_schedule(sched, memory)
        except PipecError as e:
            if e.code in _PIPEC_CODES and (expected is None or not e.code.startswith(expected)):
                said = e.diagnostics[0].message
                _fail(f"pipec reports {e.code} ({said}), but " + (why or "the schedule is valid and fits"))
            raise
        if expected is not None:
            _fail(f"pipec accepts a schedule it should reject ({expected}): {why}")
    prog = compiled.program
    problem = program_problem(prog, sched)
    if problem:
        _fail(f"the lowered program is wrong: {problem}")
    model = memory_model(sched, memory)
    peaks = _memory_peaks(sched, model)
    for rep in compiled.memory:
        if abs(rep.peak - peaks[rep.rank]) > 1e-9 * max(1.0, abs(peaks[rep.rank])):
            _fail(f"rank {rep.rank}: pipec's peak memory {rep.peak:g}, recomputed {peaks[rep.rank]:g}")
        if rep.limit is not None and rep.peak > rep.limit + 1e-9:
            _fail(f"rank {rep.rank}: peak memory {rep.peak:g} above its limit {rep.limit:g}")
    costs = cost_model(sched)
    tl = simulate(prog, costs)
    critical = _timeline_check(prog, costs, tl)
    n_expect = check_expectations(sched, prog, stats(tl)) if expectations else 0
    return Checked(sched.num_ops, prog.num_instructions, len(tl.msg_send), tl.makespan, critical, n_expect)


# ---- whole files: what `pipec test` and the pytest plugin run ------------------------------------------


def _fmt_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


@dataclass(frozen=True)
class Failure:
    """The smallest failing parameter set found for one schedule, and what went wrong there."""

    target: str  # the file (or library name) as given
    params: dict[str, object]
    kind: str  # a diagnostic code ("E401"); "invariant" (pipec disagrees with the independent checks);
    # "runtime" (the runtime's result differs from the reference); "crash"
    message: str  # the formatted diagnostic, or the explanation

    @property
    def command(self) -> str:
        """A command that shows the failure (for "invariant" and "crash" it shows what pipec itself says)."""
        if self.kind == "runtime":
            args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
            code = "from pipec.api import load; from pipec.testing import runtime_check; "
            code += f"runtime_check(load({self.target!r}{', ' + args if args else ''}))"
            return f"python -c {shlex.quote(code)}"
        defines = " ".join(f"-D {k}={_fmt_value(v)}" for k, v in self.params.items())
        return f"pipec check {shlex.quote(self.target)}" + (f" {defines}" if defines else "")

    @property
    def params_text(self) -> str:
        return " ".join(f"{k}={_fmt_value(v)}" for k, v in self.params.items()) or "(defaults)"


@dataclass(frozen=True)
class FileResult:
    target: str
    examples: int  # parameter sets checked
    space: int  # parameter sets within the bounds
    failure: Failure | None
    failing: int  # distinct failing parameter sets seen
    seconds: float
    runtime_checked: int = 0  # parameter sets also run on the runtime (--runtime)
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.failure is None


def find_schedule_files(paths: Iterable[str]) -> list[str]:
    """The .pipe files under these paths (directories are searched recursively), or library names as given."""
    out: list[str] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            out.extend(str(f) for f in sorted(path.rglob("*.pipe")))
        else:
            out.append(p)
    return list(dict.fromkeys(out))


def _check_point(source: Source, target: str, point: dict[str, object], runtime: bool) -> Failure | None | str:
    """None when the parameter set passes; "skip" when a `require` inside the rank block rejects it."""
    from pipec.api import build

    try:
        sched = build(source, point)
        check_invariants(sched)
        if runtime:
            runtime_check(sched)
    except PipecError as e:
        if e.code == "E202":
            return "skip"
        return Failure(target, point, e.code, "\n".join(d.format() for d in e.diagnostics))
    except InvariantError as e:
        return Failure(target, point, "runtime" if str(e).startswith("runtime") else "invariant", str(e))
    except Exception as e:  # a crash in pipec is a finding too
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-3))
        return Failure(target, point, "crash", f"{type(e).__name__}: {e}\n{tb}")
    return None


def runtime_check(target: Schedule | Compiled | Program, steps: int = 2, tol: float = 1e-10) -> float:
    """Train a tiny float64 model (a Linear and a Tanh per stage) on the runtime's `--local` mode and compare
    the loss and every gradient with a single-process reference after each step; InvariantError past
    `tol`. Returns the largest relative error. Needs torch (`pipec[runtime]`)."""
    import torch

    from pipec.runtime import LocalPipeline, Reference
    from pipec.runtime.reference import compare, rel_err

    if isinstance(target, Program):
        prog = target
    elif isinstance(target, Compiled):
        prog = target.program
    else:
        prog = compile_schedule(target).program
    width = 4

    def build_stage(stage: int, num_stages: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, target)

    options = dict(dtype=torch.float64, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    pipe = LocalPipeline(prog, build_stage, loss_fn, **options)
    ref = Reference(build_stage, loss_fn, prog.num_stages, prog.num_microbatches, **options)
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    rows = 2 * prog.num_microbatches
    for step in range(steps):
        x = torch.randn(rows, width, generator=gen, dtype=torch.float64)
        y = torch.randn(rows, width, generator=gen, dtype=torch.float64)
        loss = pipe.step(x, y).loss
        errs = {"loss": rel_err(loss, ref.step(x, y))}
        errs.update(
            {
                f"gradient of stage {s} {n}": e
                for (s, n), e in compare(pipe.named_gradients(), ref.named_gradients()).items()
            }
        )
        what, err = max(errs.items(), key=lambda kv: kv[1])
        worst = max(worst, err)
        if not err <= tol:
            where = f"runtime --local, step {step + 1}"
            _fail(f"{where}: the {what} differs from the reference by {err:.3g} (tolerance {tol:g})")
    return worst


def check_file(
    target: str,
    examples: int = 100,
    seed: int = 0,
    *,
    bounds: Mapping[str, Iterable] | None = None,
    fixed: Mapping[str, object] | None = None,
    runtime: bool = False,
    progress: Callable[[int, int], None] | None = None,
    max_scan: int = 500,
    runtime_cases: int = 3,
) -> FileResult:
    """Property-test one schedule file (or library name) over its bounded parameter space.

    hypothesis draws up to `examples` parameter sets from `params(target)` (seeded, no example
    database) and checks each with `check_invariants`; on a failure it shrinks, and then every smaller
    parameter set (up to `max_scan` of them) is checked in order, so the reported failure is the
    smallest of the bounded space. `progress(done, examples)` is called after each parameter set.
    With `runtime`, the `runtime_cases` smallest checked parameter sets with at least two ranks then
    also train on the runtime's `--local` mode (`runtime_check`).
    """
    import random

    hypothesis, st = _hypothesis()
    from pipec.library import read

    started = time.perf_counter()
    source = read(target)
    try:
        points = parameter_space(source, bounds, fixed)
    except PipecError as e:  # the file does not parse or type-check: every parameter set fails
        msg = "\n".join(d.format() for d in e.diagnostics)
        return FileResult(target, 0, 0, Failure(target, {}, e.code, msg), 1, time.perf_counter() - started)
    if not points:
        note = ("no parameter set within the bounds passes the schedule's `require`s",)
        return FileResult(target, 0, 0, None, 0, time.perf_counter() - started, notes=note)
    index = {tuple(sorted(p.items(), key=lambda kv: kv[0])): n for n, p in enumerate(points)}
    results: dict[int, Failure | None | str] = {}
    tried = [0]

    def run(n: int) -> Failure | None | str:
        if n not in results:
            results[n] = _check_point(source, target, points[n], False)
            tried[0] += 1
            if progress is not None:
                progress(min(tried[0], examples), examples)
        return results[n]

    def fails(point: dict) -> bool:
        res = run(index[tuple(sorted(point.items(), key=lambda kv: kv[0]))])
        return isinstance(res, Failure)

    settings = hypothesis.settings(
        max_examples=examples,
        database=None,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    try:
        found = hypothesis.find(_point_strategy(points, st), fails, settings=settings, random=random.Random(seed))
    except hypothesis.errors.NoSuchExample:
        found = None
    failure = None
    if found is not None:
        best = index[tuple(sorted(found.items(), key=lambda kv: kv[0]))]
        for n in range(min(best, max_scan)):  # points are sorted smallest first
            if isinstance(run(n), Failure):
                best = n
                break
        failure = results[best]
    failing = sum(isinstance(r, Failure) for r in results.values())
    on_runtime = 0
    if runtime and failure is None:
        small = [n for n in sorted(results) if results[n] is None and _ranks_of(points[n]) >= 2][:runtime_cases]
        for n in small:
            on_runtime += 1
            res = _check_point(source, target, points[n], True)
            if isinstance(res, Failure):
                failure, failing = res, 1
                break
    seconds = time.perf_counter() - started
    return FileResult(target, len(results), len(points), failure, failing, seconds, on_runtime)


def _ranks_of(point: Mapping[str, object]) -> int:
    p = point.get("p", 2)
    return p if isinstance(p, int) else 2
