"""CPU binding of gloo ranks (pipec.runtime.host.affinity): the shares, and binding itself in a child process
(binding this test process would bind the rest of the suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipec.runtime.host.affinity import bind_local_rank, cpu_share

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU binding needs Linux")


@given(st.lists(st.integers(0, 255), min_size=1, max_size=64, unique=True).map(sorted), st.integers(1, 70))
def test_shares_are_disjoint_equal_and_in_order(cpus, world):
    shares = [cpu_share(r, world, cpus) for r in range(world)]
    if len(cpus) < world:
        assert shares == [None] * world  # two ranks on one CPU: leave them to the scheduler
        return
    per = len(cpus) // world
    assert all(len(s) == per for s in shares)
    flat = [c for s in shares for c in s]
    assert flat == cpus[: per * world]  # disjoint, contiguous, in rank order; the remainder unused


def test_a_rank_outside_the_local_world_is_refused():
    with pytest.raises(ValueError, match="local rank 2 is not in 0..1"):
        cpu_share(2, 2, [0, 1])


def test_modes_that_bind_nothing():
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert bind_local_rank("none", "gloo", 0, 1) is None
    assert bind_local_rank("auto", "nccl", 0, 1) is None  # GPUs: torchrun --numa-binding's business
    assert bind_local_rank("auto", "gloo", 0, None) is None  # not under torchrun: the machine's ranks unknown
    assert bind_local_rank("auto", "gloo", 1, 1) is None  # a local rank outside the local world
    assert bind_local_rank("auto", "gloo", 0, 1) is None  # the only rank here: nothing to keep apart
    with pytest.raises(ValueError, match="--cpu-bind must be one of auto, none"):
        bind_local_rank("cores", "gloo", 0, 1)
    if before is not None:
        assert os.sched_getaffinity(0) == before


CHILD = """
import json, os, sys, threading, time
started = threading.Event()
t = threading.Thread(target=lambda: (started.set(), time.sleep(2)), daemon=True)
t.start(); started.wait()  # a thread that exists before binding is bound too
from pipec.runtime.host.affinity import bind_local_rank
share = bind_local_rank("auto", "gloo", int(sys.argv[1]), int(sys.argv[2]))
after = threading.Thread(target=time.sleep, args=(2,), daemon=True)
after.start()  # and one started after inherits it
threads = [sorted(os.sched_getaffinity(int(x))) for x in os.listdir("/proc/self/task")]
print(json.dumps({"share": share, "threads": threads}))
"""


@linux_only
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_thread_of_the_process_is_bound(world):
    cpus = sorted(os.sched_getaffinity(0))
    for rank in range(world):
        out = subprocess.run([sys.executable, "-c", CHILD, str(rank), str(world)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        expected = cpu_share(rank, world, cpus) if world > 1 else None  # one rank: nothing to keep apart
        assert got["share"] == expected
        assert len(got["threads"]) == 3
        assert all(t == (expected or cpus) for t in got["threads"])
