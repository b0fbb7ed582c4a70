"""gloo ranks bound to their own CPUs (`pipec run --cpu-bind auto`, the default) against unbound ones.

    .venv/bin/python benchmarks/cpu_bind.py [--reps 120] [--compute-ms 3] [--rounds 3] [--steps 12]
    .venv/bin/python benchmarks/cpu_bind.py --smoke    # 1 session, 1 round, a small model (tests)

1. Messages to an idle receiver from a busy sender: two processes, one thread each. Each repetition, rank
   1 posts a receive and both meet at a barrier; rank 0 sends 64 KiB and then computes `--compute-ms`,
   rank 1 waits for the message. Its latency is the arrival on rank 1 minus the send (one monotonic
   clock). Unbound, the arrival wakes rank 1's gloo thread from rank 0's CPU, the scheduler may queue it
   there behind rank 0's compute, and the message waits for that compute to end or for the next tick while
   rank 1's CPU is idle (pipec.runtime.host.affinity). One JSON line per layout and session.
2. Whole runs: `pipec run NAME -D p=2 ... --nproc 2 --steps K` on benchmarks/blocks_model.py (16 blocks of
   Linear(256, 256) + GELU in float64), `--cpu-bind auto` and `--cpu-bind none` alternating, `--rounds`
   runs each (ABBA order); the median step time after the first two, and the ratio bound / unbound with its
   spread over the rounds (`sidebyside.summarize`). One JSON line per schedule.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import sidebyside
from sidebyside import alternate, load_average, smoke_flag, summarize

from pipec.runtime.host import spawned

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^step\s+\d+/\d+: loss \S+, ([0-9.]+) s", re.M)
RUNS = {"1f1b": ["-D", "p=2", "-D", "m=8"], "interleaved-1f1b": ["-D", "p=2", "-D", "v=2", "-D", "m=8"]}


def worker(rank: int, world: int, port: int, bound: bool, args: argparse.Namespace, out) -> None:
    import torch

    dist = spawned.join_gloo(rank, world, port, bind=bound)
    pg = dist.distributed_c10d._get_default_group()
    a = torch.ones(128, 128, dtype=torch.float64)
    n = 64 * 1024 // 8
    lat = []
    for i in range(args.reps + 5):
        buf, msg = torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
        recv = pg.recv([buf], 0, i) if rank == 1 else None
        dist.barrier()
        if rank == 0:
            sent = torch.tensor([time.perf_counter()], dtype=torch.float64)
            work = pg.send([msg], 1, i)
            end = time.perf_counter() + args.compute_ms / 1e3
            while time.perf_counter() < end:
                a @ a
            work.wait()
            pg.send([sent], 1, 10**6 + i).wait()
        else:
            recv.wait()
            arrived = time.perf_counter()
            sent = torch.zeros(1, dtype=torch.float64)
            pg.recv([sent], 0, 10**6 + i).wait()
            if i >= 5:
                lat.append(arrived - float(sent))
    out.put(("result", rank, lat if rank == 1 else None))
    spawned.leave_gloo(dist, barrier=True)


def messages(args: argparse.Namespace) -> None:
    sessions = {False: 0, True: 0}

    def session(bound: bool):
        def run() -> float:
            per_rank = spawned.run_gloo(worker, 2, bound, args, timeout=600)
            if isinstance(per_rank, str):
                sys.exit(f"cpu_bind: {per_rank}")
            lat = sorted(per_rank[1])
            emit(
                benchmark="cpu_bind_messages",
                layout="bound, one CPU per rank" if bound else "unbound",
                session=sessions[bound],
                compute_ms=args.compute_ms,
                messages=len(lat),
                median_us=round(statistics.median(lat) * 1e6, 1),
                p90_us=round(lat[int(0.9 * (len(lat) - 1))] * 1e6, 1),
                max_us=round(lat[-1] * 1e6, 1),
                over_1ms=sum(x > 1e-3 for x in lat),
            )
            sessions[bound] += 1
            return statistics.median(lat)

        return run

    alternate({"unbound": session(False), "bound": session(True)}, args.sessions)


def runs(args: argparse.Namespace) -> None:
    env = dict(os.environ, BLOCKS_M="8", PYTHONPATH=str(ROOT))
    if args.smoke:  # a small model
        env.update(BLOCKS="4", BLOCKS_WIDTH="32", BLOCKS_ROWS="4")
    for name, defines in RUNS.items() if not args.smoke else list(RUNS.items())[:1]:

        def run(mode: str, name: str = name, defines: list[str] = defines):
            def once() -> float:
                cmd = [sys.executable, "-m", "pipec.cli.app", "run", name, *defines]
                cmd += ["--model", "benchmarks/blocks_model.py", "--nproc", "2", "--steps", str(args.steps)]
                res = subprocess.run([*cmd, "--cpu-bind", mode], cwd=ROOT, env=env, capture_output=True, text=True)
                times = [float(t) for t in STEP.findall(res.stdout)]
                if res.returncode != 0 or len(times) != args.steps:
                    sys.exit(f"pipec run failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr[-2000:]}")
                return statistics.median(times[2:])

            return once

        start = load_average()
        steps = alternate({"auto": run("auto"), "none": run("none")}, args.rounds)  # auto, none, none, auto, ...
        rec = summarize("cpu_bind_runs", steps, ("auto", "none"), start, schedule=name, params=" ".join(defines[1::2]))
        rec["measure"] = "median step time of a run (after the first 2 steps), seconds; ratio: bound / unbound"
        sidebyside.emit(rec)


def emit(**row) -> None:
    sidebyside.emit(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=120, help="messages per session (default 120)")
    ap.add_argument("--compute-ms", type=float, default=3.0, help="the sender's compute after each send (default 3)")
    ap.add_argument("--sessions", type=int, default=2, help="message sessions per layout, alternating (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="pipec runs per schedule and mode (default 3)")
    ap.add_argument("--steps", type=int, default=12, help="steps per run (default 12; the first 2 dropped)")
    ap.add_argument("--only", choices=("messages", "runs"), help="run one part only")
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # one session per layout of 3 messages, one run per mode of 3 steps on a small model, 1F1B
        args.reps, args.sessions, args.rounds, args.steps = 3, 1, 1, 3
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("cpu_bind.py needs at least 2 CPUs")
    if args.only != "runs":
        messages(args)
    if args.only != "messages":
        runs(args)


if __name__ == "__main__":
    main()
