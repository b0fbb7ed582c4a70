"""The buffer plan's bytes against the memory walk's peak, per library schedule (docs/memory.md, "Buffer plan").

One JSON line per schedule: the busiest rank's walk peak, the plan's bytes there (its pools' slots at their
classes' sizes, plus the resident parameters the peak includes), what one arena packed by the same lifetimes
would hold (`packed`), the largest message, the excess over peak + one largest message in messages, the slots,
and the milliseconds the pass took (the proof included); each line carries the load average
(`sidebyside.emit`'s shared fields). `--smoke`: three schedules at p = 2, m = 4.

    .venv/bin/python benchmarks/buffer_plan.py            # p = 4, m = 8, the default units
    .venv/bin/python benchmarks/buffer_plan.py --p 8 --m 16 --cost examples/mlp-bytes.toml
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from sidebyside import emit, smoke_flag

import pipec
from pipec.frontend import library
from pipec.passes.bufferplan import live_peak, plan_buffers
from pipec.passes.compiler import compile_schedule
from pipec.sim.cost_files import cost_spec
from pipec.sim.memory import memory_bytes, memory_model, resident


def row(name: str, p: int, m: int, overrides: dict) -> dict:
    sched = pipec.load(name, p=p, m=m)
    c = compile_schedule(sched, overrides)
    model = memory_model(sched, overrides)
    t = time.perf_counter()
    plan = plan_buffers(c.program, model)
    ms = (time.perf_counter() - t) * 1e3
    res = resident(c.program.placement_array, model, c.program.num_ranks)
    planned = np.asarray(plan.device()) + res
    packed = np.asarray(live_peak(c.program, plan)) + res
    peaks = np.array([r.peak for r in c.memory])
    r = int(np.argmax(planned - peaks))
    msg = plan.largest_message()
    return {
        "schedule": name,
        "p": p,
        "m": m,
        "unit": plan.unit,
        "rank": r,
        "walk_peak": float(peaks[r]),
        "plan": float(planned[r]),
        "packed": float(packed[r]),
        "largest_message": msg,
        "over_bound_messages": round(max(float(planned[r] - peaks[r]) - msg, 0.0) / msg, 2) if msg else None,
        "plan_over_peak": round(float(planned[r] / peaks[r]), 4) if peaks[r] else None,
        "slots": plan.ranks[r].slots,
        "bounded": sorted({b.bound for b in plan.bounded}),
        "plan_ms": round(ms, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--cost", action="append", default=[], help="cost files whose measured bytes size the model")
    smoke_flag(ap)
    args = ap.parse_args()
    overrides = memory_bytes([cost_spec(c) for c in args.cost])
    names, p, m = (["1f1b", "zb-v", "1f1b-offload"], 2, 4) if args.smoke else (library.names(), args.p, args.m)
    for name in names:
        emit({**row(name, p, m, overrides), "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
