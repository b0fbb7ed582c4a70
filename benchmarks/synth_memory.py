"""`pipec synth` under a memory limit below 1F1B's (issue 19, docs/synth.md "Under a memory limit"): one JSON
line per case.

Each line: the case, the equivalent command, the limit, synth's makespan, bubble and peak (and the memory ops it
placed), V-Half's, V-Min's, ZB-V's and 1F1B's under the same costs and memory model, the ratio of synth's
makespan to V-Half's (at most 1: at least as good), whether V-Half itself fits the limit, the seconds synth took,
its solver's status, and the load average at the start and end of the case.

The V schedules hold half a micro-batch per chunk (two chunks per rank: the memory model's default share), so
1F1B's peak is p and "half of 1F1B's memory" is p / 2; V-Half's own peak is p // 2 + 1 (docs/memory.md).

    .venv/bin/python benchmarks/synth_memory.py            # every case (several minutes on 2 cores)
    .venv/bin/python benchmarks/synth_memory.py --quick    # p=4 only, shorter solver limits
    .venv/bin/python benchmarks/synth_memory.py --smoke    # the first case, 1 s: the format (tests)
"""

from __future__ import annotations

import argparse
import time

from sidebyside import emit, load_average, smoke_flag

from pipec.sim.cost_files import normalize
from pipec.synth import Spec, library_comparison, synthesize

EQUAL = {"T_F": 1, "T_B": 1, "T_W": 1}  # offload: the cost model's default, half a forward per OFFLOAD/RELOAD
# Recompute expensive (a forward costs twice a backward half), offload cheap (a tenth of that forward).
DEAR_RECOMPUTE = {"T_F": 2, "T_B": 1, "T_W": 1, "offload": 0.1}
# Offload expensive (a transfer takes four forwards), recompute cheap (a forward is a third of a backward).
DEAR_OFFLOAD = {"T_F": 0.5, "T_B": 1.5, "T_W": 1, "offload": 1}
LIBRARY = ["v-half", "v-min", "zb-v", "1f1b"]


def case(name: str, p: int, m: int, costs: dict, limit: float, time_limit: float) -> dict:
    docs = (normalize(costs, "--cost"),)
    spec = Spec(p=p, m=m, v=2, placement="v", cost_docs=docs, limit=(limit,) * p)
    load_start = load_average()
    t0 = time.monotonic()
    res = synthesize(spec, time_limit=time_limit)
    secs = time.monotonic() - t0
    lib = {n: fig for n, _, fig, _ in library_comparison(spec, LIBRARY) if fig is not None}
    f = res.figures
    kinds: dict[str, int] = {}
    for x in (x for rank in res.memops for x in rank):
        kinds[x.op] = kinds.get(x.op, 0) + 1
    cost_arg = ",".join(f"{k}={v}" for k, v in costs.items())

    def figs(x) -> dict:
        return {"makespan": x.makespan, "bubble_rate": x.bubble, "peak": max(x.peak)}

    vh = lib["v-half"]
    return {
        "case": name,
        "command": f"pipec synth -p {p} -m {m} -v 2 --cost {cost_arg} --memory-limit {limit:g}"
        f" --time-limit {time_limit:g}",
        "limit": limit,
        "synth": {**figs(f), "memops": kinds, "floor": max(res.floor) if res.floor else None},
        **{n.replace("-", "_"): figs(x) for n, x in lib.items()},
        "ratio_to_v_half": f.makespan / vh.makespan,
        "at_least_as_good_as_v_half": f.makespan <= vh.makespan + 1e-9,
        "v_half_fits_limit": max(vh.peak) <= limit + 1e-9,
        "solver": res.solver_status,
        "bound": res.bound,
        "seconds": secs,
        "seconds_heuristic": res.seconds_heuristic,
        "seconds_solver": res.seconds_solver,
        "load_avg_start": load_start,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="p=4 only, shorter solver limits")
    ap.add_argument("--time-limit", type=float, default=None, help="solver seconds per case (default 30; quick 10)")
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # the first case, a 1 s solver limit: the format (tests)
        args.quick, args.time_limit = True, 1.0
    tl = args.time_limit if args.time_limit is not None else (10.0 if args.quick else 30.0)
    cases = [
        ("equal costs, half of 1F1B's memory, p=4", 4, 8, EQUAL, 2.0),
        ("equal costs, V-Half's memory, p=4", 4, 8, EQUAL, 3.0),
        ("recompute expensive, offload cheap, half of 1F1B's memory, p=4", 4, 8, DEAR_RECOMPUTE, 2.0),
        ("offload expensive, recompute cheap, half of 1F1B's memory, p=4", 4, 8, DEAR_OFFLOAD, 2.0),
    ]
    if not args.quick:
        cases += [
            ("equal costs, half of 1F1B's memory, p=8", 8, 16, EQUAL, 4.0),
            ("recompute expensive, offload cheap, half of 1F1B's memory, p=8", 8, 16, DEAR_RECOMPUTE, 4.0),
        ]
    for name, p, m, costs, limit in cases[:1] if args.smoke else cases:
        emit(case(name, p, m, costs, limit, tl))


if __name__ == "__main__":
    main()
