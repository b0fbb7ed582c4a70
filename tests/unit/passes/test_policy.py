"""The list scheduler (pipec.passes.policy) on the simulator's machine: overhead, links, shared links.

The property test over random policies and machines lives in tests/unit/tools/test_synth.py
(`test_derived_orders_are_valid_and_timed_like_the_simulator`); these are the
cases named in issue 15 and the parts of the machine one at a time.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipec import synth
from pipec.ir.schedule import Datacenter, Link, Policy, Topology
from pipec.passes import policy as policy_module
from pipec.passes.policy import derive
from pipec.sim.cost_files import normalize
from pipec.sim.plan import plan


def timed_like_the_simulator(spec: synth.Spec, d) -> float:
    """Assert every op of `d` runs when the simulator runs it; the simulator's makespan."""
    sim, fig = synth.evaluate_orders(spec, d.orders)
    tl = sim.timeline
    for r in range(spec.p):
        sel = np.flatnonzero(tl.rank == r)
        assert np.allclose(tl.start[sel], d.start[r], rtol=0, atol=1e-9), r
        assert np.allclose(tl.end[sel], d.end[r], rtol=0, atol=1e-9), r
    assert d.makespan == pytest.approx(fig.makespan, abs=1e-9)
    return fig.makespan


def test_overhead_p4_m8_gives_the_simulators_makespan():
    # Issue 15: with overhead 0.05 the list scheduler dropped each transfer's overhead and predicted less
    # than `pipec simulate` (31.15 here, as the library's interleaved 1F1B under the same costs).
    spec = synth.Spec(p=4, m=8, v=2, placement="v", split=False, cost_docs=(normalize({"overhead": 0.05}),))
    d = derive(synth.spec_machine(spec), Policy(("F", "B")))
    assert timed_like_the_simulator(spec, d) == pytest.approx(31.15, abs=1e-9)
    assert d.makespan == pytest.approx(31.15, abs=1e-9)


@pytest.mark.parametrize("overhead", [0.01, 0.05, 0.3])
def test_overhead_costs_the_ranks_time(overhead):
    base = synth.Spec(p=4, m=8, cost_docs=(normalize({"comm": 0.05}),))
    costly = dataclasses.replace(base, cost_docs=(normalize({"comm": 0.05, "overhead": overhead}),))
    pol = Policy(("B", "F", "W"), (4, 3, 2, 1))
    free, paid = derive(synth.spec_machine(base), pol), derive(synth.spec_machine(costly), pol)
    assert paid.makespan > free.makespan
    timed_like_the_simulator(costly, paid)


def test_orders_that_do_not_settle_get_the_simulators_times(monkeypatch):
    # With no re-play allowed the orders are those the policy chose without the receives' overhead;
    # the times are still the simulator's for them.
    spec = synth.Spec(p=4, m=8, v=2, placement="v", cost_docs=(normalize({"overhead": 0.3, "comm": 0.1}),))
    monkeypatch.setattr(policy_module, "SETTLE_ROUNDS", 0)
    d = derive(synth.spec_machine(spec), Policy(("B", "F", "W")))
    timed_like_the_simulator(spec, d)


def two_datacenters(p: int, bps: float) -> Topology:
    half = p // 2
    return Topology((Datacenter("a", 0, half), Datacenter("b", half, p)), (Link("a", "b", 0.01, bps),))


def test_latency_and_bandwidth_between_datacenters():
    docs = (normalize({"act_bytes": 4e5}),)
    spec = synth.Spec(p=4, m=8, cost_docs=docs, topology=two_datacenters(4, 8e6))
    d = derive(synth.spec_machine(spec), Policy(("B", "F", "W"), (4, 3, 2, 1)))
    near = derive(synth.spec_machine(dataclasses.replace(spec, topology=None)), Policy(("B", "F", "W"), (4, 3, 2, 1)))
    assert timed_like_the_simulator(spec, d) > near.makespan  # the link costs time, and the scheduler sees it


def test_a_shared_link_divides_its_bandwidth():
    # V placement on two datacenters: ranks 0..1 and 2..3, and both chunks of each rank pair cross the
    # one link per direction, so several pairs of ranks share it at once.
    docs = (normalize({"act_bytes": 1e6, "overhead": 0.02}),)
    spec = synth.Spec(p=4, m=8, v=2, placement="loop", cost_docs=docs, topology=two_datacenters(4, 8e6))
    d = derive(synth.spec_machine(spec), Policy(("B", "F", "W")))
    sim, _ = synth.evaluate_orders(spec, d.orders)
    assert plan(sim.compiled.program, sim.costs).group is not None  # contended: the event-driven network
    timed_like_the_simulator(spec, d)
