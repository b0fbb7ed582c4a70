"""Simultaneous exchanges on gloo: one process group for both directions (what torch.distributed.pipelining
and most code do) against pipec's split, messages to a lower rank over a second group.

    .venv/bin/python benchmarks/gloo_exchange.py [--reps 60] [--compute-ms 0.5] [--kib 64] [--sessions 2]
    .venv/bin/python benchmarks/gloo_exchange.py --smoke    # 1 session per layout, 3 exchanges (tests)

Two processes on this machine, one thread each. Each repetition: both post their receive, meet at a
barrier, compute `--compute-ms` (a 1F1B step's op, shortened), then send each other a message at the
same moment and wait for the peer's. The latency of a message is its arrival on the receiver minus the
later of its send and the receiver's own send (both clocks are this machine's monotonic clock). One JSON
line per layout and session (sessions alternate between the layouts): median, 90th percentile and
largest latency, and how many exceeded 1 ms; then one `sidebyside` line comparing the sessions' medians.
On one connection, a send from the main thread and the peer's message arriving contend for the
connection's lock, and gloo's thread then leaves the arrival for a later wake-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from sidebyside import alternate, emit, load_average, smoke_flag, summarize

from pipec.runtime.host import spawned


def worker(rank: int, world: int, port: int, split: bool, args: argparse.Namespace, out) -> None:
    import torch

    dist = spawned.join_gloo(rank, world, port, bind=False)
    up = dist.distributed_c10d._get_default_group()
    down = dist.new_group(backend="gloo") if split else up
    peer = 1 - rank
    send_pg, recv_pg = (up, down) if peer > rank else (down, up)
    n = args.kib * 1024 // 8
    a = torch.ones(128, 128, dtype=torch.float64)
    lat = []
    for i in range(args.reps + 5):
        buf, msg = torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
        r = recv_pg.recv([buf], peer, i)
        dist.barrier()
        end = time.perf_counter() + args.compute_ms / 1e3
        while time.perf_counter() < end:
            a @ a
        t0 = time.perf_counter()
        s = send_pg.send([msg], peer, i)
        r.wait()
        t1 = time.perf_counter()
        s.wait()
        mine = torch.tensor([t0], dtype=torch.float64)
        theirs = torch.zeros(1, dtype=torch.float64)
        w = up.send([mine], peer, 10**6 + i)
        up.recv([theirs], peer, 10**6 + i).wait()
        w.wait()
        if i >= 5:
            lat.append(t1 - max(float(theirs), t0))
    out.put(("result", rank, lat if rank == 1 else None))
    spawned.leave_gloo(dist, barrier=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=60, help="exchanges per session (default 60)")
    ap.add_argument("--compute-ms", type=float, default=0.5, help="compute before each exchange (default 0.5)")
    ap.add_argument("--kib", type=int, default=64, help="message size in KiB (default 64)")
    ap.add_argument("--sessions", type=int, default=2, help="sessions per layout, alternating (default 2)")
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # one session per layout of 3 exchanges: the format, in seconds
        args.reps, args.sessions = 3, 1
    sessions = {False: 0, True: 0}

    def session(split: bool):
        def run() -> float:
            per_rank = spawned.run_gloo(worker, 2, split, args, timeout=600)
            if isinstance(per_rank, str):
                sys.exit(f"gloo_exchange: {per_rank}")
            lat = sorted(per_rank[1])
            emit(
                {
                    "benchmark": "gloo_exchange",
                    "layout": "one group per direction (pipec)" if split else "one group (torch)",
                    "session": sessions[split],
                    "kib": args.kib,
                    "compute_ms": args.compute_ms,
                    "exchanges": len(lat),
                    "median_us": round(statistics.median(lat) * 1e6, 1),
                    "p90_us": round(lat[int(0.9 * (len(lat) - 1))] * 1e6, 1),
                    "max_us": round(lat[-1] * 1e6, 1),
                    "over_1ms": sum(x > 1e-3 for x in lat),
                }
            )
            sessions[split] += 1
            return statistics.median(lat)

        return run

    # Sessions alternate in ABBA order (one group, split, split, one group, ...); the last line compares the
    # sessions' medians.
    start = load_average()
    medians = alternate({"one_group": session(False), "split": session(True)}, args.sessions)
    emit(
        summarize(
            "gloo_exchange",
            medians,
            ratio=("one_group", "split"),
            load_start=start,
            kib=args.kib,
            compute_ms=args.compute_ms,
            measure="median message latency per session, seconds",
        )
    )


if __name__ == "__main__":
    main()
