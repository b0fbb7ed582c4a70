"""Data parallelism across datacenters, emulated (`pipec run --dp N --emulate-links`, pipec.runtime.exec.links):
when a pipeline rank's replicas sit in two replica datacenters, its collectives end no earlier than the
simulator's ring time over the link between them after the last replica issued them, training stays
exact, and the same run without emulation is faster than that."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from runtime_harness import ROOT, launch  # noqa: E402

from pipec.api import load  # noqa: E402
from pipec.frontend.topology import with_topology  # noqa: E402
from pipec.ir.schedule import Datacenter, Link, Topology  # noqa: E402
from pipec.runtime.errors import PipelineError  # noqa: E402
from pipec.runtime.exec.links import DPLink, Links, links_of  # noqa: E402
from pipec.sim.costs import ring_time  # noqa: E402
from pipec.sim.topology_links import FREE  # noqa: E402

LAT = 0.25  # s, the declared latency between the replica datacenters
TOPO = 'dc "east" replicas 0 .. 1  dc "west" replicas 1 .. 2  link "east" <-> "west" latency {lat} bandwidth 10Gbps'


def replicas_in(names: list[str], latency: float = LAT, bandwidth: float = 10e9) -> Topology:
    """Replica i in datacenter names[i] (consecutive runs), one link between the first two names."""
    dcs, lo = [], 0
    for i in range(1, len(names) + 1):
        if i == len(names) or names[i] != names[lo]:
            dcs.append(Datacenter(names[lo], lo, i))
            lo = i
    distinct = list(dict.fromkeys(names))
    return Topology((), (Link(distinct[0], distinct[-1], latency, bandwidth),), tuple(dcs))


def test_links_of_takes_the_ring_hops_across_replica_datacenters_and_scales_them():
    sched = with_topology(load("1f1b", p=2, m=4), replicas_in(["east", "west"]))
    links = links_of(sched, scale=0.5, dp=2)
    assert not any(links.emulated(a, b) for a in range(2) for b in range(2))  # one pipeline: no rank crosses
    assert [x for hop in links.dp_ring for x in hop] == pytest.approx([LAT * 0.5, 10e9 / 8 / 0.5] * 2)
    assert Links.from_json(links.to_json()) == links
    assert "data-parallel ring 0->1 125 ms, 20 Gbps, 1->0 125 ms, 20 Gbps" in links.describe()
    # four replicas, two per datacenter: the hops inside one are not emulated
    four = links_of(with_topology(load("1f1b", p=2, m=4), replicas_in(["east", "east", "west", "west"])), dp=4)
    assert four.dp_ring[0] == FREE and four.dp_ring[2] == FREE
    assert four.dp_ring[1] == pytest.approx((LAT, 10e9 / 8)) and four.dp_ring[3] == four.dp_ring[1]
    # every replica in one datacenter, or a single replica: nothing to emulate
    assert links_of(with_topology(load("1f1b", p=2, m=4), replicas_in(["east", "east"])), dp=2).dp_ring == ()
    one = links_of(sched, dp=1)
    assert one.dp_ring == () and one.describe() == "emulated links: none (nothing crosses two datacenters)"


def test_the_emulated_end_is_the_simulators_ring_time_of_the_parameters():
    sched = with_topology(load("1f1b", p=2, m=4), replicas_in(["east", "west"]))
    links = links_of(sched, dp=2)
    module = torch.nn.Linear(100, 10).double()  # 1010 float64 parameters
    link = DPLink(links, None, 2, 60.0, 1, 0)
    want = float(ring_time("all_reduce", 2, 1010 * 8.0, links.dp_ring))
    assert link.end("all_reduce", 5.0, module) == pytest.approx(5.0 + want)
    assert want == pytest.approx(2 * (LAT + 1010 * 8 / 2 / (10e9 / 8)))
    assert link.end("all_gather", 5.0, module) == pytest.approx(5.0 + want / 2)


def test_an_emulated_collective_past_the_timeout_fails_naming_rank_and_instruction():
    link = DPLink(
        links_of(with_topology(load("1f1b", p=2, m=4), replicas_in(["east", "west"])), dp=2), None, 2, 1.0, 1, 0
    )
    where = "step 2, instruction #9 `REDUCE_GRAD 1`"
    with pytest.raises(PipelineError, match=r"rank 1 \(replica 0\): stage 1's gradient reduction at step 2, "):
        link.hold(time.monotonic() + 30.0, "stage 1's gradient reduction", where)
    link.hold(None, "nothing", where)  # no emulated end: returns at once


MLP = {"MLP_WIDTH": "8", "MLP_DEPTH": "4", "MLP_BATCH": "32"}
JOB = ["1f1b", "-D", "p=2", "-D", "m=4", "--model", "examples/mlp.py", "--dp", "2", "--steps", "3"]


def run_dp(*extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **MLP)
    cmd = [sys.executable, "-m", "pipec", "run", *JOB, "--nproc", "4"]
    cmd += ["--topology", TOPO.format(lat=f"{LAT * 1e3:g}ms"), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def step_times(out: str) -> list[float]:
    return [float(t) for t in re.findall(r"^step \d+/3: loss \S+, ([0-9.]+) s", out, re.M)]


@pytest.mark.slow  # links: test_runtime_links; PP x DP exactness: test_dp_runtime's 2 x 2
def test_pipec_run_emulates_the_all_reduce_across_datacenters_and_stays_exact():
    """2 ranks x 2 ddp replicas (4 gloo processes), replica 0 east and 1 west: every step holds a
    REDUCE_GRAD per rank over the 250 ms link, at least ring_time's 2 (N - 1) latencies (the bytes add
    to it); without emulated links the same job steps in less than that. That job's four ranks are
    forked from tests/support/runtime_harness.py's fork server (pipec.runtime.job.launch, what torchrun starts
    `pipec run`'s ranks with, given no links file): one torchrun job, not two."""
    bound = float(ring_time("all_reduce", 2, 0.0, [(LAT, 10e9 / 8)] * 2))
    assert math.isclose(bound, 2 * LAT)
    r = run_dp("--emulate-links", "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"data-parallel ring 0->1 {LAT * 1e3:g} ms, 10 Gbps" in r.stdout
    assert any(line.startswith("OK: largest relative error") for line in r.stdout.splitlines()), r.stdout
    times = step_times(r.stdout)
    assert len(times) == 3 and all(t >= bound for t in times), (times, bound)
    plain, _, _ = launch(4, "launch", JOB, env=MLP, timeout=120.0)
    assert all(x.returncode == 0 for x in plain), [x.stderr for x in plain]
    assert all("emulated links" not in x.stdout for x in plain), plain[0].stdout
    base = step_times(plain[0].stdout)
    assert len(base) == 3 and min(base[1:]) < bound, (base, bound)  # after the first step's start-up
