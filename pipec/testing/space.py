"""The parameter sets a schedule file is tested over.

Two spaces: the small bounded one that the hypothesis strategy `params` draws from (`parameter_space`:
every set listed, so nothing is rejected and unit tests stay fast), and the one `pipec test` samples
within a time budget (`sample_space`, `Sampler`): p up to 32, m up to max(12, 4p), v up to 4, sampled
cheapest first with weight on the boundaries where schedules break."""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipec.errors import PipecError, Source
from pipec.testing.listing import _hypothesis

# Bounds of the parameters `params` draws, by name; other int parameters range over 0..max(4, 2 * default).
DEFAULT_BOUNDS: dict[str, range] = {"p": range(1, 7), "m": range(1, 13), "v": range(1, 4)}
MAX_POINTS = 20_000


def _source(schedule: str | Path | Source) -> Source:
    if isinstance(schedule, Source):
        return schedule
    from pipec.frontend.library import read

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
    from pipec.driver import build
    from pipec.frontend.load import compile_source

    source = _source(schedule)
    compiled = compile_source(source)
    from pipec.frontend.params import parse_value

    types = dict(zip((prm.name for prm in compiled.params), compiled.param_types))
    bounds = dict(bounds or {})
    for k in bounds:
        if k not in types:
            raise ValueError(f"the schedule has no parameter `{k}` (it takes: {', '.join(types) or 'none'})")
    for k, v in (fixed or {}).items():
        if k not in types:
            raise ValueError(f"the schedule has no parameter `{k}` (it takes: {', '.join(types) or 'none'})")
        bounds[k] = [parse_value(v, types[k]) if isinstance(v, str) else v]
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


# ---- the space `pipec test` samples ---------------------------------------------------------------------

# Production pipelines run p = 8, 16, 32 and hang at m < p (torchtitan #775, Megatron-LM #5100): the space
# `pipec test` samples reaches them. `params` keeps DEFAULT_BOUNDS, small, so that unit tests stay fast.
P_MAX = 32
V_MAX = 4
M_PER_P = 4  # m goes up to max(M_FLOOR, M_PER_P * p) for each p
M_FLOOR = 12
ENUMERATE_MAX = 16  # other parameters are enumerated when their values multiply to at most this; else drawn
BOUNDARY_BONUS = 4.0  # a set is tried as early as one BOUNDARY_BONUS times cheaper, per parameter at a boundary
# The ladder's passes: the m each takes at each boundary p (or the next m that passes the `require`s).
LADDER_M = (
    lambda p: 1,
    lambda p: p - 1,
    lambda p: p,
    lambda p: 2 * p - 1,
    lambda p: p + 1,
    lambda p: 2 * p,
    lambda p: 4 * p,
)
EDGE_STEPS = 8  # how far from an invalid boundary set to look for the edge of the `require` that rejects it


def m_limit(p: int) -> int:
    """The largest m the space takes with this p."""
    return max(M_FLOOR, M_PER_P * p)


def _scale(name: str, typ: str) -> bool:
    return typ == "int" and name in ("p", "m", "v")


def _p_boundary(p: int) -> bool:
    """p = 1, a power of two, or one less (an odd pipeline next to a common one)."""
    return p >= 1 and (p & (p - 1) == 0 or (p + 1) & p == 0)


@dataclass(frozen=True)
class Space:
    """The parameter sets `pipec test` samples for one schedule.

    `axes` are the values of the enumerated parameters (p 1..P_MAX, m 1..m_limit(P_MAX), v 1..V_MAX, and
    any other parameter whose values are few); when `m_scaled`, m only goes up to `m_limit(p)` with each p.
    The `drawn` parameters (the rest: `cut`, `g` of the cross-datacenter schedules) take one value per set,
    drawn at random (seeded) around the default they have there, so that they do not multiply the space.
    Sets that fail a top-level `require` are outside the space; they are found out lazily (`Sampler`),
    since evaluating the `require`s of every set of the space would cost seconds by itself.
    """

    names: tuple[str, ...]
    types: tuple[str, ...]
    axes: tuple[tuple[str, tuple], ...]
    drawn: tuple[str, ...] = ()
    m_scaled: bool = False

    @functools.cached_property
    def axis(self) -> dict[str, tuple]:
        return dict(self.axes)

    @functools.cached_property
    def _type(self) -> dict[str, str]:
        return dict(zip(self.names, self.types))

    @functools.cached_property
    def _members(self) -> tuple[dict[str, object], ...]:
        names = [n for n, _ in self.axes]
        out = []
        for combo in itertools.product(*(vals for _, vals in self.axes)):
            point = dict(zip(names, combo))
            if self.m_scaled and point["m"] > m_limit(point["p"]):
                continue
            out.append(point)
        return tuple(out)

    def members(self) -> list[dict[str, object]]:
        """Every set of the enumerated parameters, in declared order (the drawn ones left out)."""
        return [dict(pt) for pt in self._members]

    def size(self) -> int:
        return len(self._members)

    def contains(self, point: Mapping[str, object]) -> bool:
        if any(point.get(n) not in vals for n, vals in self.axes):
            return False
        return not (self.m_scaled and point["m"] > m_limit(point["p"]))

    def cost(self, point: Mapping[str, object]) -> float:
        """How long checking the set should take, up to a factor: ops grow as p x m x v."""
        out = 1.0
        for name, vals in self.axes:
            if _scale(name, self._type[name]):
                out *= max(1, int(point[name]))
            elif len(vals) > 1:
                out *= 1.0 + vals.index(point[name]) / len(vals)  # small values first
        return out

    def boundaries(self, point: Mapping[str, object]) -> int:
        """How many parameters of the set sit at a boundary where schedules break: p = 1, p a power of two
        or one less; m = 1, 2, p - 1, p, p + 1 (m < p and just past it), 2p - 1, 2p, 2p + 1, 3p, 4p; v = 1, 2;
        the ends of every axis."""
        n = 0
        for name, vals in self.axes:
            x = point[name]
            hi = vals[-1]
            if name == "m" and self.m_scaled:
                hi = min(hi, m_limit(point["p"]))
            if x == vals[0] or x == hi:
                n += 1
            elif isinstance(x, bool) or not isinstance(x, int):
                continue
            elif name == "p":
                n += _p_boundary(x)
            elif name == "m" and isinstance(point.get("p"), int):
                p = point["p"]
                n += x in (1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 4 * p)
            elif name == "v":
                n += x in (1, 2)
        return n

    def smaller(self, point: Mapping[str, object]) -> list[dict[str, object]]:
        """The sets smaller than this one in the shrinking order (`_size`), smallest first, with its drawn
        parameters."""
        key = _size(point)
        extra = {n: point[n] for n in self.drawn if n in point}
        out = [full for full in (self.complete(m, extra) for m in self._members) if _size(full) < key]
        out.sort(key=_size)
        return out

    def complete(self, member: Mapping[str, object], extra: Mapping[str, object]) -> dict[str, object]:
        """A member with the drawn parameters' values, in declared order."""
        merged = {**member, **extra}
        return {n: merged[n] for n in self.names if n in merged}


def sample_space(
    schedule: str | Path | Source,
    bounds: Mapping[str, Iterable] | None = None,
    fixed: Mapping[str, object] | None = None,
) -> Space:
    """The space `pipec test` samples for a schedule: p 1..32, m 1..max(12, 4p), v 1..4 (the values in
    `bounds` instead, where given; `fixed` pins a parameter), other parameters as `parameter_space` takes
    them, enumerated when they are few, else drawn per set (`Space`)."""
    from pipec.driver import build
    from pipec.frontend.load import compile_source
    from pipec.frontend.params import parse_value

    source = _source(schedule)
    compiled = compile_source(source)
    types = dict(zip((prm.name for prm in compiled.params), compiled.param_types))
    bounds = {k: list(v) for k, v in (bounds or {}).items()}
    for k in [*bounds, *(fixed or {})]:
        if k not in types:
            raise ValueError(f"the schedule has no parameter `{k}` (it takes: {', '.join(types) or 'none'})")
    for k, v in (fixed or {}).items():
        bounds[k] = [parse_value(v, types[k]) if isinstance(v, str) else v]
    try:
        defaults = dict(build(source, {}, check=False, ranks=()).params)
    except PipecError:  # a parameter without a default, or defaults that fail a `require`
        defaults = {}
    wide = {"p": range(1, P_MAX + 1), "m": range(1, m_limit(P_MAX) + 1), "v": range(1, V_MAX + 1)}
    axes, others = [], []
    for name, typ in types.items():
        if name in bounds:
            axes.append((name, tuple(bounds[name])))
        elif _scale(name, typ):
            axes.append((name, tuple(wide[name])))
        else:
            others.append((name, tuple(_values(name, typ, defaults.get(name), {}))))
    drawn: tuple[str, ...] = ()
    if int(np.prod([len(v) for _, v in others])) <= ENUMERATE_MAX:
        axes += others
    else:
        drawn = tuple(n for n, _ in others)
    order = list(types)
    axes.sort(key=lambda nv: order.index(nv[0]))
    scaled = "m" in types and "m" not in bounds and types.get("p") == "int" and "p" not in drawn
    return Space(tuple(types), tuple(types.values()), tuple(axes), drawn, scaled)


class Sampler:
    """The sets of a `Space` in the order `pipec test` checks them (iterate it); sets failing a top-level
    `require` are left out and counted (`rejected`), drawn parameters are filled in.

    Two streams, merged so that each has had about as much (estimated) checking time as the other:
    - everything, cheapest first, where a set's price is `Space.cost` over BOUNDARY_BONUS for each of its
      parameters at a boundary (`Space.boundaries`), times a seeded random factor between 1/2 and 2. Small
      sets come first, so that a failure is found small and shrinks fast, and boundary sets early; a
      boundary set that fails a `require` gives way to the nearest sets along each parameter that pass
      it, at the same price: the edges of the `require`;
    - a ladder up the pipeline degrees: for p = 1, 2, 3, 4, 7, 8, 15, 16, 31, 32 in turn, a set with the
      smallest m; then the sets with m = p - 1, m = p, m = 2p - 1, m = p + 1, m = 2p, m = 4p at each of
      those p, cheapest first (`_rungs`). The climb (the first pass) is not charged to the ladder's share,
      so it reaches p = 32 within its first ten or so sets even where the `require`s make every deep set
      large (zb-v's m >= 2p - 1, zeropp's m >= p) while the other stream's sets are tiny, and then covers
      the boundaries of m at every depth.
    """

    def __init__(self, space: Space, source: Source, seed: int = 0) -> None:
        self.space, self.source, self.seed = space, source, seed
        self._valid: dict[tuple, bool] = {}
        self._defaults: dict[tuple, dict] = {}
        members = space._members
        jitter = 2.0 ** np.random.default_rng(seed).uniform(-1.0, 1.0, len(members))
        self._heap = [(self._price(pt) * j, n, pt) for n, (pt, j) in enumerate(zip(members, jitter))]
        heapq.heapify(self._heap)
        self._count = len(members)
        self._done: set[tuple] = set()
        self._climb = 0  # rungs of the climb still at the head of the ladder (set by _rungs)
        self._ladder = self._rungs()
        self._spent = [0.0, 0.0]  # estimated cost yielded by each stream: everything, the ladder
        self.rejected = 0  # sets that failed a top-level `require`

    def _price(self, point: Mapping[str, object]) -> float:
        return self.space.cost(point) / BOUNDARY_BONUS ** self.space.boundaries(point)

    def _rungs(self) -> list[dict[str, object]]:
        """The ladder, a member per rung (before the `require`s): pass k takes each boundary p in turn with
        m = LADDER_M[k](p) or the next m the space has, v the (k + 1)-th value of its axis (v = 2 first, where
        a schedule has v), and the smallest value of any other parameter."""
        ps = self.space.axis.get("p", ())
        rungs = sorted({p for p in ps if isinstance(p, int) and not isinstance(p, bool) and _p_boundary(p)})
        if not rungs:
            return []
        by_p: dict[object, list[dict[str, object]]] = {}
        for member in self.space._members:
            by_p.setdefault(member["p"], []).append(member)
        passes: list[list[list[dict[str, object]]]] = []
        for k, target in enumerate(LADDER_M):
            out: list[list[dict[str, object]]] = []
            passes.append(out)
            for p in rungs:
                fixed = {
                    name: vals[(k + 1) % len(vals)] if name == "v" else vals[0]
                    for name, vals in self.space.axes
                    if name not in ("p", "m")
                }
                want = target(p)
                pool = [
                    mb
                    for mb in by_p.get(p, ())
                    if all(mb[n] == v for n, v in fixed.items()) and ("m" not in mb or mb["m"] >= want)
                ]
                pool.sort(key=lambda mb: (mb.get("m", 0), self.space.cost(mb)))
                if pool:
                    out.append(pool)
        rest = sorted((pool for out in passes[1:] for pool in out), key=lambda pool: self.space.cost(pool[0]))
        self._climb = len(passes[0])
        return passes[0] + rest  # pass 0 climbs in order of p; the others go cheapest first

    def _ladder_turn(self) -> bool:
        return bool(self._ladder) and (self._spent[1] <= self._spent[0] or not self._heap)

    def peek_cost(self) -> float | None:
        """`Space.cost` of the next set, None when none is left (its `require`s are not evaluated yet)."""
        if self._ladder_turn():
            return self.space.cost(self._ladder[0][0])
        return self.space.cost(self._heap[0][2]) if self._heap else None

    def skip(self) -> None:
        """Drop the next set unchecked (it would not fit in the time left)."""
        if self._ladder_turn():
            self._ladder.pop(0)
            self._climb = max(0, self._climb - 1)
        elif self._heap:
            _, _, pt = heapq.heappop(self._heap)
            self._done.add(_key(pt))

    def __iter__(self) -> Iterator[dict[str, object]]:
        return self

    def __next__(self) -> dict[str, object]:
        while self._ladder_turn():
            climbing, self._climb = self._climb > 0, max(0, self._climb - 1)
            for member in self._ladder.pop(0):  # the rung's set: the first that passes the `require`s
                key = _key(member)
                if key in self._done:
                    if self._valid.get(key, False):
                        break  # the other stream has had it
                    continue
                self._done.add(key)
                full = self.fill(member)
                if full is not None:
                    self._spent[1] += 0.0 if climbing else self.space.cost(member)
                    return full
                self.rejected += 1
        while self._heap:
            price, _, member = heapq.heappop(self._heap)
            key = _key(member)
            if key in self._done:
                continue
            self._done.add(key)
            full = self.fill(member)
            if full is not None:
                self._spent[0] += self.space.cost(member)
                return full
            self.rejected += 1
            if self.space.boundaries(member):
                for edge in self._edges(member):
                    self._count += 1
                    heapq.heappush(self._heap, (price, self._count, edge))
        raise StopIteration

    def valid(self, point: Mapping[str, object]) -> bool:
        """Whether the set passes the schedule's top-level `require`s (memoised)."""
        from pipec.driver import build

        key = _key(point)
        if key not in self._valid:
            try:
                sched = build(self.source, point, check=False, ranks=())
                self._defaults[key] = dict(sched.params)
                self._valid[key] = True
            except PipecError as e:
                self._valid[key] = e.code != "E202"  # other errors are findings: the check reports them
        return self._valid[key]

    def defaults(self, point: Mapping[str, object]) -> dict[str, object]:
        """Every parameter's value in this set, the defaults included (empty when it is not valid)."""
        return self._defaults.get(_key(point), {}) if self.valid(point) else {}

    def fill(self, member: Mapping[str, object]) -> dict[str, object] | None:
        """The member with its drawn parameters, or None when no such set passes the `require`s: each
        drawn parameter keeps the default it has there, or (one time in two) takes a random value of
        `parameter_space`'s range around it."""
        if not self.valid(member):  # with the drawn parameters at their defaults
            return None
        if not self.space.drawn:
            return dict(member)
        here = self.defaults(member)
        rnd = random.Random(f"{self.seed}:{sorted(member.items())}")
        for attempt in range(4):
            extra = {}
            for name in self.space.drawn:
                default = here.get(name)
                values = _values(name, self.space._type[name], default, {})
                keep = default is not None and (attempt == 3 or rnd.random() < 0.5)
                extra[name] = default if keep else rnd.choice(values)
            full = self.space.complete(member, extra)
            if self.valid(full):
                return full
        return None

    def _edges(self, member: Mapping[str, object]) -> list[dict[str, object]]:
        """The nearest members that pass the `require`s, within EDGE_STEPS of this one along each axis."""
        out = []
        for name, vals in self.space.axes:
            at = vals.index(member[name])
            for step in (-1, 1):
                for k in range(1, EDGE_STEPS + 1):
                    j = at + step * k
                    if not 0 <= j < len(vals):
                        break
                    other = {**member, name: vals[j]}
                    if not self.space.contains(other):
                        break
                    if self.valid(other):
                        out.append(other)
                        break
        return out


def _key(point: Mapping[str, object]) -> tuple:
    return tuple(sorted(point.items()))
