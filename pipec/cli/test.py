"""`pipec test`: property-test schedules over their parameter space (pipec.testing)."""

from __future__ import annotations

import argparse
import sys

from pipec import options
from pipec.cli.args import Command, read_source
from pipec.cli.envelope import Misuse, emit
from pipec.errors import PipecError


def test_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", metavar="PATH", nargs="+", help=".pipe files, directories to search, or library names")
    p.add_argument(
        "--budget",
        type=options.duration,
        default=None,
        metavar="TIME",
        help="time per file, e.g. 30s, 2m, 500ms (default 30s; 5s where CI=true)",
    )
    p.add_argument(
        "--examples", type=options.integer, default=None, metavar="N", help="at most N parameter sets per file"
    )
    p.add_argument(
        "--seed", type=options.integer, default=0, metavar="S", help="random seed (default 0): runs are reproducible"
    )
    p.add_argument("--json", action="store_true", help="print the results and coverage as JSON")
    p.add_argument(
        "--range",
        dest="ranges",
        metavar="NAME=LO..HI",
        action="append",
        default=[],
        help="values of a parameter to try: LO..HI (half-open, as in `for`) or a list A,B,C (repeatable)",
    )
    options.add_define_argument(p, "fix a parameter to one value (repeatable)")
    p.add_argument("--runtime", action="store_true", help="also run small cases on the runtime (--local, needs torch)")


def _test_ranges(specs: list[str]) -> dict[str, list]:
    out: dict[str, list] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        lo, dots, hi = value.partition("..")
        try:
            if not sep or not name.strip():
                raise ValueError
            if dots:
                out[name.strip()] = list(range(options.integer(lo), options.integer(hi)))
            else:
                out[name.strip()] = [_number(x) for x in value.split(",")]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"--range expects NAME=LO..HI or NAME=A,B,C, got `{spec}`") from None
        if not out[name.strip()]:
            raise argparse.ArgumentTypeError(f"--range `{spec}` has no values")
    return out


def _number(text: str) -> int | float | bool:
    text = text.strip()
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        return float(text)


def cmd_test(args: argparse.Namespace) -> int:
    """Property-test schedules: every .pipe file under the paths (or library names) over its parameter
    space (p 1..32, m 1..max(12, 4p), v 1..4 and so on, within the schedule's `require`s; --range changes
    it), for --budget each (30 s; 5 s where CI=true): small sets first, boundaries (m < p, m = p, m = 2p - 1,
    p = 1, the edges of the `require`s) early, p = 32 within seconds. Each parameter set must pass `pipec
    check`, pipec.testing's independent checks and the schedule's own `expect`s; a failure is shrunk to the
    smallest failing parameter set and printed with a `pipec check` command that reproduces it, and the
    values each parameter took are listed. Exit status 1 when any file fails. See docs/testing.md."""
    import time

    try:
        from pipec.testing import check_file, find_schedule_files
        from pipec.testing.files import default_budget
    except ImportError as e:
        raise Misuse(str(e)) from None
    if args.examples is not None and args.examples < 1:
        raise Misuse("--examples must be at least 1")
    budget = args.budget if args.budget is not None or args.examples is not None else default_budget()
    if args.runtime:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            raise Misuse("--runtime needs torch: pip install 'pipec[runtime]'")
    try:
        ranges = _test_ranges(args.ranges)
    except argparse.ArgumentTypeError as e:
        raise Misuse(str(e)) from None
    files = find_schedule_files(args.paths)
    if not files:
        raise Misuse(f"no .pipe files under {' '.join(args.paths)}")
    # --range and -D apply to the files that declare the parameter; each must name one of some file.
    from pipec.frontend.load import compile_source

    declared: dict[str, set[str]] = {}
    for target in files:
        try:
            declared[target] = {prm.name for prm in compile_source(read_source(target)).params}
        except PipecError as e:
            if e.code == "E000":
                raise
            declared[target] = set()  # reported when the file is tested
    known = set().union(*declared.values())
    for name in [*ranges, *(k for k, _ in args.defines)]:
        if name not in known:
            raise Misuse(f"no schedule here has a parameter `{name}`")
    tty = sys.stderr.isatty()
    failed = 0
    results = []
    of = f" of {budget:g}" if budget is not None else ""
    for n, target in enumerate(files, 1):
        last = [time.monotonic()]

        def progress(done: int, seconds: float, target=target, n=n, last=last) -> None:
            now = time.monotonic()
            sets = f"{done} parameter set{'s' if done != 1 else ''}, {seconds:.0f}{of} s"
            if tty:
                print(f"\r\033[K[{n}/{len(files)}] {target}: {sets}", end="", file=sys.stderr, flush=True)
            elif now - last[0] >= 5.0:  # long runs: a line now and then
                print(f"  ... {target}: {sets}", file=sys.stderr, flush=True)
                last[0] = now

        try:
            res = check_file(
                target,
                args.examples,
                args.seed,
                budget=budget,
                bounds={k: v for k, v in ranges.items() if k in declared[target]},
                fixed={k: v for k, v in args.defines if k in declared[target]},
                runtime=args.runtime,
                progress=progress,
            )
        except ValueError as e:
            raise Misuse(f"{target}: {e}") from None
        finally:
            if tty:
                print("\r\033[K", end="", file=sys.stderr, flush=True)
        results.append(res)
        failed += not res.ok
        if args.json:
            continue
        what = res.sets_text
        if res.runtime_checked:
            what += f", {res.runtime_checked} on the runtime"
        if res.ok:
            print(f"{target}: ok ({what}, {res.seconds:.1f} s)")
            for note in res.notes:
                print(f"  note: {note}")
        else:  # a failure is a diagnostic: the whole report of it goes to stderr, as `pipec check`'s
            f = res.failure
            sys.stdout.flush()
            err = sys.stderr
            found = f"smallest of {res.failing} failing; {what}, {res.seconds:.1f} s"
            print(f"{target}: FAILED at {f.params_text} ({found})", file=err)
            if f.kind == "invariant":
                print(f"  pipec and the independent checks disagree: {f.message}", file=err)
            elif f.kind == "runtime":
                print(f"  {f.message}", file=err)
            elif f.kind == "crash":
                print("  pipec crashed: " + f.message.replace("\n", "\n  "), file=err)
            for line in f.message.splitlines() if f.kind not in ("invariant", "runtime", "crash") else ():
                print(f"  {line}", file=err)
            print(f"  reproduce: {f.command}", file=err)
        if res.coverage is not None and res.examples:
            print(f"  tried: {res.coverage.text()}", file=sys.stdout if res.ok else sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    ok = len(files) - failed
    if args.json:
        emit(args, {"files": [r.to_json() for r in results], "passed": ok, "failed": failed}, ok=not failed)
    else:
        print(f"{len(files)} file{'s' if len(files) != 1 else ''}: {ok} ok, {failed} failed")
    return 1 if failed else 0


TEST = Command("test", "property-test schedules over their parameter space", test_arguments, cmd_test)
