"""The parameter sets a schedule file is tested over: the bounded space its `require`s allow
(`parameter_space`) and a hypothesis strategy over it that shrinks toward small p and m (`params`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
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
    from pipec.api import build, compile_source

    source = _source(schedule)
    compiled = compile_source(source)
    from pipec.frontend.evaluate import _parse_value

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
