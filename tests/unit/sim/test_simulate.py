"""The simulator, the cost model, the numbers, and the pictures (trace, plot, text Gantt).

Closed forms from the papers (GPipe, 1F1B, Megatron's interleaved 1F1B, Zero Bubble's ZB-H1, ZB-H2 and
ZB-V, the latency lower bound of Zero Bubble's Appendix B), a hand-computed case with latency and
bandwidth, an independent instruction-by-instruction reference simulator, and properties over random
valid schedules with random costs.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli as run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo import ROOT
from strategies import deps, random_schedules

from pipec.api import load
from pipec.driver import build
from pipec.errors import PipecError, Source
from pipec.formats.trace import read_trace, trace_events, write_trace
from pipec.frontend import library
from pipec.ir.program import BWD, FWD, OFFLOAD, RECOMPUTE, RECV_ACT, RECV_GRAD, RELOAD, SEND_ACT, SEND_GRAD, WGRAD
from pipec.passes.compiler import compile_schedule
from pipec.sim.cost_files import cost_spec, dump_costs, normalize, parse_overrides, read_cost_file
from pipec.sim.costs import cost_model
from pipec.sim.memory import memory_model, rank_memory
from pipec.sim.memtime import memory_curves, timeline_curves
from pipec.sim.simulate import simulate, stats
from pipec.sim.timeline import Timeline
from pipec.view.render import Panel, plot_timelines, text_gantt

SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sim(name: str, costs: dict | None = None, memory: dict | None = None, **params):
    s = load(name, **params)
    prog = compile_schedule(s).program
    tl = simulate(prog, cost_model(s, [normalize(costs)] if costs else []))
    return stats(tl, memory_model(s, memory)), tl


# ---------------------------------------------------------------- closed forms


def test_1f1b_p4_m8_bubble_is_exactly_3_11():
    rc, out, err = run("simulate", "1f1b", "-D", "p=4", "-D", "m=8", "--json")
    assert rc == 0, err
    doc = json.loads(out)["results"][0]
    assert doc["bubble_rate"] == 3 / 11 and doc["bubble_rate_fraction"] == "3/11"
    assert doc["makespan"] == 33 and doc["bubble_time"] == 9 and doc["peak_memory"] == 4
    assert [r["busy"] for r in doc["per_rank"]] == [24] * 4
    assert [r["idle"] for r in doc["per_rank"]] == [9, 6, 3, 0]
    assert doc["per_rank"][3]["memory_curve"] == [[0, 0], [3, 1], [27, 0]]  # one activation, F to B, back to back
    assert doc["per_rank"][0]["memory_curve"] == [[0, 1], [1, 2], [2, 3], [3, 4], [24, 3], [27, 2], [30, 1], [33, 0]]
    assert doc["costs"]["free_comm"] is True


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_rate_over_a_grid(name):
    for p in range(1, 9):
        for m in range(1, 3 * p + 2):
            st_, _ = sim(name, p=p, m=m)
            assert st_.bubble_rate == (p - 1) / (m + p - 1), (p, m)
            assert st_.makespan == 3 * (m + p - 1)


@pytest.mark.parametrize(("tf", "tb"), [(1.0, 2.0), (1.0, 1.0), (0.5, 1.5), (2.0, 3.0)])
def test_1f1b_with_uneven_forward_and_backward(tf, tb):
    for p, m in [(2, 3), (4, 8), (5, 7), (8, 16)]:
        st_, _ = sim("1f1b", {"F": tf, "B": tb, "W": 0.0}, p=p, m=m)
        assert st_.bubble_time == pytest.approx((p - 1) * (tf + tb))
        assert st_.makespan == pytest.approx((m + p - 1) * (tf + tb))


@pytest.mark.parametrize(("tf", "tb"), [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0), (0.5, 1.5)])
def test_interleaved_bubble_is_megatrons(tf, tb):
    """Per-rank times T_F, T_B split over v chunks: bubble time (p-1)(T_F+T_B)/v, rate below 1F1B's."""
    for p in (2, 3, 4, 8):
        for v in (1, 2, 3, 4):
            for m in (p, 2 * p, 3 * p):
                st_, _ = sim("interleaved-1f1b", {"F": tf / v, "B": tb / v, "W": 0.0}, p=p, v=v, m=m)
                assert st_.bubble_time == pytest.approx((p - 1) * (tf + tb) / v), (p, v, m)
                assert st_.ideal == pytest.approx(m * (tf + tb))
                one, _ = sim("1f1b", {"F": tf, "B": tb, "W": 0.0}, p=p, m=m)
                if v > 1 and p > 1:
                    assert st_.bubble_rate < one.bubble_rate


def test_interleaved_default_costs_are_per_rank_shares():
    """Defaults: T = 1 for a rank's share of the model, so chunks cost 1/v and the formula holds as is."""
    st_, tl = sim("interleaved-1f1b", p=4, v=2, m=8)
    assert set(np.round(tl.end - tl.start, 12).tolist()) == {0.5, 1.0}
    assert st_.bubble_time == pytest.approx(3 * (1 + 2) / 2)


@pytest.mark.parametrize(("tf", "tb", "tw"), [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1.5, 0.5), (1.5, 1, 0.5)])
def test_zb_h1_bubble_and_memory(tf, tb, tw):
    for p, m in [(2, 4), (3, 3), (4, 8), (4, 12), (6, 12)]:
        st_, _ = sim("zb-h1", {"F": tf, "B": tb, "W": tw}, p=p, m=m)
        assert st_.bubble_time == pytest.approx((p - 1) * (tf + tb - tw)), (p, m)
        one, _ = sim("1f1b", {"F": tf, "B": tb, "W": tw}, p=p, m=m)
        assert st_.peak_memory == one.peak_memory == p
        if (tf, tb, tw) == (1, 1, 1):
            assert st_.bubble_time == pytest.approx(one.bubble_time / 3)


@pytest.mark.parametrize(("tf", "tb", "tw"), [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1.5, 0.5), (2, 2, 1)])
def test_zb_h2_bubble(tf, tb, tw):
    for p in (2, 3, 4, 6):
        for m in (2 * p - 1, 2 * p, 4 * p):
            st_, _ = sim("zb-h2", {"F": tf, "B": tb, "W": tw}, p=p, m=m)
            # Zero Bubble's formula is for each rank's span (`cost`); the bubble, on the makespan from the
            # step's start, adds the warm-up before the last rank's first op (issue 15: one definition).
            assert st_.cost - st_.ideal == pytest.approx((p - 1) * (tf + tb - 2 * tw)), (p, m)
            assert st_.bubble_time == pytest.approx(st_.makespan - st_.ideal) and st_.makespan >= st_.cost
            assert st_.peak_memory <= 2 * p  # about twice 1F1B's


def test_zb_v_zero_bubble_at_1f1b_memory():
    """Equal times: no bubble within any rank's span (only the warm-up wait remains: (p - 1) chunk
    forwards before the last rank starts), at 1F1B's peak memory when each of the two chunks holds half a
    rank's layers (act 1/2 per stage)."""
    for p in (2, 3, 4, 6, 8):
        for m in (2 * p - 1, 2 * p, 3 * p, 5 * p):
            st_, _ = sim("zb-v", {"F": 0.5, "B": 0.5, "W": 0.5}, {"act": 0.5, "wact": 0.25}, p=p, m=m)
            one, _ = sim("1f1b", p=p, m=m)
            assert st_.cost == st_.ideal, (p, m)
            assert st_.bubble_time == pytest.approx((p - 1) * 0.5) and st_.bubble_rate > 0, (p, m)
            assert st_.peak_memory == one.peak_memory == p
            assert st_.makespan < one.makespan


def test_latency_lower_bound_for_1f1b():
    """Zero Bubble, Appendix B: with link latency L, 1F1B's makespan grows by at least 2(p-1)L."""
    for p in (2, 3, 4, 8):
        for m in (1, p, 2 * p):
            base, _ = sim("1f1b", p=p, m=m)
            for lat in (0.1, 0.5, 2.0):
                st_, _ = sim("1f1b", {"latency": lat}, p=p, m=m)
                assert st_.makespan >= base.makespan + 2 * (p - 1) * lat - 1e-9, (p, m, lat)


def test_1f1b_p2_by_hand():
    """p=2, m=3, T_F=1, full backward 2, message time d = L + bytes/bandwidth (no queueing: d <= T_F).

    rank 0: F0 F1 B0 F2 B1 B2; rank 1: F0 B0 F1 B1 F2 B2.
      r0 F0 [0,1], F1 [1,2]              -> acts arrive 1+d, 2+d
      r1 F0 [1+d,2+d], B0 [2+d,4+d]      -> grad 0 arrives 4+2d
      r1 F1 [4+d,5+d], B1 [5+d,7+d]      -> grad 1 arrives 7+2d
      r0 B0 [4+2d,6+2d], F2 [6+2d,7+2d]  -> act 2 arrives 7+3d
      r0 B1 [7+2d,9+2d]
      r1 F2 [7+3d,8+3d], B2 [8+3d,10+3d] -> grad 2 arrives 10+4d
      r0 B2 [10+4d,12+4d]: makespan 12 + 4d.
    """
    costs = {"latency": 0.25, "act_bytes": 1_000_000, "bandwidth": "16Mbps"}  # d = 0.25 + 0.5
    st_, tl = sim("1f1b", costs, p=2, m=3)
    d = 0.75
    assert st_.makespan == 12 + 4 * d
    r0 = [(s, e) for _, _, _, s, e in tl.rank_events(0)]
    assert r0 == [
        (0, 1),
        (1, 2),
        (4 + 2 * d, 6 + 2 * d),
        (6 + 2 * d, 7 + 2 * d),
        (7 + 2 * d, 9 + 2 * d),
        (10 + 4 * d, 12 + 4 * d),
    ]
    r1 = [(s, e) for _, _, _, s, e in tl.rank_events(1)]
    assert r1[0] == (1 + d, 2 + d) and r1[-1] == (8 + 3 * d, 10 + 3 * d)
    assert list(tl.msg_arrival - tl.msg_send) == [d] * 6
    assert list(tl.msg_bytes) == [1e6] * 6


def test_overhead_by_hand():
    """GPipe p=2 m=1, T_F=1, full backward 2, overhead o per send and receive instruction.

    rank 0: FWD, SEND_ACT, RECV_GRAD, BWD; rank 1: RECV_ACT, FWD, BWD, SEND_GRAD.
      r0 F [0,1], its send's overhead ends at 1+o: the activation leaves then; the receive takes it to 1+2o
      r1 posts its receive [0,o], F [1+o,2+o], B [2+o,4+o], the gradient leaves at 4+2o
      r0 B [4+2o,6+2o]: makespan 6 + 2o.
    """
    o = 0.25
    st_, tl = sim("gpipe", {"overhead": o}, p=2, m=1)
    assert st_.makespan == 6 + 2 * o
    assert [(s, e) for _, _, _, s, e in tl.rank_events(1)] == [(1 + o, 2 + o), (2 + o, 4 + o)]
    assert sorted(tl.msg_send.tolist()) == [1 + o, 4 + 2 * o]


def test_messages_on_one_link_queue_in_order():
    """Bytes over bandwidth: a message starts on the wire only after the previous one left."""
    costs = {"act_bytes": 2_000_000, "bandwidth": "8Mbps"}  # 2 s on the wire per message, T_F = 1
    _, tl = sim("gpipe", costs, p=2, m=3)
    acts = np.flatnonzero((tl.msg_kind == 0) & (tl.msg_src == 0))
    assert tl.msg_send[acts].tolist() == [1, 2, 3]
    assert tl.msg_arrival[acts].tolist() == [3, 5, 7]


# ---------------------------------------------------------------- the cost model


def test_cost_overrides_files_and_precedence(tmp_path):
    s = load("1f1b", p=4, m=8)
    assert parse_overrides("F=1,B=2,W=1") == {"F": 1.0, "B": 2.0, "W": 1.0, "_from": "--cost"}
    toml = tmp_path / "c.toml"
    toml.write_text(
        'F = [1, 2, 3, 4]\nB = "2ms"\nact_bytes = "1MiB"\n[links.dc]\nlatency = "40ms"\nbandwidth = "10Gbps"\n'
    )
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"F": 5, "comm": 0.1, "ranks_per_node": 2}))
    m = cost_model(s, [cost_spec(str(toml)), cost_spec(str(js)), cost_spec("W=0.5")])
    assert m.F.tolist() == [5.0] * 4 and m.B.tolist() == [0.002] * 4 and m.W.tolist() == [0.5] * 4
    assert m.act_bytes.tolist() == [2**20] * 4 and m.grad_bytes.tolist() == [0, 2**20, 2**20, 2**20]
    assert m.comm.tolist() == [0.1] * 4
    # ranks_per_node=2 makes (0,1) and (2,3) node links (built-in none: free), the rest dc links.
    assert m.latency[0, 2] == 0.04 and m.latency[0, 1] == 0.0 and m.bandwidth[1, 2] == 10e9 / 8
    back = read_cost_file(
        _write(tmp_path / "d.toml", dump_costs({"F": [1.0, 2.0, 3.0, 4.0], "links": {"cross": {"latency": 0.04}}}))
    )
    assert back["F"] == [1.0, 2.0, 3.0, 4.0] and back["links"] == {"cross": {"latency": 0.04}}
    back = read_cost_file(_write(tmp_path / "d.json", dump_costs({"B": 2.5}, toml=False)))
    assert back["B"] == 2.5


def test_a_given_b_without_w_is_the_full_backward():
    s = load("1f1b", p=2, m=2)
    full = np.array([BWD]), np.array([0])
    assert cost_model(s).compute_time(*full).tolist() == [2.0]  # B + W = 1 + 1
    assert cost_model(s, [parse_overrides("B=3")]).compute_time(*full).tolist() == [3.0]
    assert cost_model(s, [parse_overrides("B=3,W=1")]).compute_time(*full).tolist() == [4.0]
    rc, out, _ = run("simulate", str(ROOT / "examples/extra_warmup_1f1b.pipe"), "--json")  # cost F = 1, B = 2
    assert rc == 0 and json.loads(out)["results"][0]["per_rank"][0]["busy"] == 8 * 3


def test_per_rank_share_costs():
    """T_F, T_B, T_W: a rank's share of the model, split over its chunks."""
    s = load("zb-v", p=4, m=8)
    m = cost_model(s, [parse_overrides("T_F=1,T_B=2,T_W=0.5")])
    assert m.F.tolist() == [0.5] * 8 and m.B.tolist() == [1.0] * 8 and m.W.tolist() == [0.25] * 8
    m = cost_model(s, [parse_overrides("T_F=1"), parse_overrides("F=3")])
    assert m.F.tolist() == [3.0] * 8
    m = cost_model(s, [parse_overrides("overhead=50us"), parse_overrides("F=3")])
    assert m.overhead == pytest.approx(50e-6) and m.describe()["overhead"] == m.overhead and not m.free_comm
    assert cost_model(s, [parse_overrides("overhead=50us"), parse_overrides("overhead=0")]).overhead == 0
    with pytest.raises(PipecError, match="not both"):
        parse_overrides("F=1,T_F=1")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("F=abc", "cannot read `abc` as a time"),
        ("F=-1", "finite number >= 0"),
        ("speed=3", "unknown cost `speed`"),
        ("latency=10Gbps", "cannot read `10Gbps` as a time"),
        ("overhead=-5us", "cannot read `-5us` as a time"),
        ("overhead=-1", "finite number >= 0"),
        ("bandwidth=0", "bandwidth must be positive"),
        ("bandwidth.wan=1Gbps", "unknown link class `wan`"),
        ("F", "expected KEY=VALUE"),
    ],
)
def test_bad_cost_overrides_are_e601(spec, message):
    with pytest.raises(PipecError) as e:
        cost_spec(spec) if "=" in spec else parse_overrides(spec)
    assert e.value.code == "E801" and message in str(e.value.diagnostics[0].message)


def test_bad_cost_files_are_e601(tmp_path):
    bad = {"a.toml": "F = [1, 2\n", "b.json": "[1, 2]", "c.json": '{"F": [1, 2]}', "d.toml": "version = 7\n"}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
    s = load("1f1b", p=4, m=8)
    for name in bad:
        with pytest.raises(PipecError) as e:
            cost_model(s, [read_cost_file(tmp_path / name)])
        assert e.value.code == "E801", name
    rc, _, err = run("simulate", "1f1b", "--cost", str(tmp_path / "c.json"))
    assert rc == 1 and "error[E801]" in err and "lists 2 values but the schedule has 4 stages" in err
    rc, _, err = run("simulate", "1f1b", "--cost", str(tmp_path / "missing.toml"))
    assert rc == 1 and "error[E801]" in err and "cannot read cost file" in err


TOPO = """\
schedule "two-dc" (p: int = 4, m: int = 4) {
    stages p
    ops F, B
    cost F = 0.01
    cost B = 0.02
    cost comm = 0.001
    topology {
        dc "east" ranks 0 .. 2
        dc "west" ranks 2 .. 4
        link "east" <-> "west" latency 40ms bandwidth 10Gbps
    }
    rank r {
        for i in 0 .. m { F(i) }
        for i in 0 .. m { B(i) }
    }
}
"""


def test_topology_links_and_declared_costs():
    s = build(Source("two-dc.pipe", TOPO), {})
    m = cost_model(s)
    assert m.F.tolist() == [0.01] * 4 and m.B.tolist() == [0.02] * 4 and m.comm.tolist() == [0.001] * 4
    assert m.latency[1, 2] == 0.04 and m.bandwidth[1, 2] == 10e9 / 8
    assert m.latency[0, 1] == 10e-6 and m.bandwidth[0, 1] == 100e9 / 8  # built-in same-datacenter link
    assert not m.free_comm
    m2 = cost_model(s, [parse_overrides("latency.cross=1ms,bandwidth.dc=1Gbps")])
    assert m2.latency[1, 2] == 0.001 and m2.bandwidth[0, 1] == 1e9 / 8 and m2.bandwidth[1, 2] == 10e9 / 8
    tl = simulate(compile_schedule(s).program, m)
    cross = (tl.msg_src == 1) & (tl.msg_dst == 2)
    np.testing.assert_allclose((tl.msg_arrival - tl.msg_send)[cross][0], 0.001 + 0.04)  # no bytes declared


# ---------------------------------------------------------------- an independent reference and properties


def reference(prog, costs) -> tuple[dict, dict]:
    """Instruction by instruction, rank by rank, until nothing moves: op key -> (start, end), msg -> arrival.
    Every send and receive instruction takes the rank `overhead`; a message leaves when its send's is over."""
    S = prog.num_stages
    o = costs.overhead
    pc, clock = [0] * prog.num_ranks, [0.0] * prog.num_ranks
    times, arrival, wire, last = {}, {}, {}, {}
    host, reloaded = [0.0] * prog.num_ranks, {}  # memory ops: each rank's host link, when a RELOAD ends
    moved = True
    while moved:
        moved = False
        for r, rp in enumerate(prog.ranks):
            while pc[r] < len(rp):
                op, mb, s, peer = (int(x[pc[r]]) for x in (rp.op, rp.mb, rp.stage, rp.peer))
                if op in (OFFLOAD, RELOAD):  # on the host link, one after the other: offload, else half an F
                    given = costs.offload[s] if costs.offload is not None else math.nan
                    host[r] = max(clock[r], host[r]) + (0.5 * costs.F[s] if math.isnan(given) else given)
                    if op == RELOAD:
                        reloaded[(mb, s)] = host[r]
                elif op == RECOMPUTE:  # a forward again, after what its RELOAD brings back
                    start = max(clock[r], reloaded.get((mb, s), 0.0))
                    clock[r] = start + costs.F[s]
                    times[("R", mb, s)] = (start, clock[r])
                elif op in (FWD, BWD, WGRAD):
                    need = None
                    if op == BWD:
                        clock[r] = max(clock[r], reloaded.get((mb, s), 0.0))
                    if op == FWD and s > 0 and prog.placement[s - 1] != r:
                        need = ("act", mb, s - 1)
                    if op == BWD and s < S - 1 and prog.placement[s + 1] != r:
                        need = ("grad", mb, s + 1)
                    if need is not None:
                        if need not in arrival:
                            break
                        clock[r] = max(clock[r], arrival[need])
                    dur = costs.F[s] if op == FWD else costs.W[s] if op == WGRAD else costs.B[s]
                    if op == BWD and not prog.split_backward:
                        dur = costs.B[s] + costs.W[s]
                    if costs.unit_weight is not None:  # token slices: `op_fixed`, then the unit's weight
                        fixed = min(costs.op_fixed[s], dur)
                        dur = fixed + (dur - fixed) * costs.unit_weight[s, mb]
                    start = clock[r]
                    clock[r] += dur
                    times[("FBW"[op], mb, s)] = (start, clock[r])
                elif op in (RECV_ACT, RECV_GRAD):
                    clock[r] += o
                elif op in (SEND_ACT, SEND_GRAD):
                    clock[r] += o
                    kind = "act" if op == SEND_ACT else "grad"
                    size = (costs.act_bytes if kind == "act" else costs.grad_bytes)[s]
                    if costs.unit_share is not None:  # a unit's message: its share of a sequence's bytes
                        size = size * costs.unit_share[mb]
                    bw = costs.bandwidth[r, peer]
                    t0 = max(clock[r], wire.get((r, peer), 0.0))
                    wire[(r, peer)] = t0 + (size / bw if size > 0 and math.isfinite(bw) else 0.0)
                    a = max(wire[(r, peer)] + (costs.latency[r, peer] + costs.comm[s]), last.get((r, peer), 0.0))
                    arrival[(kind, mb, s)] = last[(r, peer)] = a
                pc[r] += 1
                moved = True
    assert all(pc[r] == len(rp) for r, rp in enumerate(prog.ranks))
    return times, arrival


@st.composite
def random_costs(draw, num_stages: int) -> dict:
    t = st.floats(0.05, 3.0, allow_nan=False).map(lambda x: round(x, 3))
    doc = {k: draw(st.lists(t, min_size=num_stages, max_size=num_stages)) for k in ("F", "B", "W")}
    if draw(st.booleans()):
        doc["latency"] = draw(st.floats(0, 2.0).map(lambda x: round(x, 3)))
        doc["comm"] = draw(
            st.lists(st.floats(0, 0.5).map(lambda x: round(x, 3)), min_size=num_stages, max_size=num_stages)
        )
        doc["act_bytes"] = draw(st.lists(st.integers(0, 4_000_000), min_size=num_stages, max_size=num_stages))
        doc["bandwidth"] = draw(st.sampled_from(["8Mbps", "16Mbps", "1Gbps"]))
    if draw(st.booleans()):
        doc["overhead"] = draw(st.sampled_from([0.01, 0.25]))
    return normalize(doc)


@SLOW
@given(random_schedules(), st.data())
def test_random_schedules_run_in_order_after_their_inputs(rs, data):
    sched = build(Source("random.pipe", rs.text()), {})
    prog = compile_schedule(sched).program
    costs = cost_model(sched, [data.draw(random_costs(sched.num_stages))])
    tl = simulate(prog, costs)
    S = sched.num_stages
    kinds = sched.kinds
    ev = {
        (kinds[o] if o < 2 or sched.split_backward else "W", int(i), int(s)): (int(r), float(a), float(b))
        for r, o, i, s, a, b in zip(tl.rank, tl.op, tl.mb, tl.stage, tl.start, tl.end)
    }
    assert len(ev) == sched.num_ops
    # Each rank's ops in its order, back to back at best, each lasting its cost.
    for r in range(sched.num_ranks):
        order = [
            (kinds[k], int(i), int(s)) for k, i, s in zip(sched.ranks[r].kind, sched.ranks[r].mb, sched.ranks[r].stage)
        ]
        got = [
            op
            for op in sorted(ev, key=lambda op: (ev[op][1], order.index(op) if op in order else -1))
            if ev[op][0] == r
        ]
        assert got == order
        for a, b in zip(order, order[1:]):
            assert ev[b][1] >= ev[a][2]
    msgs = {
        ("act" if k == 0 else "grad", int(i), int(s)): (float(t0), float(t1), int(src), int(dst))
        for k, i, s, src, dst, t0, t1 in zip(
            tl.msg_kind, tl.msg_mb, tl.msg_stage, tl.msg_src, tl.msg_dst, tl.msg_send, tl.msg_arrival
        )
    }
    finish: dict = {}
    for op in sorted(ev, key=lambda op: ev[op][1]):
        r, start, end = ev[op]
        k, i, s = op
        full_b = costs.B[s] if sched.split_backward else costs.B[s] + costs.W[s]
        dur = {"F": costs.F[s], "B": full_b, "W": costs.W[s]}[k]
        assert end - start == pytest.approx(dur)
        earliest = 0.0
        for d in deps(k, i, s, S, sched.split_backward):
            dr, _, dend = ev[d]
            assert start >= dend - 1e-9, (op, d)  # never before its inputs
            if dr != r:
                key = ("act" if k == "F" else "grad", i, d[2])
                send, arr, src, dst = msgs[key]
                assert (src, dst) == (dr, r) and send >= dend - 1e-9 and start >= arr - 1e-9
                size = (costs.act_bytes if key[0] == "act" else costs.grad_bytes)[d[2]]
                wire = size / costs.bandwidth[dr, r] if size > 0 and math.isfinite(costs.bandwidth[dr, r]) else 0.0
                delay = costs.latency[dr, r] + costs.comm[d[2]] + wire
                assert arr >= send + delay - 1e-9
                earliest = max(earliest, finish[d] + delay)
            else:
                earliest = max(earliest, finish[d])
        finish[op] = earliest + dur  # the critical path, ignoring that a rank runs one op at a time
    assert tl.makespan >= max(finish.values(), default=0.0) - 1e-9
    st_ = stats(tl)
    assert tl.makespan >= st_.ideal - 1e-9 and 0 <= st_.bubble_rate < 1
    # The same numbers as the independent reference (which sums overheads one by one: equal to rounding),
    # and as a second run (deterministic).
    times, arrival = reference(prog, costs)
    for op, (_, start, end) in ev.items():
        assert times[op] == pytest.approx((start, end), rel=1e-12, abs=1e-12)
    for key, (_, arr, _, _) in msgs.items():
        assert arrival[key] == pytest.approx(arr, rel=1e-12, abs=1e-12)
    again = simulate(prog, costs)
    assert np.array_equal(again.start, tl.start) and np.array_equal(again.msg_arrival, tl.msg_arrival)


@pytest.mark.parametrize("name", library.names())
@pytest.mark.parametrize("overhead", [0, 0.125])
def test_library_matches_reference_and_memory_model(name, overhead):
    s = load(name)
    prog = compile_schedule(s).program
    costs = cost_model(s, [parse_overrides(f"F=1,B=1.5,W=0.5,latency=0.25,overhead={overhead}")])
    tl = simulate(prog, costs)
    times, _ = reference(prog, costs)  # binary fractions: sums in any order agree exactly
    got = {
        ("R" if o == RECOMPUTE else "FBW"[o], int(i), int(st_)): (float(a), float(b))
        for o, i, st_, a, b in zip(tl.op, tl.mb, tl.stage, tl.start, tl.end)
    }
    assert got == times
    peaks = memory_curves(tl, prog, memory_model(s)).device_peak.tolist()  # memory ops included
    assert peaks == [r.peak for r in rank_memory(s)]


def test_memory_curve_steps():
    st_, tl = sim("1f1b", p=2, m=2)
    curves = timeline_curves(tl, memory_model(load("1f1b", p=2, m=2)))
    (t0, v0), (t1, v1) = curves.device
    # rank 0: F0 at 0 (+1), F1 at 1 (+1), B0 ends 6 (-1), B1 ends 9 (-1)
    assert t0.tolist() == [0, 1, 6, 9] and v0.tolist() == [1, 2, 1, 0]
    # rank 1: F0 at 1 (+1); at 4, B0 ends (-1) and F1 starts (+1): no change; B1 ends 7 (-1)
    assert t1.tolist() == [0, 1, 7] and v1.tolist() == [0, 1, 0]
    # at 4 on rank 1, B0's free comes before F1's allocation (the rank's order): the peak stays 1
    assert curves.device_peak.tolist() == [2, 1] and [r.peak_memory for r in st_.ranks] == [2, 1]


def test_a_program_that_cannot_finish_is_e403():
    s = load("1f1b", p=2, m=2)
    prog = compile_schedule(s).program
    rp = prog.ranks[0]
    keep = rp.op != SEND_ACT
    from dataclasses import replace

    from pipec.ir.program import RankProgram

    cut = RankProgram(rp.op[keep], rp.mb[keep], rp.stage[keep], rp.peer[keep], rp.group[keep])
    with pytest.raises(PipecError) as e:
        simulate(replace(prog, ranks=(cut, prog.ranks[1])), cost_model(s))
    message = e.value.diagnostics[0].message
    assert e.value.code == "E403" and "never sends the activation of micro-batch 0 from stage 0" in message


# ---------------------------------------------------------------- pictures


def _timeline(name="zb-v", costs="latency=0.2,act_bytes=1MB,bandwidth=80Mbps", **params):
    s = load(name, **params)
    return s, simulate(compile_schedule(s).program, cost_model(s, [parse_overrides(costs)]))


def test_trace_round_trips_and_is_well_formed(tmp_path):
    s, tl = _timeline()
    path = tmp_path / "t.json"
    write_trace(tl, path, memory_model(s))
    back = read_trace(path)
    fields = (
        "rank op mb stage start end msg_kind msg_mb msg_stage msg_src msg_dst msg_send msg_arrival msg_bytes msg_post"
    )
    for f in fields.split():
        assert np.array_equal(getattr(back, f), getattr(tl, f), equal_nan=True), f
    for f in ("num_ranks", "schedule", "params", "origin"):
        assert getattr(back, f) == getattr(tl, f)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(s.num_ranks)}
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"compute", "send", "recv"} <= threads
    xs = [e for e in events if e["ph"] == "X"]
    f0 = next(e for e in xs if e["cat"] == "FWD")
    assert f0["dur"] == pytest.approx(0.5e6)  # real microseconds: ZB-V chunks take 1/2 s by default
    outs = sorted(e["bind_id"] for e in xs if e.get("flow_out"))
    ins = sorted(e["bind_id"] for e in xs if e.get("flow_in"))
    assert outs == ins == list(range(1, len(tl.msg_send) + 1))
    by_id = {}
    for e in xs:
        if "bind_id" in e:
            by_id.setdefault(e["bind_id"], []).append(e)
    for a, b in by_id.values():  # a flow starts no later than it ends, from sender to receiver
        assert a["flow_out"] and b["flow_in"] and a["ts"] <= b["ts"] and a["pid"] != b["pid"]
    # Slices of one thread never partly overlap (trace viewers need them nested).
    lanes: dict = {}
    for e in xs:
        lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in lanes.values():
        spans.sort()
        for (_, a1), (b0, _) in zip(spans, spans[1:]):
            assert b0 >= a1 - 1e-6
    assert any(e["ph"] == "C" and e["name"] == "memory" for e in events)


def test_read_trace_refuses_other_files(tmp_path):
    for text in ("not json", json.dumps({"traceEvents": []}), json.dumps({"otherData": {"format": "x"}})):
        (tmp_path / "x.json").write_text(text)
        with pytest.raises(PipecError) as e:
            read_trace(tmp_path / "x.json")
        assert e.value.code == "E802"


def test_trace_of_an_empty_and_a_measured_timeline():
    z = np.zeros(0, dtype=np.int64)
    empty = Timeline(2, z, z, z, z, np.zeros(0), np.zeros(0))
    assert [e["name"] for e in trace_events(empty)["traceEvents"]].count("process_name") == 2
    measured = Timeline(
        1,
        np.array([0, 0]),
        np.array([FWD, FWD]),
        np.array([0, 1]),
        np.array([0, 0]),
        np.array([0.0, 0.5]),
        np.array([1.0, 1.5]),
        origin="measured",
    )
    ev = trace_events(measured)
    assert {e["tid"] for e in ev["traceEvents"] if e["ph"] == "X"} == {0, 1}  # overlapping ops get a second lane
    assert ev["otherData"]["origin"] == "measured"


def test_plot_png_and_svg(tmp_path):
    s = load("1f1b", p=8, m=16)
    prog = compile_schedule(s).program
    tl = simulate(prog, cost_model(s))
    mem = list(timeline_curves(tl, memory_model(s)).device)
    plot_timelines([Panel(tl, "1f1b", mem, 8.0)], tmp_path / "g.png")
    png = (tmp_path / "g.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 200_000
    _, tl2 = _timeline()
    plot_timelines([Panel(tl, "a"), Panel(tl2, "b")], tmp_path / "g.svg")
    svg = (tmp_path / "g.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg


def test_text_gantt():
    _, tl = sim("1f1b", p=2, m=2)
    # Three columns per time unit (room for `F0` and a space); `.` while idle.
    assert text_gantt(tl, width=80).splitlines() == [
        "       0              5",
        "rank 0 F0 F1 ......B0    ...B1",
        "rank 1 ...F0 B0    F1 B1    ......",
    ]
    _, tl = sim("zb-v", p=2, m=3)
    assert "f0" in text_gantt(tl)  # the second chunk in lower case
    wrapped = text_gantt(sim("1f1b", p=4, m=32)[1], width=60)
    assert all(len(line) <= 60 for line in wrapped.splitlines()) and wrapped.count("rank 3") > 1


# ---------------------------------------------------------------- the command line


def test_simulate_every_library_schedule_json_and_trace(tmp_path):
    for name in library.names():
        trace = tmp_path / f"{name}.json"
        rc, out, err = run("simulate", name, "--json", "--trace", str(trace), "--cost", "latency=0.01")
        assert rc == 0, (name, err)
        doc = json.loads(out)["results"][0]
        assert doc["schedule"] == name and doc["trace"] == str(trace) and doc["makespan"] > 0
        assert 0 <= doc["bubble_rate"] < 1 and len(doc["per_rank"]) == doc["ranks"]
        assert read_trace(trace).num_ranks == doc["ranks"]


def test_simulate_plot_and_table(tmp_path):
    png = tmp_path / "zbv.png"
    rc, out, err = run("simulate", "zb-v", "-D", "p=8", "-D", "m=16", "--plot", str(png))
    assert rc == 0, err
    assert out.startswith("zb-v (p=8 m=16): makespan ") and f"wrote plot to {png}" in out
    assert "rank  first" in out and png.stat().st_size < 200_000


def test_compare_side_by_side():
    rc, out, err = run("compare", "1f1b", "zb-h1", "interleaved-1f1b", "-D", "p=4", "-D", "m=8", "-D", "v=2")
    assert rc == 0, err
    head, *rows = out.strip().splitlines()
    assert head.split()[:4] == ["schedule", "params", "makespan", "bubble"]
    assert [r.split()[0] for r in rows] == ["1f1b", "zb-h1", "interleaved-1f1b"]
    assert "27.27%" in rows[0] and "11.11%" in rows[1] and "28.5" in rows[2]
    rc, out, _ = run("simulate", "1f1b", "zb-h1", "--json", "--cost", "F=1,B=2,W=1")
    assert rc == 0 and [d["schedule"] for d in json.loads(out)["results"]] == ["1f1b", "zb-h1"]
    rc, _, err = run("simulate", "1f1b", "zb-h1", "-D", "q=3")
    assert rc == 1 and "error[E205]: no schedule here takes parameter `q`" in err
    rc, _, err = run("simulate", "1f1b", "zb-h1", "--trace", "x.json")
    assert rc == 2 and "--trace takes one schedule" in err
    rc, _, err = run("simulate", "1f1b", "--plot", "x.gif")
    assert rc == 2


def test_show_timeline():
    rc, out, err = run("show", "zb-h1", "-D", "p=4", "-D", "m=8", "--timeline", "--width", "100")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("zb-h1 (p=4 m=8): makespan 27, bubble 11.1%")
    assert [ln.split()[1] for ln in lines[2:]] == ["0", "1", "2", "3"]
    rc, out, _ = run("show", "1f1b", "--timeline", "--ranks", "0,3", "--cost", "F=1,B=2", "--width", "200")
    assert rc == 0 and [ln[:6] for ln in out.splitlines()[2:]] == ["rank 0", "rank 3"]


def test_import_pipec_loads_neither_torch_nor_matplotlib():
    code = (
        "import sys, pipec, pipec.cli.app, pipec.sim.simulate, pipec.view.render, pipec.formats.trace, "
        "pipec.view.report, "
        "pipec.sim.costs; "
        "print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]


# ---------------------------------------------------------------- the documentation

DOC = ROOT / "docs" / "simulate.md"


def _console_runs() -> list[tuple[str, str]]:
    runs = []
    for block in re.findall(r"^```console\n(.*?)^```", DOC.read_text(), re.S | re.M):
        lines = block.split("\n")[:-1]
        starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
        for a, b in zip(starts, starts[1:] + [len(lines)]):
            runs.append((lines[a][2:], "".join(line + "\n" for line in lines[a + 1 : b])))
    return runs


@pytest.mark.parametrize(("command", "expected"), _console_runs())
def test_docs_console_runs_print_what_they_show(command, expected):
    argv = shlex.split(command)
    assert argv[0] == "pipec"
    rc, out, err = run(*argv[1:])
    assert (rc, out + err) == (0, expected)


def test_docs_python_snippets_run_and_pictures_are_small():
    snippets = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)
    exec(compile(snippets[-1], "docs/simulate.md", "exec"), {})
    pictures = re.findall(r"\(img/([^)]+\.png)\)", DOC.read_text())
    assert len(pictures) >= 3
    for name in pictures:
        path = ROOT / "docs" / "img" / name
        assert path.stat().st_size < 200_000, name
        assert f"$OUT/{name}" in (ROOT / "docs" / "img" / "make.sh").read_text()
