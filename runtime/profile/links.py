"""The link `pipec profile` measures between two fresh local processes: message deliveries in runs of the
runtime give the cost file's `latency` and `bandwidth` (on the transport a run takes: shared memory between
local ranks), and the executor's per-instruction `overhead` on that link (pipec.runtime.profile.overhead)."""

from __future__ import annotations

import statistics
import time

import torch


def measure_link(
    nbytes: int, reps: int = 20, timeout: float = 120.0, gap: float = 1e-3
) -> tuple[float | None, float | None, float | None, str]:
    """One-way time of a small message (latency, s) and the bandwidth (bit/s) beyond it, and the
    per-instruction overhead (s) of pipec's executor for messages of `nbytes` between compute ops of about
    `gap` seconds (pipec.runtime.profile.overhead), between two fresh local processes; Nones if it fails.
    The latency and bandwidth are message deliveries (send to receive done) of 8 bytes and of `nbytes` in
    runs of the runtime itself (`overhead.delivery`), so on the transport `pipec run` takes between local
    ranks (shared memory on Linux x86-64); a gloo ping-pong where those runs give none. The fourth value says
    which (the cost file's `[measured]` keeps it)."""
    from pipec.runtime.host import spawned

    # bound as `pipec run` binds two gloo ranks (pipec.runtime.host.affinity), so the link is measured as runs use it
    results = spawned.run_gloo(_pingpong, 2, nbytes, reps, gap, timeout=timeout)
    if isinstance(results, str):
        return None, None, None, f"not measured: {results}"
    small, big, overhead, how = results[0]
    if nbytes <= 8 or big <= small:
        return small, None, overhead, how
    return small, (nbytes - 8) * 8 / (big - small), overhead, how


def _pingpong(rank: int, world: int, port: int, nbytes: int, reps: int, gap: float, out) -> None:
    from pipec.runtime.host import spawned
    from pipec.runtime.profile.overhead import delivery, instruction_overhead

    dist = spawned.join_gloo(rank, world, port)
    try:
        sizes = (8, max(nbytes, 8))
        delivered = [delivery(rank, n, reps, gap) for n in sizes]  # rank 0's; Nones on rank 1
        ok = [rank == 0 and all(d is not None for d in delivered)]
        dist.broadcast_object_list(ok, src=0)  # both ranks take the same branch: the ping-pong is collective
        if ok[0]:  # rank 0 reports them
            results, how = [d["median_s"] for d in delivered if d], "deliveries in runs of the runtime"
        else:  # no message had a waiting receiver
            results, how = [_rtt(rank, dist, n, reps) / 2 for n in sizes], "gloo ping-pong"
        overhead = instruction_overhead(rank, max(nbytes, 8), reps, gap)
        out.put(("result", rank, (*results, overhead, how) if rank == 0 else None))
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
