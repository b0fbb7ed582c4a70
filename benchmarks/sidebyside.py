"""Side-by-side timing for the benchmarks: two (or more) systems in alternating rounds, medians, a ratio.

On a shared machine the load changes while a benchmark runs. Timing all of system A and then all of
system B lets a load spike land on one side only and decide the ratio; alternating them (A B A B ...)
gives both the same load, and medians ignore the odd slow round. Every record carries the load average
at its start and end, so a reader can tell a quiet run from a busy one.

    from sidebyside import compare, timed

    rec = compare("split_backward", {"full": timed(full), "split": timed(split)}, rounds=9, warmup=2)
    # prints one JSON line: medians, every round's seconds, ratio = median(full) / median(split), load

The API is small on purpose (other benchmarks import it): `timed`, `alternate`, `summarize`, `compare`,
`emit`, `load_average`.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Mapping

Run = Callable[[], float]  # one run of a system; returns the seconds it took (see `timed`)


def timed(fn: Callable[[], object]) -> Run:
    """Wrap a call so that a round measures its wall time with `time.perf_counter`."""

    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (zeros where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return [0.0, 0.0, 0.0]


def alternate(systems: Mapping[str, Run], rounds: int = 5, warmup: int = 0) -> dict[str, list[float]]:
    """Run the systems in turn, `rounds` times (A B A B ...), after `warmup` untimed turns of each.

    Each callable returns the seconds of its run, so a system may time itself (a fresh subprocess
    reporting its own figure, a multi-rank step's slowest rank) or be wrapped in `timed`."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    for _ in range(warmup):
        for run in systems.values():
            run()
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(rounds):
        for name, run in systems.items():
            seconds[name].append(float(run()))
    return seconds


def summarize(
    benchmark: str,
    seconds: Mapping[str, list[float]],
    ratio: tuple[str, str] | None = None,
    load_start: list[float] | None = None,
    **fields: object,
) -> dict:
    """One record: the median and every round's seconds per system, the ratio of two medians
    (`ratio=(a, b)` gives median(a) / median(b); default: the first two systems), the range of the
    per-round ratios (how much the load moved it), and the load average at start and end."""
    names = list(seconds)
    a, b = ratio or ((names[0], names[1]) if len(names) >= 2 else (None, None))
    rec: dict = {"benchmark": benchmark, **fields}
    rec["median_s"] = {n: round(statistics.median(v), 6) for n, v in seconds.items()}
    rec["runs_s"] = {n: [round(x, 6) for x in v] for n, v in seconds.items()}
    rec["rounds"] = min(len(v) for v in seconds.values())
    if a is not None:
        rec["ratio_of"] = f"{a} / {b}"
        rec["ratio"] = round(statistics.median(seconds[a]) / statistics.median(seconds[b]), 4)
        per_round = [x / y for x, y in zip(seconds[a], seconds[b]) if y > 0]
        if per_round:
            rec["ratio_range"] = [round(min(per_round), 4), round(max(per_round), 4)]
    if load_start is not None:
        rec["load_avg_start"] = load_start
    rec["load_avg"] = load_average()
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
    emit(rec)
    return rec


def emit(record: Mapping[str, object]) -> None:
    """Print one JSON line and flush (a benchmark's output is read line by line)."""
    print(json.dumps(record), flush=True)
