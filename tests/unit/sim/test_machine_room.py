"""The machine's room (`pipec.sim.machine`): the simulator's two passes, the list scheduler and the partition
search's evaluation are one machine, so they give the same times for the same schedule and costs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import library_schedules
from tables import random_layer_table

from pipec import synth
from pipec.driver import target_of
from pipec.ir.schedule import Datacenter, Link, Policy, Schedule, Topology
from pipec.partition.problem import Problem
from pipec.passes.compiler import compile_schedule
from pipec.passes.policy import PolicyStuck, derive
from pipec.sim.cost_files import normalize
from pipec.sim.costs import cost_model
from pipec.sim.simulate import simulate, stats

LIBRARY = (
    "1f1b",
    "gpipe",
    "zb-h1",
    "zb-v",
    "interleaved-1f1b",
    "terapipe",
    "1f1b-recompute",
    "1f1b-offload",
    "zb-v-recompute",
    "dualpipe-v",
    "looped-bfs",
)


@st.composite
def library(draw) -> Schedule:
    """A library schedule (slices, memory ops, split backward, overlapped pairs), on two datacenters or one."""
    sched = draw(library_schedules(LIBRARY))
    p = sched.num_ranks
    if draw(st.booleans()):
        cut = draw(st.integers(1, p - 1))
        bps = draw(st.sampled_from([1e6, 8e6]))
        link = Link(None, None, draw(st.sampled_from([0.0, 0.05])), bps)
        sched = dataclasses.replace(
            sched, topology=Topology((Datacenter("a", 0, cut), Datacenter("b", cut, p)), (link,))
        )
    return sched


@st.composite
def overrides(draw) -> dict:
    """Communication costs: latency, a fixed comm time, bytes over bandwidth, the per-transfer overhead."""
    doc = {}
    for key, values in (
        ("comm", [0.0, 0.1]),
        ("latency", [0.0, 0.02]),
        ("overhead", [0.0, 0.01, 0.1]),
        ("act_bytes", [0.0, 4e5]),
    ):
        doc[key] = draw(st.sampled_from(values))
    return doc


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(library(), overrides())
def test_the_simulators_passes_are_one_machine(sched, doc):
    """The uncontended pass and the time-ordered pass step the same machine: the same times, op by op."""
    prog = compile_schedule(sched).program
    costs = cost_model(sched, [normalize(doc)])
    a, b = simulate(prog, costs), simulate(prog, costs, _events=True)
    for x in ("start", "end", "msg_send", "msg_arrival"):
        assert np.allclose(getattr(a, x), getattr(b, x), rtol=1e-12, atol=1e-9), x
    assert a.makespan == pytest.approx(b.makespan, abs=1e-9)


@st.composite
def policies(draw):
    p = draw(st.integers(2, 4))
    split = draw(st.booleans())
    v, place = draw(st.sampled_from([(1, "loop"), (2, "v"), (2, "loop")]))
    topology = None
    if draw(st.booleans()):
        cut = draw(st.integers(1, p - 1))
        link = Link(None, None, 0.01, draw(st.sampled_from([None, 8e6])))
        topology = Topology((Datacenter("a", 0, cut), Datacenter("b", cut, p)), (link,))
    doc = draw(overrides())
    spec = synth.Spec(p=p, m=draw(st.integers(p, 2 * p)), v=v, placement=place, split=split, topology=topology)
    spec = dataclasses.replace(spec, cost_docs=(normalize(doc),))
    prefer = draw(st.permutations(("F", "B", "W") if split else ("F", "B")))
    infl = draw(st.sampled_from([None, tuple(range(p + 1, 1, -1))]))
    return spec, Policy(tuple(prefer), infl, None, draw(st.sampled_from(["idle", "fit"])) if split else "idle")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies())
def test_the_list_scheduler_is_the_simulator(case):
    """The list scheduler steps the machine: every op it plays starts and ends when the simulator of the
    Program of its orders says, under latencies, bandwidth, overheads and shared links."""
    spec, pol = case
    try:
        d = derive(synth.spec_machine(spec), pol)
    except PolicyStuck:
        assume(False)
    sim, fig = synth.evaluate_orders(spec, d.orders)
    tl = sim.timeline
    for r in range(spec.p):
        sel = np.flatnonzero(tl.rank == r)
        assert np.allclose(tl.start[sel], d.start[r], rtol=0, atol=1e-9)
        assert np.allclose(tl.end[sel], d.end[r], rtol=0, atol=1e-9)
    assert fig.makespan == pytest.approx(d.makespan, abs=1e-9)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(library(), st.integers(0, 2**31 - 1), st.booleans())
def test_partition_evaluates_with_the_machine(sched, seed, comm):
    """The partition search's evaluation of a split is the simulator's makespan under the split's costs, and
    its dependency graph's longest path (the bound it cuts with) is the machine's makespan when messages
    cost nothing, and no more than it when they do."""
    sched = dataclasses.replace(sched, topology=None)
    assume(not any(sched.memops))  # the partition search does not time memory ops' host link
    # Nor token slices: its graph gives each unit its stage's whole micro-batch time, where the machine
    # gives a slice its share (a known gap, reported with issue 27: the bound is 4x the step on terapipe).
    assume(sched.slicing is None)
    rng = np.random.default_rng(seed)
    S = sched.num_stages
    docs = [normalize({"comm": 0.25, "latency": 0.1})] if comm else []
    prog = compile_schedule(sched).program
    pb = Problem(
        sched,
        prog,
        random_layer_table(rng, S + int(rng.integers(0, 4))),
        np.ones(sched.num_ranks),
        np.full(sched.num_ranks, np.nan),
        docs,
    )
    bounds = pb.uniform()
    split = pb.evaluate(bounds)
    tl = simulate(prog, cost_model(sched, [*docs, pb.cost_doc(bounds)]))
    assert split.step == stats(tl).makespan
    longest = int(pb.graph.lengths({k: v[None, :] for k, v in pb.stage_units(bounds).items()})[0]) * pb.unit
    if comm:
        assert longest <= split.step + 1e-9
    else:
        assert longest == pytest.approx(split.step, rel=1e-12)


# ---- ranks that share cores (machine.core_sharing, the simulator's fixed point) ------------------------------


def test_core_sharing_is_the_mean_count_of_computing_ranks_over_the_cores():
    from pipec.sim.machine import core_sharing

    rank = np.array([0, 1, 2, 3])
    start, end = np.array([0.0, 0.0, 1.0, 0.0]), np.array([2.0, 2.0, 3.0, 2.0])
    # ranks 0 and 1 share node 0 all along; ranks 2 and 3 (node 1) overlap for half of each one's span
    f = core_sharing(rank, start, end, ranks_per_node=2, cores=1)
    assert f.tolist() == [2.0, 2.0, 1.5, 1.5]
    assert core_sharing(rank, start, end, ranks_per_node=2, cores=2).tolist() == [1.0] * 4
    assert core_sharing(rank, start, end, ranks_per_node=1, cores=1).tolist() == [1.0] * 4
    # with 2 replicas per pipeline rank, ranks 0 and 1 are processes 0 to 3 of one node of 4 with 2 cores
    f = core_sharing(rank[:2], start[:2], end[:2], ranks_per_node=4, cores=2, replicas=2)
    assert f.tolist() == [2.0, 2.0]


def _sharing(name: str, cores: int | None, **params: int) -> tuple[float, float]:
    """The makespan of `name` with F=1, B=2 when its ranks share `cores` cores on one node, and its work."""
    sched, _ = target_of(name, params)
    doc = {"F": 1.0, "B": 2.0, "W": 1.0}
    if cores is not None:
        doc.update(ranks_per_node=sched.num_ranks, cores_per_node=cores)
    costs = cost_model(sched, [normalize(doc)])
    tl = simulate(compile_schedule(sched).program, costs)
    work = float(np.sum(tl.end - tl.start))
    return float(tl.makespan), work


@pytest.mark.parametrize(
    ("name", "params"),
    [("1f1b", {"p": 4, "m": 8}), ("zb-h1", {"p": 4, "m": 8}), ("interleaved-1f1b", {"p": 2, "v": 2, "m": 8})],
)
def test_ranks_sharing_cores_take_at_least_their_work_over_the_cores_and_no_more_than_it(name, params):
    alone, _ = _sharing(name, None, **params)
    assert _sharing(name, params["p"], **params)[0] == alone  # as many cores as ranks: nothing shared
    for cores in (1, 2):
        if cores >= params["p"]:
            continue
        shared, work = _sharing(name, cores, **params)
        unstretched = _sharing(name, None, **params)[1]
        assert shared > alone
        assert shared >= unstretched / cores * (1 - 1e-9)  # the node does at most `cores` seconds a second
        if cores == 1:  # one core: the ranks take turns, and nothing but computing happens here
            assert shared <= unstretched * 1.02, (shared, unstretched)


def test_cores_per_node_is_a_positive_integer():
    from pipec.errors import PipecError

    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(PipecError) as e:
            normalize({"cores_per_node": bad})
        assert e.value.code == "E801" and "cores_per_node must be a positive integer" in str(e.value)
    assert normalize({"cores_per_node": 2.0, "ranks_per_node": 4})["cores_per_node"] == 2  # `--cost` reads 2.0
