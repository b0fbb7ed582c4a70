"""The simulation driver is the one room of the pipeline (build, compile, the bytes merge, cost, memory, simulate,
peaks): every consumer's numbers are the driver's.

Drawn: library schedules with memory ops (recompute, offload), token slices, the cross-datacenter ones with
their topology or one given apart (`--topology`), a send/receive overhead, and a cost file of measured bytes.
Held equal to `pipec.driver.simulation`: the public API (`pipec.simulate`), the report's JSON, `expect`'s
metrics, synth's evaluation of a schedule's orders, and partition's simulated step of a split.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipec
from pipec import driver
from pipec.frontend import library
from pipec.sim.cost_files import cost_spec, dump_costs

# (name, parameters): small sizes, every feature the pipeline carries.
CASES = [
    ("1f1b", {"p": 3, "m": 4}),
    ("gpipe", {"p": 2, "m": 3}),
    ("zb-h1", {"p": 3, "m": 4}),
    ("interleaved-1f1b", {"p": 2, "v": 2, "m": 4}),
    ("1f1b-recompute", {"p": 3, "m": 4}),  # RECOMPUTE memory ops
    ("1f1b-offload", {"p": 3, "m": 4}),  # OFFLOAD / RELOAD and the host pool
    ("zb-v-recompute", {"p": 2, "m": 4}),
    ("terapipe", {"p": 2, "m": 2, "n": 2, "L": 8}),  # token slices
    ("crossdc-1f1b", {"p": 4, "m": 4}),  # its own topology
]
TOPOLOGY = 'dc "a" ranks 0 .. 1  dc "b" ranks 1 .. p  link "a" <-> "b" latency 2ms bandwidth 1Gbps'


@st.composite
def drawn(draw):
    name, params = draw(st.sampled_from(CASES))
    sched = driver.load(name, params)
    S = sched.num_stages
    per_stage = st.lists(st.integers(1, 64), min_size=S, max_size=S)
    measured = {
        "saved_bytes": [float(x) * 2**20 for x in draw(per_stage)],
        "state_bytes": [float(x) * 2**20 for x in draw(per_stage)],
        "act_bytes": [float(x) * 2**10 for x in draw(per_stage)],
    }
    overrides = draw(st.sampled_from(["F=1,B=2,W=1", "F=1.5,B=2", "T_F=2"]))
    if draw(st.booleans()):
        overrides += f",overhead={draw(st.sampled_from(['0.01', '0.1']))}"
    topology = TOPOLOGY if sched.num_ranks > 1 and sched.slicing is None and draw(st.booleans()) else None
    return name, params, measured, overrides, topology


def _numbers(sim) -> dict:
    """What a simulation says: times, the bubble, per-rank peaks (device and host) and every op's start."""
    return {
        "makespan": sim.stats.makespan,
        "bubble": sim.stats.bubble_rate,
        "peaks": [r.peak_memory for r in sim.stats.ranks],
        "device": sim.curves.device_peak.tolist(),
        "host": sim.curves.host_peak.tolist(),
        "starts": sim.timeline.start.tolist(),
        "unit": sim.curves.unit,
    }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=drawn())
def test_every_consumer_reads_the_drivers_numbers(tmp_path_factory, case):
    from pipec.view import report

    name, params, measured, overrides, topology = case
    path = tmp_path_factory.mktemp("costs") / "bytes.toml"
    path.write_text(dump_costs(measured))
    docs = [cost_spec(str(path)), cost_spec(overrides)]

    sched = driver.build(library.read(name), params)
    room = driver.simulation(sched, docs, None, topology)
    want = _numbers(room)
    assert room.curves.unit == "bytes"  # the cost file's bytes reached the memory model (the one merge)

    # the public API, from the name and the cost file's path
    api = pipec.simulate(name, params, cost=[str(path), overrides], topology=topology)
    assert _numbers(api) == want
    # the report's JSON is made from the simulation it is given
    assert json.dumps(report.to_json(api), sort_keys=True) == json.dumps(report.to_json(room), sort_keys=True)
    assert report.to_json(room)["makespan"] == pytest.approx(want["makespan"], abs=0)

    # expect: the schedule's own costs and memory, the driver's pipeline
    own = driver.simulation(sched)
    metrics = driver.metrics(sched)
    assert (metrics.makespan, metrics.bubble, metrics.ideal) == (
        own.stats.makespan,
        own.stats.bubble_rate,
        own.stats.ideal,
    )

    # synth's evaluation of these very orders and memory ops, under the same cost documents
    if sched.placement == tuple(range(sched.num_ranks)) and not sched.costs and not sched.memory:
        if sched.slicing is None and sched.topology is None and topology is None:
            from pipec.passes.policy import orders_from_schedule
            from pipec.synth import Spec, evaluate_orders

            spec = Spec(p=sched.num_ranks, m=sched.num_microbatches, split=sched.split_backward, cost_docs=tuple(docs))
            sim, fig = evaluate_orders(spec, orders_from_schedule(sched), memops=sched.memops)
            assert _numbers(sim) == want
            assert (fig.makespan, list(fig.peak)) == (want["makespan"], want["peaks"])


@pytest.mark.parametrize("name,params", [c for c in CASES if c[0] in ("1f1b", "zb-h1", "1f1b-recompute")])
def test_partition_simulates_a_split_as_the_driver_does(name, params):
    from tables import random_layer_table

    from pipec.partition.problem import Problem

    rng = np.random.default_rng(7)
    sched = driver.load(name, params)
    prog = driver.compiled(sched).program
    docs = [cost_spec("latency=1ms,overhead=0.01")]
    pb = Problem(
        sched,
        prog,
        random_layer_table(rng, sched.num_stages + 3),
        np.ones(sched.num_ranks),
        np.full(sched.num_ranks, np.nan),
        docs,
    )
    for bounds in (pb.uniform(), (0, *range(1, sched.num_stages), pb.L)):
        split = pb.evaluate(bounds)
        room = driver.simulation(sched, [*docs, pb.cost_doc(bounds)])
        assert split.step == room.stats.makespan


def test_an_order_block_stays_a_policy_until_the_driver_resolves_it():
    from pipec.errors import Source
    from pipec.frontend.load import evaluate_source
    from pipec.ir.schedule import Policy

    text = 'schedule "t" (p: int = 3, m: int = 4) {\n stages p\n order r { prefer B, F  inflight <= p - r }\n}\n'
    source = Source("t.pipe", text)
    raw = evaluate_source(source, {})
    assert isinstance(raw.order, Policy) and raw.order.inflight == (3.0, 2.0, 1.0) and raw.num_ops == 0
    built = driver.build(source, {})
    assert built.order is None and built.num_ops == 3 * 4 * 2
    # the policy's orders are 1F1B's here, and so are its simulated numbers
    assert driver.simulation(built).stats.makespan == driver.simulation(driver.load("1f1b", p=3, m=4)).stats.makespan
    one = driver.build(source, {}, ranks=[1])  # a rank of a run: the others' orders left empty
    assert [len(r) for r in one.ranks] == [0, len(built.ranks[1]), 0]
