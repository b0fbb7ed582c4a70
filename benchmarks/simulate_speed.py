"""Simulation speed: `pipec.sim.simulate.simulate` from about 10,000 to 1,000,000 compute ops.

Prints one JSON line per measurement, then one line per schedule comparing the
smallest and largest points (time per op should stay flat: linear growth).
Compiling (parse, checks, lowering) is timed separately and not counted; the
simulation is timed twice per point (free communication, and a link cost of
latency plus bytes over bandwidth) and the best of three runs is reported.

    python benchmarks/simulate_speed.py            # all points (about a minute on 2 cores)
    python benchmarks/simulate_speed.py --quick    # skip the 1,000,000-op points
    python benchmarks/simulate_speed.py --smoke    # a few small points, 1 round: the format (tests)
"""

from __future__ import annotations

import argparse
import statistics
import time

from sidebyside import alternate, emit, smoke_flag, timed

POINTS = {
    "1f1b": [{"p": 8, "m": 640}, {"p": 16, "m": 3200}, {"p": 64, "m": 3200}, {"p": 128, "m": 4096}],
    "zb-v": [{"p": 8, "m": 208}, {"p": 32, "m": 520}, {"p": 64, "m": 1300}, {"p": 128, "m": 1302}],
}
COMM = "latency=10us,act_bytes=16MiB,bandwidth=100Gbps,comm=1us"


def measure(name: str, params: dict[str, int], rounds: int = 3) -> dict:
    from pipec.api import load
    from pipec.passes.compiler import compile_schedule
    from pipec.sim.cost_files import parse_overrides
    from pipec.sim.costs import cost_model
    from pipec.sim.simulate import simulate, stats

    t0 = time.perf_counter()
    sched = load(name, **params)
    prog = compile_schedule(sched).program
    t_compile = time.perf_counter() - t0
    free = cost_model(sched)
    linked = cost_model(sched, [parse_overrides(COMM)])
    tl, tl2 = simulate(prog, free), simulate(prog, linked)
    st = stats(tl)
    seconds = alternate(
        {"free": timed(lambda: simulate(prog, free)), "links": timed(lambda: simulate(prog, linked))}, rounds
    )
    t_free, t_link = (statistics.median(t.wall for t in seconds[k]) for k in ("free", "links"))
    cpu_free = statistics.median(t.cpu for t in seconds["free"])
    t_stats = statistics.median(t.wall for t in alternate({"stats": timed(lambda: stats(tl))}, rounds)["stats"])
    n = sched.num_ops
    return {
        "benchmark": "simulate_speed",
        "schedule": name,
        "params": params,
        "compute_ops": n,
        "instructions": prog.num_instructions,
        "messages": int(len(tl.msg_send)),
        "compile_seconds": round(t_compile, 3),
        "simulate_seconds": round(t_free, 4),
        "simulate_cpu_seconds": round(cpu_free, 4),
        "simulate_seconds_with_links": round(t_link, 4),
        "stats_seconds": round(t_stats, 4),
        "us_per_op": round(1e6 * t_free / n, 3),
        "makespan": st.makespan,
        "makespan_with_links": tl2.makespan,
        "bubble_rate": round(st.bubble_rate, 6),
        "rounds": rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the 1,000,000-op points")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per point (default 3)")
    smoke_flag(ap)
    args = ap.parse_args()
    points = POINTS
    if args.smoke:  # two small points per schedule, 1 round: the format (tests)
        points, args.rounds = {"1f1b": [{"p": 4, "m": 8}, {"p": 4, "m": 32}], "zb-v": [{"p": 4, "m": 8}]}, 1
    for name, grid in points.items():
        rows = []
        for params in grid:
            if args.quick and params["p"] == 128:
                continue
            rec = measure(name, params, args.rounds)
            rows.append(rec)
            emit(rec)
        emit(
            {
                "benchmark": "simulate_speed_scaling",
                "scaling": name,
                "ops_small": rows[0]["compute_ops"],
                "ops_large": rows[-1]["compute_ops"],
                "us_per_op_small": rows[0]["us_per_op"],
                "us_per_op_large": rows[-1]["us_per_op"],
                "per_op_ratio": round(rows[-1]["us_per_op"] / rows[0]["us_per_op"], 2),
                "seconds_large": rows[-1]["simulate_seconds"],
                "target_seconds_at_1M": 10,
            }
        )


if __name__ == "__main__":
    main()
