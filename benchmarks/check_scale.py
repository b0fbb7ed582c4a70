"""`pipec check` time per op as the pipeline deepens: flat from p=100 to p=10,000 (issue 32, item 4).

A check of 1F1B with m=2 at each p, in a fresh process (`pipec check 1f1b -D p=P -D m=2`: parse,
evaluate, every check, the lowering with its rendezvous dry run, and the simulation of its `expect`
lines), so its ops grow as 4p. One JSON line per p with the wall and CPU seconds of the process (import
included), the same less a bare `pipec check` at p=2 (the start-up), and that per op: flat per op means
linear in p. Beside it, the marginal CPU per op: the CPU added from one depth to the next over the ops added,
which the start-up's run-to-run noise does not swamp at small p. The issue's case: the check was quadratic
in p (p=1,000 1.5 s, p=3,000 13 s, p=10,000 63 s).

    python benchmarks/check_scale.py                       # p = 100, 300, 1000, 3000, 10000
    python benchmarks/check_scale.py --smoke               # p = 100, 300: the format (the test suite's)
"""

from __future__ import annotations

import argparse
import statistics
import sys

from sidebyside import emit, load_average, run_process, smoke_flag

PY = sys.executable


def check(p: int) -> list[str]:
    return [PY, "-m", "pipec", "check", "1f1b", "-D", f"p={p}", "-D", "m=2"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ps", default="100,300,1000,3000,10000", help="comma-separated depths")
    ap.add_argument("--rounds", type=int, default=3, help="runs per depth (the median is reported)")
    smoke_flag(ap)
    args = ap.parse_args()
    ps = [100, 300] if args.smoke else [int(x) for x in args.ps.split(",")]
    rounds = 1 if args.smoke else args.rounds
    base = [run_process(check(2)) for _ in range(rounds)]
    start_wall = statistics.median(t.wall for t in base)
    start_cpu = statistics.median(t.cpu for t in base)
    prev: tuple[int, float] | None = None  # the previous depth's ops and CPU seconds
    for p in ps:
        load = load_average()
        runs = [run_process(check(p)) for _ in range(rounds)]
        wall, cpu = statistics.median(t.wall for t in runs), statistics.median(t.cpu for t in runs)
        ops = 4 * p  # m=2: F and B of 2 micro-batches on each of p stages
        emit(
            {
                "benchmark": "check_scale",
                "command": f"pipec check 1f1b -D p={p} -D m=2",
                "p": p,
                "ops": ops,
                "rounds": rounds,
                "median_wall_s": round(wall, 3),
                "median_cpu_s": round(cpu, 3),
                "start_up_wall_s": round(start_wall, 3),
                "us_per_op_wall": round((wall - start_wall) / ops * 1e6, 1),
                "us_per_op_cpu": round((cpu - start_cpu) / ops * 1e6, 1),
                # the CPU of the ops added since the previous depth, per op: free of the start-up's noise,
                # which dominates the small depths' figure above (0.4 s of start-up against 0.02 s of ops)
                "marginal_us_per_op_cpu": None if prev is None else round((cpu - prev[1]) / (ops - prev[0]) * 1e6, 1),
                "load_avg_start": load,
            }
        )
        prev = (ops, cpu)


if __name__ == "__main__":
    main()
