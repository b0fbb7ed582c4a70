"""Why `pipec partition` does not hand the whole problem to a MIP solver: the exact split problem at 96 layers
x 8 ranks x v=2, as one mixed integer program (`pipec.partition.bounds.step_lp` with integral
boundaries), given to SCIP and to CP-SAT for a fixed time, with the best step each found and its bound.

    python benchmarks/partition_mip.py [--seconds 60] [--solvers SCIP,CP_SAT] [--schedule interleaved-1f1b]
    python benchmarks/partition_mip.py --smoke   # 16 layers x 4 ranks, SCIP for 1 s: the format (tests)

The layer table is `partition_speed.py`'s random one (seed 0, m = 16, all ranks at speed 1), the one its
first line searches; one JSON line per solver, in the table's time units, with `pipec partition`'s own
result under the same table beside them (its default 10 s) and the load average. Times are the solvers'
wall clock on this machine (2 cores, shared).
"""

from __future__ import annotations

import argparse
import time

from partition_speed import _rows
from sidebyside import emit, smoke_flag

from pipec.api import load
from pipec.formats.partition_files import Ranks, make_table
from pipec.partition import partition
from pipec.partition.bounds import step_lp
from pipec.passes.compiler import compile_schedule


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--solvers", default="SCIP,CP_SAT")
    ap.add_argument("--schedule", default="interleaved-1f1b", choices=("interleaved-1f1b", "zb-v"))
    smoke_flag(ap)
    args = ap.parse_args()
    from ortools.linear_solver import pywraplp

    p, m, layers, ours_limit = 8, 16, 96, 10.0
    if args.smoke:  # 16 layers x 4 ranks, 1 s per solver, SCIP alone: the format (tests)
        p, m, layers, ours_limit, args.seconds, args.solvers = 4, 8, 16, 1.0, 1.0, "SCIP"
    params = {"p": p, "v": 2, "m": m} if args.schedule == "interleaved-1f1b" else {"p": p, "m": m}
    sched = load(args.schedule, **params)
    prog = compile_schedule(sched).program
    table = make_table(_rows("random", layers, 0))
    outcome = partition(sched, prog, table, Ranks(speed=(1.0,)), time_limit=ours_limit)
    ours, pb = outcome.result, outcome.problem  # the MIPs are built on the same Problem
    base = {"benchmark": "partition_mip", "schedule": args.schedule, "params": params, "layers": layers}
    emit(
        {
            **base,
            "solver": "pipec partition",
            "seconds": round(ours.seconds, 2),
            "step": ours.best.step,
            "bound": ours.lower_bound,
            "optimal": ours.optimal,
        }
    )
    for name in args.solvers.split(","):
        mip = pywraplp.Solver.CreateSolver(name)
        if mip is None:
            emit({**base, "solver": name, "error": "not in this OR-Tools build"})
            continue
        t0 = time.perf_counter()
        step_lp(pb, mip, integral=True)
        built = time.perf_counter() - t0
        mip.SetTimeLimit(int(args.seconds * 1000))
        if name == "CP_SAT":
            mip.SetSolverSpecificParametersAsString("num_workers:2")
        status = mip.Solve()
        found = status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)
        step = mip.Objective().Value() * pb.unit if found else None
        bound = mip.Objective().BestBound() * pb.unit
        emit(
            {
                **base,
                "solver": name,
                "seconds": round(time.perf_counter() - t0, 2),
                "build_seconds": round(built, 2),
                "time_limit": args.seconds,
                "optimal": status == pywraplp.Solver.OPTIMAL,
                "step": step,
                "bound": bound,
                "gap": None if step is None else round(1 - bound / step, 4),
            }
        )


if __name__ == "__main__":
    main()
