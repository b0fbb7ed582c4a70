"""Local gloo processes for the benchmarks that time transfers (gloo_exchange, cpu_bind, transfer_calls).

results = run(worker, 2, extra_args...)    # worker(rank, port, *extra_args, out) in each process
dist = join(rank, port, 2, bind=True)      # first thing in a worker: bind, init the gloo group
"""

from __future__ import annotations

import os
import queue


def run(worker, nproc: int, *args, expect: int = 1, timeout: float = 600.0) -> list:
    """Start `nproc` spawned workers on a fresh store and return the `expect` items they put on `out`;
    exits with a message if a worker fails first."""
    import multiprocessing as mp
    import time

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, store.port, *args, out)) for r in range(nproc)]
    for p in procs:
        p.start()
    items: list = []
    deadline = time.monotonic() + timeout
    while len(items) < expect and time.monotonic() < deadline:
        try:
            items.append(out.get(timeout=1.0))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(60)
    if len(items) < expect:
        raise SystemExit(f"a worker failed or timed out (exit statuses {[p.exitcode for p in procs]})")
    return items


def join(rank: int, port: int, world: int, bind: bool = True):
    """In a worker: bind to this rank's CPUs as `pipec run` does (before torch starts a thread), one torch
    thread, then the gloo group. Returns torch.distributed."""
    if bind:
        from pipec.runtime.affinity import bind_local_rank

        bind_local_rank("auto", "gloo", rank, world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    __import__("torch.distributed.nn.functional")  # before the group: see runtime/launch.py, Worker._teardown
    dist.init_process_group("gloo")
    return dist


def leave(dist) -> None:
    """End a worker's group once every rank is done."""
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
