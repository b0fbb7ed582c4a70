"""Whole schedule files: what `pipec test` and the pytest plugin run (`check_file`), and the runtime's
gradient check of a schedule (`runtime_check`)."""

from __future__ import annotations

import shlex
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipec.passes.compiler import CompiledSchedule, compile_schedule
from pipec.errors import PipecError, Source
from pipec.schedule import Schedule
from pipec.program import (
    Program,
)
from pipec.testing.invariants import InvariantError, _fail, check_invariants
from pipec.testing.listing import _hypothesis
from pipec.testing.space import _point_strategy, parameter_space


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


def runtime_check(target: Schedule | CompiledSchedule | Program, steps: int = 2, tol: float = 1e-10) -> float:
    """Train a tiny float64 model (a Linear and a Tanh per stage) on the runtime's `--local` mode and compare
    the loss and every gradient with a single-process reference after each step; InvariantError past
    `tol`. Returns the largest relative error. Needs torch (`pipec[runtime]`)."""
    import torch

    from pipec.runtime import LocalPipeline, Reference
    from pipec.runtime.reference import compare, rel_err

    if isinstance(target, Program):
        prog = target
    elif isinstance(target, CompiledSchedule):
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
    from pipec.frontend.library import read

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
