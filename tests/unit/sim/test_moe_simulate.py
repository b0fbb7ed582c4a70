"""The simulator with expert parallelism: ops cut at their all-to-alls, an overlapped pair's segments in
`pair_order`, all-to-alls queued on each rank's expert link (pipec/sim/segments.py, pipec/sim/simulate.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pipec.driver import build, moe_layers_of, simulation
from pipec.errors import PipecError, Source
from pipec.formats.trace import trace_events
from pipec.ir.dataparallel import DataParallel
from pipec.ir.experts import Experts
from pipec.ir.opcodes import BWD, FWD
from pipec.sim.simulate import simulate

# One rank, one stage, two micro-batches: F(0), then F(1) overlapped with B(0), then B(1). Full backwards.
PAIR = """schedule "pair" (p: int = 1, m: int = 2) {
    stages 1
    ops F, B
    cost F = 3
    cost B = 3
    rank r { F(0)  F(1) & B(0)  B(1) }
}"""


def sim(text: str, a2a: float, overlap: bool = True, layers=(1,), ep: int = 2, **params):
    sched = build(Source("pair.pipe", text), params)
    return simulation(
        sched, [{"a2a": a2a, "_from": "test"}], None, None, None, DataParallel(ep), Experts(ep, ep), layers, overlap
    )


def spans(tl, op, mb) -> tuple[float, float]:
    j = int(np.flatnonzero((tl.op == op) & (tl.mb == mb))[0])
    return float(tl.start[j]), float(tl.end[j])


def test_a_pair_hides_each_all_to_all_behind_the_other_ops_segment():
    # Segments of 1 s (3 s over 3 segments), all-to-alls of 0.5 s. F(0): 0-1, a2a, 1.5-2.5, a2a, 3-4. The
    # pair alternates F1, B0, F1, B0, F1, B0 from 4, each segment 1 s, each all-to-all hidden: 4-10.
    # B(1) then 10-14 with its own two waits.
    s = sim(PAIR, 0.5)
    tl = s.timeline
    assert spans(tl, FWD, 0) == (0.0, 4.0)
    assert spans(tl, FWD, 1) == (4.0, 9.0) and spans(tl, BWD, 0) == (5.0, 10.0)
    assert spans(tl, BWD, 1) == (10.0, 14.0)
    assert s.stats.makespan == pytest.approx(14.0)
    assert s.stats.ranks[0].busy == pytest.approx(12.0)  # the segments, not the rows that span the pair
    assert len(tl.a2a_rank) == 8 and len(tl.seg_rank) == 12


def test_each_turn_of_a_pair_costs_its_handoff():
    # As above with `pair_handoff` 0.25 s: the pair's five turn changes (F1 -> B0 -> F1 ...) each start
    # the next segment 0.25 s after the last ends, computing nothing: the pair ends at 11.25, not 10, and
    # the busy time is the segments' alone. One op after the other there is no turn to hand over.
    def with_handoff(overlap: bool):
        sched = build(Source("pair.pipe", PAIR), {})
        doc = [{"a2a": 0.5, "pair_handoff": 0.25, "_from": "test"}]
        return simulation(sched, doc, None, None, None, DataParallel(2), Experts(2, 2), (1,), overlap)

    s = with_handoff(True)
    tl = s.timeline
    assert spans(tl, FWD, 1) == pytest.approx((4.0, 10.0)) and spans(tl, BWD, 0) == pytest.approx((5.25, 11.25))
    assert s.stats.makespan == pytest.approx(15.25)
    assert s.stats.ranks[0].busy == pytest.approx(12.0)
    assert with_handoff(False).stats.makespan == pytest.approx(16.0)


def test_without_overlap_a_pair_runs_one_op_after_the_other():
    s = sim(PAIR, 0.5, overlap=False)
    tl = s.timeline
    assert spans(tl, FWD, 1) == (4.0, 8.0) and spans(tl, BWD, 0) == (8.0, 12.0)
    assert s.stats.makespan == pytest.approx(16.0)


def test_all_to_alls_of_one_rank_queue_on_its_expert_link():
    # 2 s all-to-alls against 1 s segments: each waits for the one before it on the link (FIFO, one group).
    tl = sim(PAIR, 2.0).timeline
    a = np.argsort(tl.a2a_start)
    starts, ends = tl.a2a_start[a], tl.a2a_end[a]
    assert (starts[1:] >= ends[:-1] - 1e-12).all()
    # F(0) is 0-1, 3-4, 6-7 (each segment waits 2 s). In the pair from 7: F1's first all-to-all 8-10, B0's
    # issued at 9 waits for the link until 10, F1's second (issued 11) until 12, B0's second until 14.
    pair = starts >= 7.0
    assert starts[pair][:4].tolist() == [8.0, 10.0, 12.0, 14.0]
    assert spans(sim(PAIR, 2.0).timeline, BWD, 0) == (8.0, 17.0)


def test_an_odd_layer_count_against_an_even_one_still_runs_every_segment():
    # Megatron-LM 1852's case: the pair's ops issue different counts; the leftover segments run alone.
    text = PAIR.replace("stages 1", "stages 2").replace(
        "rank r { F(0)  F(1) & B(0)  B(1) }",
        "rank r {\n"
        "  F(0, stage: 0)  F(0, stage: 1)  F(1, stage: 0)  F(1, stage: 1) & B(0, stage: 1)\n"
        "  B(0, stage: 0)  B(1, stage: 1)  B(1, stage: 0) }",
    )
    s = sim(text, 0.25, layers=(1, 2))
    tl = s.timeline
    assert len(tl.a2a_rank) == 2 * (2 * 1 + 2 * 2) * 2  # F and B of both micro-batches, 2 per layer
    assert s.stats.ranks[0].busy == pytest.approx(12.0 * 2)


def test_no_expert_group_no_all_to_all():
    s = sim(PAIR, 0.5, ep=1)
    assert s.stats.makespan == pytest.approx(12.0) and not len(s.timeline.a2a_rank)


def test_the_gain_on_a_library_schedule_and_both_passes_agree():
    sched = build(Source("x", open_library("dualpipe-v")), {"p": 4, "m": 8})
    doc = [{"a2a": 0.2, "_from": "t"}]
    on = simulation(sched, doc, None, None, None, DataParallel(2), Experts(2, 4), (1,), True)
    off = simulation(sched, doc, None, None, None, DataParallel(2), Experts(2, 4), (1,), False)
    assert on.stats.makespan < off.stats.makespan
    events = simulate(on.compiled.program, on.costs, _events=True)
    assert np.allclose(np.sort(events.end), np.sort(on.timeline.end))


def test_bytes_over_the_expert_link():
    # a2a_bytes over ep_bandwidth plus ep_latency: 1 MB at 8 Mbit/s is 1 s, plus 0.5 s; a forward's dispatch
    # (its first all-to-all of each layer) takes the latency twice, its counts before its rows: 2 s.
    sched = build(Source("pair.pipe", PAIR), {})
    doc = [{"a2a_bytes": 1e6, "ep_latency": 0.5, "ep_bandwidth": 8e6, "_from": "t"}]
    tl = simulation(sched, doc, None, None, None, DataParallel(2), Experts(2, 2), (1,)).timeline
    dispatch = (tl.a2a_op == FWD) & (tl.a2a_index == 0)
    assert dispatch.sum() == 2 and len(tl.a2a_op) == 8
    assert np.allclose((tl.a2a_end - tl.a2a_start)[dispatch], 2.0)
    assert np.allclose((tl.a2a_end - tl.a2a_start)[~dispatch], 1.5)


def test_two_all_to_alls_in_flight_overlap_their_latencies_but_not_their_bytes():
    # 2 s of latency and 0.25 s of bytes (250 kB at 8 Mbit/s) per all-to-all, 1 s segments; a forward's
    # dispatch takes the latency twice (its counts, then its rows). F(0): 0-1, wait 4.25, 5.25-6.25, wait
    # 2.25, 8.5-9.5. The pair: F1 9.5-10.5 (its dispatch on the wire 10.5-10.75, arrives 14.75), B0
    # 10.5-11.5 (wire 11.5-11.75, 2 s of latency): both in flight at once; B0's arrives in order after
    # F1's, at 14.75, not at 16 as when the latency held the link too.
    sched = build(Source("pair.pipe", PAIR), {})
    doc = [{"a2a_bytes": 2.5e5, "ep_latency": 2.0, "ep_bandwidth": 8e6, "_from": "t"}]
    tl = simulation(sched, doc, None, None, None, DataParallel(2), Experts(2, 2), (1,)).timeline
    assert spans(tl, FWD, 0) == pytest.approx((0.0, 9.5))
    pair = np.argsort(tl.a2a_start)[2:4]  # after F(0)'s two, the pair's first two: F1's, then B0's
    assert tl.a2a_start[pair].tolist() == pytest.approx([10.5, 11.5])
    assert tl.a2a_end[pair].tolist() == pytest.approx([14.75, 14.75])
    # a rank's later all-to-all waits for the wire, not for the one before it to arrive: 2.5 MB each (2.5 s)
    slow = [{"a2a_bytes": 2.5e6, "ep_latency": 2.0, "ep_bandwidth": 8e6, "_from": "t"}]
    tl = simulation(sched, slow, None, None, None, DataParallel(2), Experts(2, 2), (1,)).timeline
    pair = np.argsort(tl.a2a_start)[2:4]
    assert tl.a2a_start[pair[1]] == pytest.approx(tl.a2a_start[pair[0]] + 2.5)


def test_the_trace_has_an_all_to_all_lane():
    tl = sim(PAIR, 0.5).timeline
    events = trace_events(tl)["traceEvents"]
    assert sum(e.get("cat") == "a2a" for e in events) == 8 and sum(e.get("cat") == "segment" for e in events) == 12


def test_the_trace_reads_back_with_its_all_to_alls(tmp_path):
    from pipec.formats.trace import read_trace, write_trace

    tl = sim(PAIR, 0.5).timeline
    write_trace(tl, tmp_path / "t.json")
    back = read_trace(tmp_path / "t.json")
    assert np.array_equal(back.a2a_start, tl.a2a_start) and np.array_equal(back.seg_end, tl.seg_end)
    assert np.array_equal(back.busy(), tl.busy())


def test_moe_layers_come_from_the_flag_then_the_cost_files_then_the_schedule():
    sched = build(Source("pair.pipe", PAIR.replace("cost B = 3", "cost B = 3\n    cost moe_layers = 2")), {})
    assert moe_layers_of(sched) == (2,)
    assert moe_layers_of(sched, [{"moe_layers": 3}]) == (3,)
    assert moe_layers_of(sched, [{"moe_layers": 3}], (1,)) == (1,)
    with pytest.raises(PipecError, match="E801"):
        moe_layers_of(sched, [{"moe_layers": 1.5}])


def open_library(name: str) -> str:
    from pipec.frontend.library import read

    return read(name).text


def test_the_pictures_and_the_viewer_have_an_all_to_all_lane(tmp_path):
    from pipec.view.html import view_document
    from pipec.view.render import Panel, plot_timelines, text_gantt

    tl = sim(PAIR, 0.5).timeline
    text = text_gantt(tl, width=400)
    assert " a2a" in text and text.count("F1") >= 3  # F1 drawn as its three segments
    plot_timelines([Panel(tl, "moe")], tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 1000
    sched = build(Source("pair.pipe", PAIR), {})
    doc = view_document(
        sched, (), [{"a2a": 0.5, "_from": "t"}], None, None, DataParallel(2), None, None, Experts(2, 2), (1,)
    )
    assert doc["panels"][0]["a2a_off"][-1] == 8


def test_an_expert_group_across_replica_datacenters_takes_the_link_between_them():
    from pipec.frontend.topology import read_topology, with_topology
    from pipec.sim.costs import cost_model

    sched = build(Source("pair.pipe", PAIR), {})
    text = 'dc "east" replicas 0 .. 1  dc "west" replicas 1 .. 2  link "east" <-> "west" latency 5ms bandwidth 1Gbps'
    across = with_topology(sched, read_topology(text, sched))
    doc = [{"a2a_bytes": 2048, "ep_latency": 1e-4, "ep_bandwidth": 8e12, "_from": "t"}]
    stage, rank = np.array([0]), np.array([0])
    assert cost_model(across, doc).a2a_time(stage, rank, 2, 2)[0] == pytest.approx(5e-3 + 2048 * 8 / 1e9)
    assert cost_model(sched, doc).a2a_time(stage, rank, 2, 2)[0] == pytest.approx(1e-4 + 2048 * 8 / 8e12)
    # 4 replicas in groups of 2 inside each datacenter: the expert link inside one
    text4 = 'dc "east" replicas 0 .. 2  dc "west" replicas 2 .. 4  link "east" <-> "west" latency 5ms'
    inside = with_topology(sched, read_topology(text4, sched))
    assert cost_model(inside, doc).a2a_time(stage, rank, 2, 4)[0] == pytest.approx(1e-4 + 2048 * 8 / 8e12)
    assert cost_model(inside, doc).a2a_time(stage, rank, 4, 4)[0] > 5e-3  # a group of 4 spans both


@pytest.mark.parametrize(
    ("name", "params"),
    [("dualpipe-v", {"p": 3, "m": 6}), ("combined-1f1b", {"p": 3, "v": 2, "m": 6}), ("zb-v", {"p": 3, "m": 6})],
)
def test_free_all_to_alls_change_nothing(name, params):
    # Cut ops whose all-to-alls take no time compute what uncut ones do: the same makespan and busy time,
    # and one op after the other the same op ends (overlapped, a pair's two ops end at other times inside
    # the same span).
    sched = build(Source("x", open_library(name)), params)
    plain = simulation(sched, [], None, None, None, DataParallel(2))
    for overlap in (True, False):
        cut = simulation(
            sched, [{"a2a": 0.0, "_from": "t"}], None, None, None, DataParallel(2), Experts(2, 2), (2,), overlap
        )
        assert len(cut.timeline.a2a_rank) > 0
        assert cut.stats.makespan == pytest.approx(plain.stats.makespan)
        if not overlap:
            assert np.allclose(np.sort(cut.timeline.end), np.sort(plain.timeline.end))
        assert np.allclose(cut.timeline.busy(), plain.timeline.busy())
