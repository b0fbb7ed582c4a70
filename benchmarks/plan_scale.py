"""`pipec plan` at scale: p = 64 ranks, 200 layers, answered within its stated time with its bound.

    python benchmarks/plan_scale.py [--p 64] [--layers 200] [--time-limit 60] [--memory-limit 40GiB]

A layer table shaped like a large language model (an embedding, 198 equal blocks and a head as heavy as
ten blocks (`--head`), GPT-like bytes: the embedding's and head's parameters as large as 20 blocks') is written to a
temporary file; `pipec plan --layers-cost TABLE -p 64 --global-batch 256 --time-limit 60 --json` runs as a
process, timed from start to exit (the interpreter's start-up, the search, the proof and the report). One
JSON line: the wall seconds beside the time limit, the candidates screened, the plan against the baselines,
the lower bound and the gap to it.

    python benchmarks/plan_scale.py --smoke    # p = 8, 40 layers, a 5 s limit: the format (tests)

    python benchmarks/plan_scale.py --positions [--reps 3]

times what building one candidate at this scale cost most, `pipec.sim.memory.positions` (each rank's memory
positions, dominated ones left out), on each (schedule, v) the planner screens at p = 64, m = 256: one JSON line
per schedule with the main thread's CPU seconds (the least and the median of `--reps`) and the positions kept,
and a last line with their sum. To compare two versions of pipec run it with `PYTHONPATH=OTHER_TREE`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from sidebyside import emit, load_average, smoke_flag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table(layers: int, head: float = 10.0) -> dict:
    """An embedding, `layers - 2` blocks and a head (times in seconds, bytes for one micro-batch)."""
    block = {"F": 0.01, "B": 0.01, "W": 0.01, "full_backward": 0.02, "act_bytes": 64 << 20, "out_bytes": 8 << 20}
    rows = [{"name": "embed", **block, "F": 0.001, "B": 0.0, "W": 0.004, "full_backward": 0.004}]
    rows[0].update(act_bytes=16 << 20, param_bytes=1 << 30, state_bytes=2 << 30, params=[["weight", [50257, 4096]]])
    for i in range(layers - 2):
        rows.append({"name": f"block{i}", **block, "param_bytes": 400 << 20, "state_bytes": 800 << 20})
        rows[-1]["params"] = [["w", [4096, 4096 * 3]]]
    rows.append({"name": "head", **{k: head * v for k, v in block.items() if k in ("F", "B", "W", "full_backward")}})
    rows[-1].update(act_bytes=1 << 30, out_bytes=0, param_bytes=1 << 30, state_bytes=2 << 30)
    rows[-1]["params"] = [["weight", [4096, 50257]]]
    return {"format": "pipec-layer-costs", "version": 1, "microbatches": 256, "unit": "s", "layers": rows}


def positions_times(p: int, m: int, reps: int) -> None:
    """`--positions`: the module docstring."""
    import statistics

    import pipec
    from pipec.driver import build, read_source
    from pipec.sim.memory import positions

    total = []
    for name, v in (
        ("1f1b", 0),
        ("zb-h1", 0),
        ("interleaved-1f1b", 2),
        ("interleaved-1f1b", 4),
        ("zb-v", 0),
        ("zb-h2", 0),
        ("1f1b-recompute", 0),
        ("v-half", 0),
        ("v-min", 0),
        ("dualpipe-v", 0),
        ("gpipe", 0),
        ("looped-bfs", 2),
        ("1f1b-offload", 0),
        ("zb-v-recompute", 0),
    ):
        sched = build(read_source(name), {"p": p, "m": m, **({"v": v} if v else {})})
        cpu = []
        for _ in range(reps):
            t0 = time.thread_time()
            pos = positions(sched)
            cpu.append(time.thread_time() - t0)
        total.append(statistics.median(cpu))
        emit(
            {
                "schedule": name + (f" v={v}" if v else ""),
                "p": p,
                "m": m,
                "ops": sum(len(r) for r in sched.ranks),
                "positions_kept": sum(len(x.act) for x in pos),
                "cpu_s_min": min(cpu),
                "cpu_s_median": total[-1],
                "reps": reps,
                "pipec": os.path.dirname(pipec.__file__),
            }
        )
    emit({"schedules": len(total), "p": p, "m": m, "cpu_s_median_sum": sum(total), "load_avg": load_average()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--memory-limit", default="80GiB")
    ap.add_argument("--head", type=float, default=10.0, help="the head's time in blocks' (default 10)")
    ap.add_argument("--positions", action="store_true", help="time pipec.sim.memory.positions instead")
    ap.add_argument("--reps", type=int, default=3)
    smoke_flag(ap)
    args = ap.parse_args()
    if args.positions:
        return positions_times(8 if args.smoke else args.p, 16 if args.smoke else 256, 1 if args.smoke else args.reps)
    if args.smoke:
        args.p, args.layers, args.time_limit = 8, 40, 5.0
    path = os.path.join(tempfile.mkdtemp(prefix="plan-scale-"), "layers.json")
    with open(path, "w") as f:
        json.dump(table(args.layers, args.head), f)
    cmd = [sys.executable, "-m", "pipec", "plan", "--layers-cost", path, "-p", str(args.p), "--global-batch", "256"]
    cmd += ["--memory-limit", args.memory_limit, "--time-limit", f"{args.time_limit:g}", "--json"]
    load0, t0 = load_average(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"pipec plan failed:\n{proc.stderr[-3000:]}")
    doc = json.loads(proc.stdout)
    emit(
        {
            "p": args.p,
            "layers": args.layers,
            "head_in_blocks": args.head,
            "time_limit_s": args.time_limit,
            "wall_s": wall,
            "within_limit": wall <= args.time_limit,
            "search_s": doc["seconds"],
            "candidates": doc["candidates"],
            "not_tried": doc["not_tried"],
            "plan": doc["plan"]["label"],
            "plan_step": doc["plan"]["step"],
            "megatron_step": doc["megatron"] and doc["megatron"]["step"],
            "library_step": doc["library"] and doc["library"]["step"],
            "lower_bound": doc["lower_bound"],
            "gap": doc["gap"],
            "command": "pipec plan --layers-cost TABLE " + " ".join(cmd[6:]),
            "load_avg_start": load0,
        }
    )


if __name__ == "__main__":
    main()
