"""How long `pipec partition`'s search takes at 96 layers x 8 ranks x v=2 (the issue's target: 10 s).

    python benchmarks/partition_speed.py [--time-limit 10] [--layers 96] [--seed 0] [--table random|blocks]
    python benchmarks/partition_speed.py --smoke   # one case, 16 layers x 4 ranks, 1 s: the format (tests)

One JSON line per case: interleaved 1F1B (p=8, v=2) and ZB-V (p=8), m=16, on a random layer table of
`--layers` layers (times uniform in 0.5..3 per pass, so no split is trivially best; `--table blocks`:
identical blocks between a cheap embedding and a heavy head, a transformer's shape), with all ranks at
speed 1 and with half of them at 0.5; then 1F1B p=8 for reference. Each line has the search's seconds (wall and the
process's CPU time, the solver's threads included), whether it proved the split optimal, the lower bound's
gap (and the fluid bound's alone), the step beside the uniform split's, the number
of simulations and the load average (the development machine is shared: times are this machine's then).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from sidebyside import emit, smoke_flag

from pipec.api import load
from pipec.formats.partition_files import Ranks, make_table
from pipec.partition import partition
from pipec.passes.compiler import compile_schedule


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table", choices=("random", "blocks"), default="random")
    smoke_flag(ap)
    args = ap.parse_args()
    cases = [("interleaved-1f1b", {"p": 8, "v": 2, "m": 16}), ("zb-v", {"p": 8, "m": 16}), ("1f1b", {"p": 8, "m": 16})]
    speed_sets = ((1.0,), (1.0,) * 4 + (0.5,) * 4)
    if args.smoke:  # one case, 16 layers on 4 ranks, 1 s: the format (tests)
        args.layers, args.time_limit = 16, 1.0
        cases, speed_sets = [("interleaved-1f1b", {"p": 4, "v": 2, "m": 8})], ((1.0,),)
    table = make_table(_rows(args.table, args.layers, args.seed))
    for name, params in cases:
        sched = load(name, **params)
        prog = compile_schedule(sched).program
        for speeds in speed_sets:
            t0, c0 = time.perf_counter(), time.process_time()
            out = partition(sched, prog, table, Ranks(speed=speeds), time_limit=args.time_limit)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            res = out.result
            doc = {
                "benchmark": "partition_speed",
                "schedule": name,
                "params": params,
                "layers": args.layers,
                "table": args.table,
                "speed": list(out.speed),
                "seconds": round(wall, 3),
                "search_seconds": round(res.seconds, 3),
                "cpu_seconds": round(cpu, 3),
                "search_cpu_seconds": round(res.cpu_seconds, 3),
                "optimal": res.optimal,
                "gap": round(1 - res.lower_bound / res.best.step, 6),
                "fluid_gap": round(1 - res.fluid_bound / res.best.step, 6),
                "step": res.best.step,
                "uniform_step": res.uniform.step,
                "gain": round(res.uniform.step / res.best.step, 4),
                "layers_per_stage": list(res.best.sizes),
                "simulations": res.simulations,
                "paths": res.paths,
                "nodes": res.nodes,
                "time_limit": args.time_limit,
            }
            emit(doc)


def _rows(kind: str, layers: int, seed: int) -> list[dict]:
    """The layer table's rows: random times, or a transformer's shape (identical blocks between a cheap
    embedding and a head three times a block)."""
    if kind == "blocks":
        one = {"F": 1.0, "B": 1.0, "W": 1.0, "full_backward": 2.0, "act_bytes": 1 << 22, "param_bytes": 1 << 24}
        return [
            {**one, "name": "embed", "F": 0.3, "B": 0.3, "W": 0.3, "full_backward": 0.6},
            *({**one, "name": f"block{i}"} for i in range(layers - 2)),
            {**one, "name": "head", "F": 3.0, "B": 3.0, "W": 3.0, "full_backward": 6.0},
        ]
    rng = np.random.default_rng(seed)
    return [
        {
            "name": f"layer{i}",
            "F": float(rng.uniform(0.5, 3)),
            "B": float(rng.uniform(0.5, 3)),
            "W": float(rng.uniform(0.2, 2)),
            "full_backward": float(rng.uniform(1, 5)),
            "act_bytes": int(rng.integers(1 << 20, 1 << 24)),
            "param_bytes": int(rng.integers(1 << 20, 1 << 26)),
        }
        for i in range(layers)
    ]


if __name__ == "__main__":
    main()
