"""Fuzz every input pipec reads, at length: tests/unit/testing/test_fuzz.py's input kinds and its hypothesis properties.

    python benchmarks/fuzz.py                          # 10,000 inputs per kind, then 10,000 examples per property
    python benchmarks/fuzz.py --count 2000 --kind program-text --kind cost-toml
    python benchmarks/fuzz.py --count 500 --properties-only mutations   # as before: properties named *mutations*
    python benchmarks/fuzz.py 500 mutations                              # the same (the old form)
    python benchmarks/fuzz.py --smoke           # 3 inputs of one kind, 2 examples of one property (tests)

Input kinds (`KINDS` in tests/unit/testing/test_fuzz.py): pipe, cost-toml, cost-json, topology, torch-csv, program-json,
program-text. Input i of a kind is made from (kind, --seed, i) alone, so any one can be made again
(`make_input`). The inputs run in a worker subprocess; the parent gives each input `--timeout` seconds
(its own watchdog; the worker also has a SIGALRM one), kills a worker that overruns, counts a hang and
starts a new worker at the next input. One JSON line per kind: inputs, accepted, diagnostics by code,
tracebacks, wrong (accepted where a later stage refuses it with the wrong code), hangs (all three must be
0), seconds and `benchmarks/sidebyside`'s shared fields (load average, CPU time). Each failing input is written to
`--failures` (default fuzz-failures/ in the current folder) with its traceback, and the exit status is 1.

Properties: one JSON line per property, {"property", "examples", "seconds", "failures"}; on a failure
the falsifying example and its traceback go to stderr. Each property runs as consecutive hypothesis runs
of at most 1,000 examples (each with its own random seed): hypothesis keeps every choice of a run in
memory, and a run of 10,000 grammar-generated texts holds gigabytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sidebyside import emit, smoke_flag  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1_000
FAILED = ("traceback", "wrong", "hang")


def _test_module(examples: int = 100):
    os.environ["PIPEC_FUZZ_EXAMPLES"] = str(examples)  # read when the test module is imported
    for path in (ROOT, ROOT / "tests" / "support"):  # the test module imports the suite's helpers (`repo`)
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    spec = importlib.util.spec_from_file_location(
        "pipec_test_fuzz", ROOT / "tests" / "unit" / "testing" / "test_fuzz.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- input kinds ----------------------------------------------------------------


def worker(kind: str, seed: int, start: int, stop: int, timeout: float) -> int:
    """Run inputs start..stop-1 of a kind, one JSON line each on stdout: [i, outcome, details]."""
    module = _test_module()
    module.kind_seeds(kind)  # build the seeds before the first input's clock starts
    module._fixtures()
    print(json.dumps(["ready", "", ""]), flush=True)
    with tempfile.TemporaryDirectory(prefix="pipec-fuzz-") as folder:
        for i in range(start, stop):
            outcome, details = module.fuzz_one(kind, seed, i, folder, timeout=timeout)
            print(json.dumps([i, outcome, details]), flush=True)
    return 0


def _start(kind: str, seed: int, start: int, stop: int, timeout: float) -> subprocess.Popen:
    argv = [sys.executable, __file__, "--worker", kind, "--seed", str(seed), "--start", str(start)]
    argv += ["--stop", str(stop), "--timeout", str(timeout)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env, bufsize=1)


def _line(proc: subprocess.Popen, seconds: float) -> str | None:
    """The worker's next line, or None when it writes none within `seconds` (or has died)."""
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    if not ready:
        return None
    line = proc.stdout.readline()
    return line or None


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def fuzz_kind(kind: str, count: int, seed: int, timeout: float, failures: Path) -> dict:
    """Every input of one kind through workers; the record printed for it."""
    outcomes: Counter[str] = Counter()
    start = time.perf_counter()
    i = 0
    while i < count:
        proc = _start(kind, seed, i, count, timeout)
        if _line(proc, 300) is None:  # importing pipec and building the seeds
            _stop(proc)
            raise SystemExit(f"the {kind} worker did not start")
        while i < count:
            line = _line(proc, timeout + 10)  # the worker's own watchdog rings at `timeout`
            if line is None:
                _stop(proc)
                outcomes["hang"] += 1
                _keep(failures, kind, seed, i, "hang", f"no answer within {timeout + 10} s (the worker was killed)")
                i += 1
                break
            at, outcome, details = json.loads(line)
            assert at == i, (at, i)
            outcomes[outcome] += 1
            if outcome in FAILED:
                _keep(failures, kind, seed, i, outcome, details)
            i += 1
        else:
            proc.wait()
    codes = {k: v for k, v in sorted(outcomes.items()) if k.startswith("E")}
    return {
        "kind": kind,
        "inputs": count,
        "accepted": outcomes["accepted"],
        "diagnostics": sum(codes.values()),
        "codes": codes,
        "tracebacks": outcomes["traceback"],
        "wrong": outcomes["wrong"],
        "hangs": outcomes["hang"],
        "seconds": round(time.perf_counter() - start, 2),
        "seed": seed,
        "timeout_s": timeout,
    }


def _keep(failures: Path, kind: str, seed: int, i: int, outcome: str, details: str) -> None:
    """The failing input and what happened, for a regression test."""
    module = _test_module()
    suffix, text = module.make_input(kind, seed, i)
    failures.mkdir(parents=True, exist_ok=True)
    stem = failures / f"{kind}-{seed}-{i}"
    with open(stem.with_suffix(suffix), "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
    stem.with_suffix(".log").write_text(f"{outcome}\n{details}\n")
    print(f"{kind} input {i} (seed {seed}): {outcome}; kept as {stem}{suffix}", file=sys.stderr)


# ---- hypothesis properties ------------------------------------------------------------


def properties(examples: int, wanted: str) -> int:
    chunk = min(examples, CHUNK)
    module = _test_module(chunk)
    status = 0
    for name in module.PROPERTIES:
        if wanted not in name:
            continue
        start = time.perf_counter()
        failures = done = 0
        while done < examples and not failures:
            try:
                getattr(module, name)()
            except Exception:  # hypothesis re-raises the (shrunk) failure
                failures = 1
                status = 1
                traceback.print_exc()
            done += chunk
        seconds = round(time.perf_counter() - start, 2)
        record = {"property": name, "examples": done, "seconds": seconds, "failures": failures}
        emit({"benchmark": "fuzz_property", **record})
    return status


def main(argv: list[str]) -> int:
    if argv and argv[0].isdigit():  # the old form: EXAMPLES [NAME]
        return properties(int(argv[0]), argv[1] if len(argv) > 1 else "")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=10_000, help="inputs per kind, examples per property")
    p.add_argument("--kind", action="append", help="only this input kind (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one input may take before it is a hang")
    p.add_argument("--failures", type=Path, default=Path("fuzz-failures"))
    p.add_argument("--kinds-only", action="store_true", help="no hypothesis properties")
    p.add_argument("--properties-only", metavar="NAME", nargs="?", const="", default=None)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, default=0, help=argparse.SUPPRESS)
    smoke_flag(p)
    args = p.parse_args(argv)
    if args.smoke:  # 3 inputs of one kind, then 2 examples of one property: the format, in seconds
        args.count, args.kind = 3, ["pipe"]
        status = _kinds(args)
        return status | properties(2, "token_soup")
    if args.worker:
        return worker(args.worker, args.seed, args.start, args.stop, args.timeout)
    if args.properties_only is not None:
        return properties(args.count, args.properties_only)
    status = _kinds(args)
    if not args.kinds_only and not args.kind:
        status |= properties(args.count, "")
    return status


def _kinds(args: argparse.Namespace) -> int:
    """Fuzz the input kinds, one JSON line each; 1 if any input failed."""
    kinds = args.kind or list(_test_module().KINDS)
    status = 0
    for kind in kinds:
        record = fuzz_kind(kind, args.count, args.seed, args.timeout, args.failures)
        emit({"benchmark": "fuzz_kind", **record})
        if record["tracebacks"] or record["wrong"] or record["hangs"]:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
