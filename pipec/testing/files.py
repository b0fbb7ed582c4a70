"""Whole schedule files: what `pipec test` and the pytest plugin run (`check_file`), and the runtime's
gradient check of a schedule (`runtime_check`)."""

from __future__ import annotations

import os
import shlex
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipec.errors import PipecError, Source
from pipec.ir.program import (
    Program,
)
from pipec.ir.schedule import Schedule
from pipec.passes.compiler import CompiledSchedule, compile_schedule
from pipec.testing.invariants import InvariantError, _fail, check_invariants
from pipec.testing.space import Sampler, Space, _key, _size, _values, sample_space


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


DEFAULT_BUDGET = 30.0  # seconds per schedule file
CI_BUDGET = 5.0  # where CI=true: CI machines test the whole library on every push


def default_budget() -> float:
    """Seconds per schedule file when none is given: DEFAULT_BUDGET, or CI_BUDGET where CI=true."""
    return CI_BUDGET if os.environ.get("CI", "").strip().lower() in ("true", "1") else DEFAULT_BUDGET


@dataclass(frozen=True)
class Coverage:
    """Which parameter sets a run checked: the values of each parameter, with how many sets had each."""

    counts: tuple[tuple[str, tuple[tuple[object, int], ...]], ...]  # per parameter: (value, sets), by value
    largest: tuple[tuple[str, object], ...] = ()  # the checked set with the largest p x m (largest size if no p, m)
    rejected: int = 0  # sets of the space that a `require` rejects
    space: int = 0  # sets of the enumerated space, before the `require`s
    exhausted: bool = False  # every set of the space was checked (or rejected)

    def values(self, name: str) -> dict[object, int]:
        return dict(dict(self.counts).get(name, ()))

    def text(self) -> str:
        """One line: p's values with their counts, the others' ranges, the largest p x m."""
        parts = []
        for name, pairs in self.counts:
            vals = [v for v, _ in pairs]
            if not vals:
                continue
            span = _fmt_value(vals[0]) if len(vals) == 1 else f"{_fmt_value(vals[0])}..{_fmt_value(vals[-1])}"
            if name == "p" or len(vals) <= 4:
                counts = " ".join(f"{_fmt_value(v)}:{n}" for v, n in pairs)
                parts.append(f"{name} {span} ({counts})" if len(vals) > 1 else f"{name} {span}")
            else:
                parts.append(f"{name} {span} ({len(vals)} values)")
        line = ", ".join(parts) or "(no parameters)"
        big = dict(self.largest)
        if "p" in big and "m" in big:
            line += f"; largest p x m: {big['p']} x {big['m']}"
        return line

    def to_json(self) -> dict[str, object]:
        return {
            "values": {name: {_fmt_value(v): n for v, n in pairs} for name, pairs in self.counts},
            "largest": dict(self.largest),
            "rejected": self.rejected,
            "space": self.space,
            "exhausted": self.exhausted,
        }


def _coverage(points: Iterable[Mapping[str, object]], names, rejected: int, space: int, exhausted: bool) -> Coverage:
    points = list(points)
    counts = []
    for name in names:
        c = Counter(pt[name] for pt in points if name in pt)
        counts.append((name, tuple(sorted(c.items(), key=lambda kv: (isinstance(kv[0], str), kv[0])))))

    def size(pt):
        p, m = pt.get("p"), pt.get("m")
        if isinstance(p, int) and isinstance(m, int):
            return (p * m, p)
        return (_size(pt)[0], 0)

    largest = tuple(max(points, key=size).items()) if points else ()
    return Coverage(tuple(counts), largest, rejected, space, exhausted)


@dataclass(frozen=True)
class FileResult:
    """What `check_file` found for one schedule file: how many parameter sets it checked, of how many, and the
    first failure (shrunk), with the values each parameter took (`coverage`)."""

    target: str
    examples: int  # parameter sets checked
    space: int  # parameter sets of the enumerated space, before the `require`s
    failure: Failure | None
    failing: int  # distinct failing parameter sets seen
    seconds: float
    runtime_checked: int = 0  # parameter sets also run on the runtime (--runtime)
    notes: tuple[str, ...] = field(default=())
    coverage: Coverage | None = None
    budget: float | None = None  # seconds it was given; None: a count (`examples`)

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def sets_text(self) -> str:
        """ "312 parameter sets", or "all 72 parameter sets" when the space was exhausted."""
        n = f"{self.examples:,} parameter set{'s' if self.examples != 1 else ''}"
        return f"all {n}" if self.coverage is not None and self.coverage.exhausted and self.examples > 1 else n

    def to_json(self) -> dict[str, object]:
        """What `pipec test --json` prints for the file."""
        out: dict[str, object] = {
            "target": self.target,
            "ok": self.ok,
            "checked": self.examples,
            "space": self.space,
            "seconds": round(self.seconds, 3),
            "budget": self.budget,
            "runtime_checked": self.runtime_checked,
            "coverage": self.coverage.to_json() if self.coverage is not None else None,
            "notes": list(self.notes),
        }
        if self.failure is not None:
            f = self.failure
            out["failure"] = {
                "params": f.params,
                "kind": f.kind,
                "message": f.message,
                "command": f.command,
                "failing": self.failing,
            }
        return out


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
    from pipec.driver import build

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


def runtime_check(target: Schedule | CompiledSchedule | Program, steps: int = 2, tol: float = 1e-10) -> float:
    """Train a tiny float64 model (a Linear and a Tanh per stage) on the runtime's `--local` mode and compare
    the loss and every gradient with a single-process reference after each step; InvariantError past
    `tol`. Returns the largest relative error. Needs torch (`pipec[runtime]`).

    On a stage graph (the Program's `graph`) a stage with several in-edges has a Linear per input, in the
    order of `graph.inputs(s)`, summed before its Tanh (so inputs spread in another order give other
    gradients), a fan-out sends its one output on every edge, and the reference runs the same graph."""
    import torch

    from pipec.runtime import LocalPipeline, Reference, StageOptions
    from pipec.runtime.reference import compare, rel_err

    if isinstance(target, Program):
        prog = target
    elif isinstance(target, CompiledSchedule):
        prog = target.program
    else:
        prog = compile_schedule(target).program
    width = 4
    graph = prog.graph if prog.graph is not None and not prog.graph.is_chain else None

    class FanIn(torch.nn.Module):
        """tanh(sum_k W_k x_k): one Linear per in-edge, in edge order."""

        def __init__(self, n: int) -> None:
            super().__init__()
            self.ins = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))

        def forward(self, *xs: torch.Tensor) -> torch.Tensor:
            if len(xs) != len(self.ins):
                raise TypeError(f"takes {len(self.ins)} inputs, got {len(xs)}")
            return torch.tanh(sum(lin(x) for lin, x in zip(self.ins, xs)))

    def build_stage(stage: int, num_stages: int) -> torch.nn.Module:
        n = len(graph.inputs(stage)) if graph is not None else 1
        if n > 1:
            return FanIn(n)
        return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, target)

    options = dict(dtype=torch.float64, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    pipe = LocalPipeline(prog, build_stage, loss_fn, options=StageOptions(**options))
    ref = Reference(build_stage, loss_fn, prog.num_stages, prog.num_microbatches, graph=graph, **options)
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
    examples: int | None = None,
    seed: int = 0,
    *,
    budget: float | None = None,
    bounds: Mapping[str, Iterable] | None = None,
    fixed: Mapping[str, object] | None = None,
    runtime: bool = False,
    progress: Callable[[int, float], None] | None = None,
    max_scan: int = 500,
    runtime_cases: int = 3,
) -> FileResult:
    """Property-test one schedule file (or library name) over the space `pipec test` samples.

    Parameter sets come from `space.Sampler` (cheapest first, boundaries early, a ladder up to p = 32)
    and each is checked with `check_invariants`, until `budget` seconds are spent (a set predicted not to
    fit in the time left is passed over), `examples` sets are checked, or the space is exhausted; with
    neither given, the budget is `default_budget()`. On the first failure the search stops and shrinks
    it: each parameter in turn goes to its smallest value that still fails, then every smaller set is
    checked in order (up to `max_scan` new checks), then each parameter again. The search does not
    depend on the time the checks take, only on where the budget cuts it. `progress(checked, seconds)`
    is called after each set. With `runtime`, the `runtime_cases` smallest checked sets with at least
    two ranks also train on the runtime's `--local` mode (`runtime_check`).
    """
    from pipec.frontend.library import read

    started = time.perf_counter()
    if examples is None and budget is None:
        budget = default_budget()
    source = read(target)
    try:
        space = sample_space(source, bounds, fixed)
    except PipecError as e:  # the file does not parse or type-check: every parameter set fails
        msg = "\n".join(d.format() for d in e.diagnostics)
        return FileResult(target, 0, 0, Failure(target, {}, e.code, msg), 1, time.perf_counter() - started)
    sampler = Sampler(space, source, seed)
    results: dict[tuple, Failure | None | str] = {}
    checked: list[dict[str, object]] = []
    rate = [0.0]  # seconds per unit of `Space.cost`, the worst seen on sets of some size

    def run(point: dict[str, object]) -> Failure | None | str:
        key = _key(point)
        if key not in results:
            t0 = time.perf_counter()
            results[key] = res = _check_point(source, target, point, False)
            cost = space.cost(point)
            if cost >= 64:
                rate[0] = max(rate[0], (time.perf_counter() - t0) / cost)
            if res == "skip":
                sampler.rejected += 1
            else:
                checked.append(point)
                if progress is not None:
                    progress(len(checked), time.perf_counter() - started)
        return results[key]

    deadline = None if budget is None else started + budget
    passed_over = 0
    found = None
    while examples is None or len(checked) < examples:
        cost = sampler.peek_cost()
        if cost is None:
            break
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            if rate[0] * cost > left:
                sampler.skip()
                passed_over += 1
                continue
        try:
            point = next(sampler)
        except StopIteration:
            break
        if isinstance(run(point), Failure):
            found = point
            break
    exhausted = found is None and sampler.peek_cost() is None and not passed_over
    failure = None
    if found is not None:
        failure = results[_key(_shrink(found, space, sampler, run, results, max_scan))]
    failing = sum(isinstance(r, Failure) for r in results.values())
    on_runtime = 0
    if runtime and failure is None:
        small = sorted((pt for pt in checked if results[_key(pt)] is None and _ranks_of(pt) >= 2), key=_size)
        for point in small[:runtime_cases]:
            on_runtime += 1
            res = _check_point(source, target, point, True)
            if isinstance(res, Failure):
                failure, failing = res, 1
                break
    coverage = _coverage(checked, space.names, sampler.rejected, space.size(), exhausted)
    notes: tuple[str, ...] = ()
    if not checked and failure is None:
        notes = ("no parameter set within the bounds passes the schedule's `require`s",)
    seconds = time.perf_counter() - started
    return FileResult(
        target, len(checked), space.size(), failure, failing, seconds, on_runtime, notes, coverage, budget
    )


def _shrink(
    point: dict[str, object], space: Space, sampler: Sampler, run: Callable, results: Mapping, max_scan: int
) -> dict[str, object]:
    """The smallest failing set found from a failing one (see `check_file`)."""

    def fails(pt: dict[str, object]) -> bool:
        return space.contains(pt) and sampler.valid(pt) and isinstance(run(pt), Failure)

    def descend(best: dict[str, object]) -> dict[str, object]:
        moved = True
        while moved:
            moved = False
            for name in space.names:
                for value in _smaller_values(space, sampler, best, name):
                    trial = {**best, name: value}
                    if fails(trial):
                        best, moved = trial, True
                        break
        return best

    best = descend(point)
    fresh = 0
    for trial in space.smaller(best):
        if fresh >= max_scan:
            break
        fresh += _key(trial) not in results
        if fails(trial):
            best = descend(trial)
            break
    return best


def _smaller_values(space: Space, sampler: Sampler, point: Mapping[str, object], name: str) -> list:
    """The values below the set's value of `name` that the shrinker tries, smallest first."""
    value = point.get(name)
    if value is None or isinstance(value, str):
        return []
    if name in space.axis:
        vals = space.axis[name]
    else:  # a drawn parameter: the range it is drawn from there
        typ = space._type[name]
        vals = tuple(_values(name, typ, sampler.defaults({n: point[n] for n in space.axis}).get(name), {}))
    return sorted((v for v in vals if v < value), key=lambda v: (v,))


def _ranks_of(point: Mapping[str, object]) -> int:
    p = point.get("p", 2)
    return p if isinstance(p, int) else 2
