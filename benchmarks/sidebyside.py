"""The shared helper of every benchmark: the JSON line, the load average, CPU beside wall time, ABBA rounds.

On a shared machine the load changes while a benchmark runs. Timing all of system A and then all of
system B lets a load spike land on one side only and decide the ratio; alternating them gives both the
same load, and medians ignore the odd slow round. Plain alternation (A B A B ...) still puts A first in
every round, and the first run of a round is the one that pays for what the previous round left behind
(a cold cache, a page-faulting heap, a rank still finishing its teardown): that cost lands on A every
time. `alternate` therefore runs the rounds in ABBA order (A B, B A, A B, ...), so over an even number of
rounds each system goes first equally often and a first-run cost is shared.

Every record carries the load average at its start and end (`load_avg_start`, `load_avg_end`), the wall
and CPU time spent producing it (`record_wall_s`, `record_cpu_s`: this process and the children it waited
for; `record_main_cpu_s`: this process's main thread), and the benchmark's name, so a reader can tell a
quiet run from a busy one and a CPU-bound figure from one that waited. A side-by-side record carries the
ratio of two medians and, next to it, the spread of the per-round ratios (`ratio_range`: min and max;
`ratio_iqr`: the quartiles), so a reader can tell a gap from noise.

    from sidebyside import compare, timed

    rec = compare("split_backward", {"full": timed(full), "split": timed(split)}, rounds=9, warmup=2)
    # prints one JSON line: medians, every round's seconds, ratio = median(full) / median(split), its
    # spread over the rounds, CPU medians and their ratio, load, the record's own wall and CPU time

The API is small on purpose (every benchmark imports it): `Timing`, `timed`, `run_process`, `alternate`, `summarize`,
`compare`, `emit`, `load_average`, `smoke_flag`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class Timing:
    """One run of a system: its wall time, and its CPU time where the system measured it.

    `cpu`: the CPU seconds of every process that did the work (a multi-rank step: the sum over ranks);
    `main_cpu`: the main threads' CPU seconds alone (what a Python dispatch loop costs, without the
    communication threads that mostly wait)."""

    wall: float
    cpu: float | None = None
    main_cpu: float | None = None


Run = Callable[[], "float | Timing"]  # one run of a system; returns its seconds or its Timing (see `timed`)


def timed(fn: Callable[[], object]) -> Run:
    """Wrap a call so that a round measures its wall time, this process's CPU time and the main thread's."""

    def run() -> Timing:
        c0, m0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        fn()
        t1, m1, c1 = time.perf_counter(), time.thread_time(), time.process_time()
        return Timing(t1 - t0, c1 - c0, m1 - m0)

    return run


def run_process(argv: Sequence[str], stdout: str | None = None, env: Mapping[str, str] | None = None) -> Timing:
    """Run a fresh process to completion (its standard output to the file `stdout`, or discarded; check=True)
    and return its wall time and its CPU time (user + system, from the kernel's accounting of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(stdout or os.devnull, "w") as out:
        t0 = time.perf_counter()
        subprocess.run(list(argv), stdout=out, check=True, env=None if env is None else dict(env))
        wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timing(wall, cpu)


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (zeros where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return [0.0, 0.0, 0.0]


def _clock() -> tuple[float, float, float]:
    """(wall, CPU of this process and its waited-for children, main-thread CPU), for a record's cost."""
    t = os.times()
    return time.perf_counter(), t.user + t.system + t.children_user + t.children_system, time.thread_time()


_last_load = load_average()  # the load when the previous record was printed (or when the script started)
_last_clock = _clock()


def alternate(systems: Mapping[str, Run], rounds: int = 5, warmup: int = 0) -> dict[str, list]:
    """Run the systems `rounds` times in ABBA order (A B, B A, A B, ...) after `warmup` untimed turns of each.

    Returns each system's results (seconds or `Timing`, as its callable returns them) in round order, so
    the i-th results of two systems come from the same round and can be paired. Each callable may time
    itself (a fresh subprocess reporting its own figure, a multi-rank step's slowest rank) or be wrapped
    in `timed`. With more than two systems the odd rounds run them in reverse order."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    names = list(systems)
    for _ in range(warmup):
        for run in systems.values():
            run()
    results: dict[str, list] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            res = systems[name]()
            results[name].append(res if isinstance(res, Timing) else float(res))
    return results


def _part(values: Sequence[float | Timing], field: str) -> list[float] | None:
    """One field of every run (None if any run lacks it)."""
    out = []
    for v in values:
        x = getattr(v, field) if isinstance(v, Timing) else (v if field == "wall" else None)
        if x is None:
            return None
        out.append(float(x))
    return out


def _quartiles(xs: list[float]) -> list[float]:
    if len(xs) < 2:
        return [xs[0], xs[0]]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]


def ratio_fields(a: Sequence[float], b: Sequence[float], suffix: str = "") -> dict:
    """`ratio` = median(a) / median(b) and its spread over the paired rounds: `ratio_range` (min, max),
    `ratio_iqr` (first and third quartiles) and `ratio_rounds` (every round's a / b), each with `suffix`."""
    rec: dict = {f"ratio{suffix}": round(statistics.median(a) / statistics.median(b), 4)}
    per_round = [x / y for x, y in zip(a, b) if y > 0]
    if per_round:
        rec[f"ratio{suffix}_range"] = [round(min(per_round), 4), round(max(per_round), 4)]
        rec[f"ratio{suffix}_iqr"] = [round(q, 4) for q in _quartiles(per_round)]
        rec[f"ratio{suffix}_rounds"] = [round(x, 4) for x in per_round]
    return rec


def summarize(
    benchmark: str,
    seconds: Mapping[str, Sequence[float | Timing]],
    ratio: tuple[str, str] | None = None,
    load_start: list[float] | None = None,
    **fields: object,
) -> dict:
    """One record: per system the median and every round's wall seconds (`median_s`, `runs_s`), and where
    the runs measured CPU the same for CPU (`median_cpu_s`, `median_main_cpu_s`); the ratio of two medians
    (`ratio=(a, b)` gives median(a) / median(b); default: the first two systems) with its spread over the
    rounds (`ratio_fields`), and `ratio_cpu` / `ratio_main_cpu` likewise where both sides measured CPU."""
    names = list(seconds)
    a, b = ratio or ((names[0], names[1]) if len(names) >= 2 else (None, None))
    rec: dict = {"benchmark": benchmark, **fields}
    wall = {n: _part(v, "wall") for n, v in seconds.items()}
    rec["median_s"] = {n: round(statistics.median(v), 6) for n, v in wall.items()}
    rec["runs_s"] = {n: [round(x, 6) for x in v] for n, v in wall.items()}
    rec["rounds"] = min(len(v) for v in seconds.values())
    extra: dict = {}
    for field, key in (("cpu", "cpu"), ("main_cpu", "main_cpu")):
        parts = {n: _part(v, field) for n, v in seconds.items()}
        parts = {n: p for n, p in parts.items() if p}
        if parts:
            rec[f"median_{key}_s"] = {n: round(statistics.median(p), 6) for n, p in parts.items()}
        if a is not None and parts.get(a) and parts.get(b):
            extra.update(ratio_fields(parts[a], parts[b], f"_{key}"))
    if a is not None:
        rec["ratio_of"] = f"{a} / {b}"
        rec.update(ratio_fields(wall[a], wall[b]))
        rec.update(extra)
    if load_start is not None:
        rec["load_avg_start"] = load_start
    return rec


def compare(
    benchmark: str,
    systems: Mapping[str, Run],
    rounds: int = 5,
    warmup: int = 0,
    ratio: tuple[str, str] | None = None,
    **fields: object,
) -> dict:
    """`alternate`, then `summarize`, then `emit`: the usual benchmark line. Returns the record."""
    start = load_average()
    rec = summarize(benchmark, alternate(systems, rounds, warmup), ratio, start, **fields)
    return emit(rec)


def emit(record: Mapping[str, object], file: TextIO | None = None) -> dict:
    """Print one JSON line (to `file`, default standard output) and flush (a benchmark's output is read line
    by line); return what was printed.

    Adds the shared fields where the record lacks them: `benchmark` (the script's name), `load_avg_start`
    (the load when the previous record was printed, or when the script started), `load_avg_end` (now),
    and the wall and CPU time spent since then (`record_wall_s`, `record_cpu_s`, `record_main_cpu_s`)."""
    global _last_load, _last_clock
    now_load, now_clock = load_average(), _clock()
    rec = dict(record)
    rec.setdefault("benchmark", os.path.splitext(os.path.basename(sys.argv[0] or "benchmark"))[0])
    rec.setdefault("load_avg_start", _last_load)
    rec.setdefault("load_avg_end", now_load)
    for key, i in (("record_wall_s", 0), ("record_cpu_s", 1), ("record_main_cpu_s", 2)):
        rec.setdefault(key, round(now_clock[i] - _last_clock[i], 6))
    print(json.dumps(rec), file=file or sys.stdout, flush=True)
    _last_load, _last_clock = now_load, _clock()
    return rec


def smoke_flag(ap: argparse.ArgumentParser) -> None:
    """Add `--smoke`: the benchmark's smallest configuration (1 round, the smallest sizes), seconds long,
    printing its lines in the real format; tests/features/test_benchmarks_smoke.py runs every benchmark so."""
    ap.add_argument("--smoke", action="store_true", help="smallest configuration, seconds long (the test suite's)")
