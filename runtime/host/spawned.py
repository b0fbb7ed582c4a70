"""One local process per rank for the profiler's measurements (`pipec profile`, `--in-situ`, the link) and
the transfer benchmarks: start them, collect what they report, and say which rank failed and how, without
waiting on a dead or hung one.

A worker is `target(rank, *args, out)`; it reports success as `out.put(("result", rank, value))` and a
failure as `out.put(("failed", rank, culprit, message))` (culprit: the rank it blames, itself unless a
peer failed it), then ends. `failed(out, ...)` does the latter and exits the process. Workers that form a
gloo group are started by `run_gloo` and begin with `join_gloo`.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable


def run(target: Callable, nproc: int, *args, timeout: float, barrier: bool = False) -> list | str:
    """Start `nproc` spawned workers and return their results by rank, or why there are none: the ranks'
    own failures first, then ranks that died without a word, then what their peers saw; or the timeout.
    Every worker has ended when it returns. With `barrier`, workers get a `multiprocessing.Barrier` for
    all of them before `out`, to start measuring together."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    extra = (ctx.Barrier(nproc),) if barrier else ()
    procs = [ctx.Process(target=target, args=(r, *args, *extra, out), daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    result: list | str = "interrupted"
    try:
        result = _collect(procs, out, timeout)
    finally:
        for p in procs:
            p.join(10 if isinstance(result, list) else 0)  # a failed run's ranks are ended at once
            if p.is_alive():
                p.kill()
    return result


def _collect(procs: list, out, timeout: float) -> list | str:
    deadline = time.monotonic() + timeout
    results: dict[int, object] = {}
    said: list[tuple[int, int, str]] = []  # (rank, culprit, message)
    failed_at = None
    while time.monotonic() < deadline:
        try:
            item = out.get(timeout=0.2)
        except queue.Empty:
            item = None
        if item is not None and item[0] == "result":
            results[item[1]] = item[2]
            if len(results) == len(procs):
                return [results[r] for r in range(len(procs))]
        elif item is not None:
            said.append(item[1:])
        dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
        if said or dead:
            failed_at = failed_at or time.monotonic()
            if all(p.exitcode is not None for p in procs) or time.monotonic() - failed_at > 2.0:
                spoke = {r for r, _, _ in said}
                parts = [m for r, c, m in said if r == c]
                parts += [f"rank {r} died (exit status {code})" for r, code in sorted(dead.items()) if r not in spoke]
                parts += [m for r, c, m in said if r != c]
                return "; ".join(parts)
    return f"no result within {timeout:g} s"


def run_gloo(target: Callable, nproc: int, *args, timeout: float, barrier: bool = False) -> list | str:
    """`run` for workers that form a gloo group over a fresh store: `target(rank, world, port, *args, out)`."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # lives while they run
    return run(target, nproc, nproc, store.port, *args, timeout=timeout, barrier=barrier)


def join_gloo(rank: int, world: int, port: int, *, threads: int = 1, timeout: float | None = None, bind: bool = True):
    """First thing in a `run_gloo` worker: bind to this rank's CPUs as `pipec run` binds its ranks (every
    thread, and those torch starts later), torch's threads, then the gloo group. Returns torch.distributed."""
    if bind:
        from pipec.runtime.host.affinity import bind_local_rank

        bind_local_rank("auto", "gloo", rank, world)
    from pipec.runtime.host.malloc import keep_freed_memory

    keep_freed_memory()  # as `pipec run`'s ranks allocate
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    __import__("torch.distributed.nn.functional")  # before the group: see runtime/job/launch.py, Worker._teardown
    dist.init_process_group("gloo", **({} if timeout is None else {"timeout": timedelta(seconds=timeout)}))
    return dist


def leave_gloo(dist, barrier: bool = False) -> None:
    """End a worker's group on its main thread, the objects holding it collected first (with `barrier`,
    once every rank is done)."""
    import gc

    gc.collect()
    if barrier:
        dist.barrier()
    dist.destroy_process_group()


def failed(out, rank: int, culprit: int, message: str) -> None:
    """Report a failure and end this process at once (a peer may be gone, so no teardown)."""
    out.put(("failed", rank, culprit, message))
    out.close()
    out.join_thread()  # the message is out of this process before it ends
    os._exit(1)


def alive(pid: int) -> bool:
    """Whether process `pid` is running (Linux /proc; a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc): how the fault tests and benchmarks find ranks."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry))
    return kids
