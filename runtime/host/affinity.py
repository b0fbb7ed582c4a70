"""CPU binding for the ranks of one machine: each local rank on its own share of the CPUs.

Why it matters on gloo: over loopback TCP, a message's arrival wakes the receiver's gloo thread from the
sender's CPU, as a "synchronous" wake-up that tells the scheduler the waker is about to sleep, so it
queues the woken thread on the sender's CPU. The sender does not sleep: it goes on computing, and the
woken thread waits there until the sender blocks or the next scheduler tick (4 ms at HZ=250), while the
receiver's own CPU sits idle. Bound to its rank's CPUs, a gloo thread can only wake where its rank runs
(`benchmarks/cpu_bind.py` measures both). torch's launcher binds only near GPUs (`--numa-binding`), so
`pipec run` binds gloo ranks itself (`--cpu-bind auto`, the default; `none` leaves them free).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

MODES = ("auto", "none")


def allowed_cpus() -> list[int] | None:
    """The CPUs this process may run on, or None where the platform cannot bind (not Linux)."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return None
    return sorted(os.sched_getaffinity(0))


def cpu_share(local_rank: int, local_world: int, cpus: Sequence[int]) -> list[int] | None:
    """Local rank `local_rank`'s CPUs out of `cpus` shared by `local_world` ranks: equal, disjoint, contiguous
    shares (the remainder left unused, so no rank gets more than the others); None when there are fewer
    CPUs than ranks, since binding would then put two ranks on one CPU and forbid the scheduler to spread
    them."""
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is not in 0..{local_world - 1}")
    per = len(cpus) // local_world
    if per == 0:
        return None
    return list(cpus[local_rank * per : (local_rank + 1) * per])


def bind(cpus: Sequence[int]) -> None:
    """Bind every thread of this process to `cpus`; threads started later inherit it."""
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def bind_local_rank(mode: str, backend: str, local_rank: int, local_world: int | None) -> list[int] | None:
    """What `pipec run` does in each rank before torch starts a thread: with mode "auto" and gloo, bind to
    this local rank's share. Returns the CPUs bound to, or None when nothing was bound (also when the
    ranks sharing this machine are unknown, `local_world` None, or the local rank is not among them, or
    it is the only one)."""
    if mode not in MODES:
        raise ValueError(f"--cpu-bind must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none" or backend != "gloo" or local_world is None or not 0 <= local_rank < local_world:
        return None
    if local_world == 1:  # nothing to keep apart
        return None
    cpus = allowed_cpus()
    if cpus is None:
        return None
    share = cpu_share(local_rank, local_world, cpus)
    if share is not None:
        bind(share)
    return share


def describe(share: list[int] | None, local_world: int | None, mode: str, backend: str) -> str | None:
    """The header line for rank 0's output."""
    if mode == "none":
        return "CPU binding: none (--cpu-bind none)"
    if backend != "gloo":
        return None
    if local_world is None:
        return "CPU binding: none (LOCAL_WORLD_SIZE is not set: the ranks sharing this machine are unknown)"
    if local_world == 1:
        return "CPU binding: none (one rank on this machine)"
    if share is None:
        cpus = allowed_cpus()
        if cpus is None:
            return "CPU binding: none (this platform cannot bind threads to CPUs)"
        return f"CPU binding: none ({local_world} local ranks, {len(cpus)} CPUs: fewer CPUs than ranks)"
    n = len(share)
    return f"CPU binding: each of the {local_world} local ranks on its own {n} CPU{'s' if n > 1 else ''} (--cpu-bind)"
