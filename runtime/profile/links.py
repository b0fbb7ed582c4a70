"""The link `pipec profile` measures: a gloo ping-pong between two fresh local processes gives the cost
file's `latency` and `bandwidth`, and the executor's per-instruction `overhead` on that link
(pipec.runtime.profile.overhead)."""

from __future__ import annotations

import statistics
import time

import torch


def measure_link(
    nbytes: int, reps: int = 20, timeout: float = 120.0, gap: float = 1e-3
) -> tuple[float | None, float | None, float | None]:
    """One-way time of a small message (latency, s) and the bandwidth (bit/s) beyond it, from a gloo
    ping-pong of 8 bytes and of `nbytes` between two fresh local processes, and the per-instruction
    overhead (s) of pipec's executor for messages of `nbytes` between compute ops of about `gap` seconds
    (pipec.runtime.profile.overhead); Nones if it fails."""
    from pipec.runtime.host import spawned

    # bound as `pipec run` binds two gloo ranks (pipec.runtime.host.affinity), so the link is measured as runs use it
    results = spawned.run_gloo(_pingpong, 2, nbytes, reps, gap, timeout=timeout)
    if isinstance(results, str):
        return None, None, None
    small, big, overhead = results[0]
    if nbytes <= 8 or big <= small:
        return small, None, overhead
    return small, (nbytes - 8) * 8 / (big - small), overhead


def _pingpong(rank: int, world: int, port: int, nbytes: int, reps: int, gap: float, out) -> None:
    from pipec.runtime.host import spawned
    from pipec.runtime.profile.overhead import instruction_overhead

    dist = spawned.join_gloo(rank, world, port)
    try:
        results = [_rtt(rank, dist, n, reps) / 2 for n in (8, max(nbytes, 8))]
        overhead = instruction_overhead(rank, max(nbytes, 8), reps, gap)
        out.put(("result", rank, (*results, overhead) if rank == 0 else None))
    finally:
        spawned.leave_gloo(dist)  # the Runner's process groups and works go first, on this thread


def _rtt(rank: int, dist, nbytes: int, reps: int) -> float:
    buf = torch.zeros(max(1, nbytes // 8), dtype=torch.float64)
    peer = 1 - rank
    times = []
    for i in range(reps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.isend(buf, peer, tag=i).wait()
            dist.irecv(buf, peer, tag=i).wait()
        else:
            dist.irecv(buf, peer, tag=i).wait()
            dist.isend(buf, peer, tag=i).wait()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
