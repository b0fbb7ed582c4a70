"""Where a rank's time between compute ops goes on gloo: each transfer call of pipec's executor, timed
inside a real run.

    .venv/bin/python benchmarks/transfer_calls.py [--schedule interleaved-1f1b] [-D v=2] [--steps 10]
    .venv/bin/python benchmarks/transfer_calls.py --transport shm   # the shared-memory transport's calls
    .venv/bin/python benchmarks/transfer_calls.py --smoke   # 1F1B, 1 step, a small model (tests)

Two gloo processes, bound as `pipec run` binds them, run the schedule (p=2, m=8) on
benchmarks/blocks_model.py (16 blocks of Linear(256, 256) + GELU in float64, 64 KiB messages) through
the runtime's `Runner`, with the executor's and the transport's methods wrapped in timers: `send` (gloo
writes the data in the call), `post` (a receive: its buffer, `_recv_ops`, and gloo's call, which sends
the peer a "ready" notice), `_wait` (each work waited on), and the executor's `_one` (one transfer),
`_exchange` (a batched one, NCCL) and `_post_upto` around them. One JSON line per rank and call: calls
per step, median and mean in us, after 3 untimed steps. The cost file's `overhead`
(pipec.runtime.profile.overhead) is what these add up to between two compute ops. `--transport shm`
times the shared-memory transport's calls instead (`send`: the copy into the peer's segment; `post`: a
slot's counter; `take`: the copy out; `_block`: a wait).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

from sidebyside import emit, smoke_flag

from pipec.runtime.host import spawned

ROOT = Path(__file__).resolve().parents[1]
WRAPPED = {
    "DistComm": ("post", "send", "_recv_ops", "_send_ops", "_issue", "_wait"),
    "ShmComm": ("post", "send", "take", "_block", "_wait_read"),
    "Executor": ("_one", "_exchange", "_post_upto"),
}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    os.environ["BLOCKS_M"] = "8"
    dist = spawned.join_gloo(rank, world, port)
    from pipec.runtime.exec import comm, executor, shm
    from pipec.runtime.job.launch import load_program
    from pipec.runtime.model.contract import load_model
    from pipec.runtime.runner import Runner, StageOptions, Transport

    times: dict[str, list[float]] = collections.defaultdict(list)

    def timed(cls, name: str) -> None:
        fn = getattr(cls, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[f"{cls.__name__}.{name}"].append(time.perf_counter() - t0)

        setattr(cls, name, wrapper)

    for cls in (comm.DistComm, shm.ShmComm, executor.Executor):
        for name in WRAPPED[cls.__name__]:
            timed(cls, name)
    program = load_program(args.schedule, [tuple(d.split("=", 1)) for d in ["p=2", "m=8", *args.define]])
    model = load_model(str(ROOT / "benchmarks" / "blocks_model.py"))
    options = StageOptions(optimizer=model.optimizer, dtype=model.dtype)
    transport = Transport(p2p=args.transport)
    runner = Runner(program, model.build_stage, model.loss_fn, rank=rank, options=options, transport=transport)
    x, y = model.batch(0)
    for step in range(3 + args.steps):
        if step == 3:
            times.clear()
        runner.step(x, y)
    rows = [
        {
            "benchmark": "transfer_calls",
            "schedule": program.name,
            "params": " ".join(f"{k}={v}" for k, v in program.params),
            "rank": rank,
            "transport": args.transport,
            "call": name,
            "calls_per_step": len(v) / args.steps,
            "median_us": round(1e6 * statistics.median(v), 1),
            "mean_us": round(1e6 * statistics.fmean(v), 1),
        }
        for name, v in sorted(times.items())
    ]
    out.put(("result", rank, rows))
    runner = None
    spawned.leave_gloo(dist, barrier=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", default="interleaved-1f1b", help="a library schedule (default interleaved-1f1b)")
    ap.add_argument("-D", dest="define", action="append", default=None, help="more parameters (default v=2)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--transport", choices=("gloo", "shm"), default="gloo", help="whose calls are timed (default gloo)")
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # 1F1B, one timed step on a small model: the format (tests)
        args.schedule, args.steps = "1f1b", 1
        os.environ.update(BLOCKS="4", BLOCKS_WIDTH="32", BLOCKS_ROWS="4")
    if args.define is None:
        args.define = ["v=2"] if args.schedule.startswith("interleaved") else []
    per_rank = spawned.run_gloo(worker, 2, args, timeout=600)
    if isinstance(per_rank, str):
        sys.exit(f"transfer_calls: {per_rank}")
    rows = [row for per in per_rank for row in per]
    for row in sorted(rows, key=lambda r: (r["rank"], r["call"])):
        emit(row)


if __name__ == "__main__":
    main()
