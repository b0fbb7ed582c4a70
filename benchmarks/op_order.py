"""Does an op's time depend on the op before it? Each op of a run, by whether the rank's previous compute op
was on the same stage (the weights still in cache) or on another (a chunk switch).

    .venv/bin/python benchmarks/op_order.py [--runs 3] [--schedules interleaved-1f1b,looped-bfs]
    .venv/bin/python benchmarks/op_order.py --smoke   # one run of 2 steps on a small model (tests)

Each schedule (p=2, v=2, m=8) runs `--runs` times through `pipec run --trace` on
benchmarks/blocks_model.py (16 blocks of Linear(256, 256) + GELU in float64), and the traced steps are
pooled. One JSON line per schedule, op and stage: how many ops followed an op of the same stage and of
another, and their median times. Interleaved 1F1B alternates chunks; looped BFS runs a chunk's
micro-batches back to back, so its ops mostly follow their own stage. A per-op cost model gives both the
same time; this measures by how much they differ.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
from sidebyside import emit, smoke_flag

from pipec.formats.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]
OPS = ("F", "B", "W")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="traced runs per schedule (default 3)")
    ap.add_argument("--schedules", default="interleaved-1f1b,looped-bfs", help="comma-separated, with v=2")
    smoke_flag(ap)
    args = ap.parse_args()
    env = dict(os.environ, BLOCKS_M="8", PYTHONPATH=str(ROOT))
    steps = 6
    if args.smoke:  # one traced run of 2 steps of interleaved 1F1B on a small model: the format (tests)
        args.runs, args.schedules, steps = 1, "interleaved-1f1b", 2
        env.update(BLOCKS="4", BLOCKS_WIDTH="32", BLOCKS_ROWS="4")
    for name in args.schedules.split(","):
        times: dict[tuple[int, int, bool], list[float]] = defaultdict(list)
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.runs):
                trace = os.path.join(tmp, f"{k}.json")
                cmd = [sys.executable, "-m", "pipec.cli.app", "run", name, "-D", "p=2", "-D", "v=2", "-D", "m=8"]
                cmd += ["--model", "benchmarks/blocks_model.py", "--nproc", "2", "--steps", str(steps)]
                cmd += ["--trace", trace]
                res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                if res.returncode != 0:
                    sys.exit(f"pipec run failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr[-2000:]}")
                tl = read_trace(trace)
                for r in range(tl.num_ranks):
                    idx = np.flatnonzero(tl.rank == r)
                    prev = None
                    for i in idx[np.argsort(tl.start[idx])]:
                        op, s = int(tl.op[i]), int(tl.stage[i])
                        if prev is not None:  # the step's first op follows the previous step's teardown
                            times[(op, s, prev == s)].append(float(tl.end[i] - tl.start[i]))
                        prev = s
        for op, s in sorted({(o, s) for o, s, _ in times}):
            same, other = times.get((op, s, True), []), times.get((op, s, False), [])
            med = lambda xs: round(1e3 * statistics.median(xs), 4) if xs else None  # noqa: E731
            row = {
                "benchmark": "op_order",
                "schedule": name,
                "params": "p=2 v=2 m=8",
                "op": OPS[op],
                "stage": s,
                "after_same_stage": len(same),
                "after_other_stage": len(other),
                "same_stage_ms": med(same),
                "other_stage_ms": med(other),
                "ratio_other_over_same": round(statistics.median(other) / statistics.median(same), 3)
                if same and other
                else None,
            }
            emit(row)


if __name__ == "__main__":
    main()
