"""Simulation speed with data parallelism: the simulator before collectives, dp = 1, and dp = 2 (ddp, fsdp).

One JSON line per schedule at about a million compute ops: the best of three runs of each (wall and CPU), run in
turn (so a change of machine load hits all four alike), and whether dp = 1 gives the old simulator's
makespan exactly. The old simulator is `pipec/sim/simulate.py` at the commit before collectives, read
with git (skipped when git cannot show it or it no longer imports: it names modules the house refactor moved).

    python benchmarks/simulate_dp_speed.py            # 1F1B p=128 m=4096, ZB-V p=128 m=1302
    python benchmarks/simulate_dp_speed.py --quick    # 1F1B p=16 m=640, ZB-V p=16 m=160
    python benchmarks/simulate_dp_speed.py --smoke    # p=4 m=8, one run each: the format (tests)
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

from sidebyside import emit, smoke_flag

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "e05ca0c"
COSTS = "latency=10us,act_bytes=16MiB,bandwidth=100Gbps,comm=1us,param_bytes=1GB"
POINTS = {"1f1b": ({"p": 128, "m": 4096}, {"p": 16, "m": 640}), "zb-v": ({"p": 128, "m": 1302}, {"p": 16, "m": 160})}


def old_simulator():
    try:
        text = subprocess.run(
            ["git", "show", f"{BEFORE}:pipec/sim/simulate.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("old_simulate", loader=None))
    sys.modules["old_simulate"] = mod
    try:
        exec(compile(text, "old_simulate.py", "exec"), mod.__dict__)  # noqa: S102 - this project's own file
    except ImportError as e:  # it imports modules by their old paths, which the house refactor moved
        print(f"simulate_dp_speed: the old simulator does not import any more ({e}); skipped", file=sys.stderr)
        return None
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small points only")
    smoke_flag(ap)
    args = ap.parse_args()
    from pipec.api import load
    from pipec.ir.dataparallel import DataParallel
    from pipec.passes.lower import lower
    from pipec.sim.cost_files import parse_overrides
    from pipec.sim.costs import cost_model
    from pipec.sim.simulate import simulate

    old = old_simulator()
    tries = 1 if args.smoke else 3
    for name, (big, small) in POINTS.items():
        params = {"p": 4, "m": 8} if args.smoke else small if args.quick else big
        sched = load(name, **params)
        progs = {
            k: lower(sched, DataParallel(n, kind))
            for k, n, kind in (("dp1", 1, "ddp"), ("ddp", 2, "ddp"), ("fsdp", 2, "fsdp"))
        }
        costs = cost_model(sched, [parse_overrides(COSTS)])
        runs = [(k, simulate, progs[k]) for k in progs]
        if old is not None:
            runs.append(("old", old.simulate, progs["dp1"]))
        best = {k: float("inf") for k, _, _ in runs}
        spans = {}
        cpu = dict(best)
        for _ in range(tries):
            for k, sim, prog in runs:
                t, c = time.perf_counter(), time.process_time()
                spans[k] = sim(prog, costs).makespan
                best[k] = min(best[k], time.perf_counter() - t)
                cpu[k] = min(cpu[k], time.process_time() - c)
        ops = int(sum(int((rp.op < 3).sum()) for rp in progs["dp1"].ranks))
        row = {"benchmark": "simulate_dp_speed", "schedule": name, **params, "compute_ops": ops}
        row.update({f"{k}_s": round(v, 3) for k, v in best.items()})
        row.update({f"{k}_cpu_s": round(v, 3) for k, v in cpu.items()})
        row["dp1_equals_old"] = spans.get("old") == spans["dp1"] if old is not None else None
        row["makespans"] = spans
        emit(row)


if __name__ == "__main__":
    main()
