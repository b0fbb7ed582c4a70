"""PP x DP in the simulator (issue 17): the ring collectives' cost model, the collective stream that
overlaps compute, STEP and UNSHARD waiting for it, the DP link the topology chooses, and the pictures.

Hand-computed cases first (every number in a comment), then properties: with dp = 1, or with collectives
that cost nothing, every figure is exactly what the simulator of the commit before collectives gives.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo import ROOT
from strategies import random_schedules

from pipec.api import load
from pipec.driver import build
from pipec.errors import PipecError, Source
from pipec.formats.trace import read_trace, trace_events, write_trace
from pipec.ir.opcodes import CODE, OPCODES, REDUCE_GRAD, RESHARD, UNSHARD
from pipec.ir.program import Instr, Program, RankProgram
from pipec.ir.schedule import Datacenter, Link, Topology
from pipec.passes.lower import lower
from pipec.sim.cost_files import dump_costs, normalize, parse_overrides, read_cost_file
from pipec.sim.costs import cost_model, ring_time
from pipec.sim.simulate import simulate, stats
from pipec.view import report
from pipec.view.render import Panel, plot_timelines, text_gantt

BEFORE = "e05ca0c"  # the commit before the simulator knew collectives


def model(sched, **doc):
    return cost_model(sched, [normalize(doc)])


def times(prog: Program, costs, **kw):
    tl = simulate(prog, costs, **kw)
    return tl, stats(tl)


def with_ranks(prog: Program, ranks: list[list[Instr]], **kw) -> Program:
    return dataclasses.replace(prog, ranks=tuple(RankProgram.from_instructions(r) for r in ranks), **kw)


# ---------------------------------------------------------------- the ring formulas


def test_ring_formulas_by_hand():
    # B = 1 GB over 1 ms and 10 Gbps (1.25e9 B/s): B / b = 0.8 s.
    hop = [(1e-3, 1.25e9)]
    # all-reduce: 2(N-1) a + 2(N-1)/N B/b. N = 2: 0.002 + 0.8; N = 4: 0.006 + 1.2.
    assert ring_time("all_reduce", 2, 1e9, hop * 2) == pytest.approx(0.802)
    assert ring_time("all_reduce", 4, 1e9, hop * 4) == pytest.approx(1.206)
    # all-gather and reduce-scatter: (N-1) a + (N-1)/N B/b. N = 2: 0.001 + 0.4; N = 4: 0.003 + 0.6.
    for algo in ("all_gather", "reduce_scatter"):
        assert ring_time(algo, 2, 1e9, hop * 2) == pytest.approx(0.401)
        assert ring_time(algo, 4, 1e9, hop * 4) == pytest.approx(0.603)
    assert ring_time("all_reduce", 1, 1e9, hop) == 0.0


def test_cost_keys_reach_the_model_through_overrides_and_files(tmp_path):
    sched = load("1f1b", p=2, m=2)
    doc = parse_overrides("param_bytes=1GB,dp_latency=1ms,dp_bandwidth=10Gbps")
    c = cost_model(sched, [doc])
    op = np.array([REDUCE_GRAD, UNSHARD, RESHARD, REDUCE_GRAD])
    stage, rank = np.array([0, 1, 1, 1]), np.array([0, 1, 1, 1])
    # ddp: the REDUCE_GRAD is an all-reduce; fsdp: a reduce-scatter; UNSHARD an all-gather; RESHARD nothing.
    assert c.collective_time(op, stage, rank, 4, "ddp") == pytest.approx([1.206, 0.603, 0.0, 1.206])
    assert c.collective_time(op, stage, rank, 4, "fsdp") == pytest.approx([0.603, 0.603, 0.0, 0.603])
    assert (c.collective_time(op, stage, rank, 1, "ddp") == 0).all()
    # Direct times win over the formula, per stage; a file written by dump_costs reads back the same.
    doc2 = {"param_bytes": [1e9, 2e9], "dp_latency": 1e-3, "dp_bandwidth": 10e9, "reduce_grad": [0.25, 0.5]}
    path = tmp_path / "c.toml"
    path.write_text(dump_costs(doc2))
    c2 = cost_model(sched, [read_cost_file(path)])
    assert c2.collective_time(op, stage, rank, 2, "ddp") == pytest.approx([0.25, 0.801, 0.0, 0.5])
    assert c2.describe()["collectives"]["reduce_grad"] == [0.25, 0.5]
    assert not c2.free_collectives and c.describe()["collectives"]["free"] is False
    assert model(sched).free_collectives  # nothing given: free, as messages are
    with pytest.raises(PipecError) as e:
        parse_overrides("dp_bandwidth=0")
    assert e.value.code == "E801"
    with pytest.raises(PipecError) as e:
        normalize({"reduce_grad": -1})
    assert e.value.code == "E801"


# ---------------------------------------------------------------- the collective stream by hand


def p2_program(**kw) -> tuple:
    sched = load("1f1b", p=2, m=2)
    return sched, dataclasses.replace(lower(sched), dp=2, **kw)


def test_reduce_grad_overlaps_the_other_stage_and_step_waits():
    # 1F1B, p = 2, m = 2, F = 1, full B = 2, free messages. Without DP: rank 1 runs F0 [1,2] B0 [2,4]
    # F1 [4,5] B1 [5,7]; rank 0 F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]: makespan 9.
    # dp = 2 ddp, stage parameters of 3 GB over 8 Gbps (1e9 B/s), no latency: all-reduce 2(1)/2 * 3 = 3 s.
    # Rank 1's REDUCE_GRAD 1 runs [7,10] while rank 0 computes B1 [7,9]; rank 0's runs [9,12]. Each STEP
    # waits for its own: rank 1 exposed 3 s, rank 0 3 s; makespan 12.
    sched, prog = p2_program()
    c = model(sched, F=1, B=2, param_bytes=3e9, dp_bandwidth="8Gbps")
    tl, st = times(prog, c)
    assert st.makespan == 12.0
    assert tl.coll_rank.tolist() == [0, 1] and tl.coll_op.tolist() == [REDUCE_GRAD, REDUCE_GRAD]
    assert tl.coll_start.tolist() == [9.0, 7.0] and tl.coll_end.tolist() == [12.0, 10.0]
    assert tl.coll_bytes.tolist() == [3e9, 3e9]
    b1 = (tl.rank == 0) & (tl.mb == 1) & (tl.op == CODE["BWD"])
    assert (tl.start[b1], tl.end[b1]) == (7.0, 9.0)  # overlapping rank 1's reduction
    assert [(r.collective_busy, r.collective_exposed, r.last) for r in st.ranks] == [(3.0, 3.0, 12.0), (3.0, 3.0, 10.0)]
    # Computes are where they were without DP.
    base, _ = times(dataclasses.replace(prog, dp=1), c)
    assert np.array_equal(base.start, tl.start) and np.array_equal(base.end, tl.end) and base.makespan == 9.0
    # Both passes agree; a collective issued before its predecessor is done waits for it (FIFO).
    tl_e, _ = times(prog, c, _events=True)
    assert tl_e.coll_start.tolist() == tl.coll_start.tolist() and tl_e.makespan == 12.0


def test_collectives_of_one_rank_run_one_after_the_other():
    # Interleaved rank programs are not needed: one rank with two stages' REDUCE_GRADs issued together.
    # p = 2 with both stages on rank 0? Use 1F1B's rank 1 and give it a second REDUCE_GRAD of its stage
    # right after the first: they run [7,10] and [10,13], its STEP waits for the later one (the last
    # REDUCE_GRAD of the stage before it): makespan 13.
    sched, prog = p2_program()
    r1 = prog.ranks[1].instructions()
    at = next(j for j, i in enumerate(r1) if i.op == "REDUCE_GRAD")
    r1.insert(at, Instr("REDUCE_GRAD", -1, 1))
    prog2 = with_ranks(prog, [prog.ranks[0].instructions(), r1])
    tl, st = times(prog2, model(sched, F=1, B=2, reduce_grad=3))
    one = tl.coll_rank == 1
    assert tl.coll_start[one].tolist() == [7.0, 10.0] and tl.coll_end[one].tolist() == [10.0, 13.0]
    assert st.makespan == 13.0 and tl.coll_issue[one].tolist() == [7.0, 7.0]


def fsdp_program(prog: Program) -> Program:
    """FSDP's windows: UNSHARD s first, RESHARD s after the stage's last compute, then its REDUCE_GRAD."""
    ranks = []
    for r, rp in enumerate(prog.ranks):
        instrs = [i for i in rp.instructions() if i.op not in ("REDUCE_GRAD", "STEP")]
        last = max(j for j, i in enumerate(instrs) if i.op in ("FWD", "BWD", "WGRAD"))
        s = r  # one stage per rank
        instrs = [Instr("UNSHARD", -1, s), *instrs[: last + 1], Instr("RESHARD", -1, s), *instrs[last + 1 :]]
        ranks.append([*instrs, Instr("REDUCE_GRAD", -1, s), Instr("STEP", -1, s)])
    return with_ranks(prog, ranks, dp_kind="fsdp")


def test_unshard_delays_the_first_compute_by_the_all_gather():
    # FSDP, dp = 2: 1 GB stages over 1 ms and 10 Gbps: all-gather (1) 1 ms + 1/2 * 0.8 s = 0.401 s.
    # Rank 0's F0 waits for it: [0.401, 1.401], so everything moves by 0.401; rank 1's F0 waited for the
    # activation (at 1.401) anyway, so its all-gather is hidden: exposed 0 on rank 1 before compute.
    # The reduce-scatter takes 0.401 s too: rank 1's [7.401, 7.802], rank 0's [9.401, 9.802].
    sched, prog = p2_program()
    prog = fsdp_program(prog)
    c = model(sched, F=1, B=2, param_bytes=1e9, dp_latency="1ms", dp_bandwidth="10Gbps")
    tl, st = times(prog, c)
    ag = 0.001 + 0.4
    f0 = (tl.op == CODE["FWD"]) & (tl.mb == 0)
    assert tl.start[f0 & (tl.rank == 0)][0] == pytest.approx(ag)
    assert tl.start[f0 & (tl.rank == 1)][0] == pytest.approx(1 + ag)
    assert st.makespan == pytest.approx(9 + 2 * ag)
    ops = [OPCODES[o] for o in tl.coll_op[tl.coll_rank == 0]]
    assert ops == ["UNSHARD", "RESHARD", "REDUCE_GRAD"]
    reshard = tl.coll_op == RESHARD
    assert (tl.coll_start[reshard] == tl.coll_end[reshard]).all()  # instant, at its issue
    assert tl.coll_start[reshard & (tl.coll_rank == 0)][0] == pytest.approx(9 + ag)  # after the last B
    # Exposure: rank 0 waited the all-gather at its start and the reduce-scatter at its STEP; rank 1 only
    # the reduce-scatter (its first compute waited for the activation longer than for the all-gather).
    assert st.ranks[0].collective_exposed == pytest.approx(2 * ag)
    assert st.ranks[1].collective_exposed == pytest.approx(ag)
    assert st.ranks[0].collective_busy == pytest.approx(2 * ag)
    tl_e, _ = times(prog, c, _events=True)
    assert np.allclose(tl_e.start, tl.start) and tl_e.makespan == pytest.approx(st.makespan)


def test_an_unshard_issued_early_is_hidden():
    # The UNSHARD of rank 1 issued first but its first compute starts at 1 + ag > ag: nothing exposed; an
    # all-gather of 3 s there (longer than the 1.401 s the activation takes) is exposed by 3 - 1.401.
    sched, prog = p2_program()
    prog = fsdp_program(prog)
    c = model(sched, F=1, B=2, param_bytes=1e9, dp_latency="1ms", dp_bandwidth="10Gbps", unshard=[0.401, 3.0])
    tl, st = times(prog, c)
    f0 = (tl.op == CODE["FWD"]) & (tl.mb == 0) & (tl.rank == 1)
    assert tl.start[f0][0] == 3.0
    waits = list(zip(tl.wait_rank.tolist(), tl.wait_start.tolist(), tl.wait_end.tolist()))
    assert (1, pytest.approx(1.401), 3.0) in waits


# ---------------------------------------------------------------- the DP link the topology gives


def test_replica_datacenters_choose_the_slow_link():
    sched = load("1f1b", p=2, m=2)
    slow = Link("east", "west", 0.04, 10e9)
    pp_across = Topology((Datacenter("east", 0, 1), Datacenter("west", 1, 2)), (slow,))
    dp_across = Topology((), (slow,), (Datacenter("east", 0, 1), Datacenter("west", 1, 2)))
    one = np.array([REDUCE_GRAD]), np.array([0]), np.array([0])
    for topo, want in (
        # DP inside each datacenter: the `dc` class default, 10 us and 100 Gbps: 2 * 10 us + 1e9 / 12.5e9.
        (pp_across, 2e-5 + 0.08),
        # DP across: 40 ms and 10 Gbps: 2 * 40 ms + 1e9 / 1.25e9.
        (dp_across, 0.08 + 0.8),
    ):
        c = cost_model(dataclasses.replace(sched, topology=topo), [normalize({"param_bytes": 1e9})])
        assert c.collective_time(*one, 2, "ddp") == pytest.approx([want])
    # dp_latency / dp_bandwidth set the hop inside a datacenter, never the one across.
    c = cost_model(
        dataclasses.replace(sched, topology=dp_across),
        [normalize({"param_bytes": 1e9, "dp_latency": "1ms", "dp_bandwidth": "1Gbps"})],
    )
    assert c.ring_hops(0, 2) == [(0.04, 1.25e9), (0.04, 1.25e9)]
    # Four replicas in three datacenters: the ring east, east, west, north crosses east-west, west-north
    # and north-east; each step takes the slowest hop, west-north at 100 ms and 1 Gbps:
    # 2 * 3 * (0.1 + 1e9 / 4 / 1.25e8) = 6 * 2.1.
    three = Topology(
        (),
        (Link("east", "west", 0.04, 10e9), Link("west", "north", 0.1, 1e9), Link(None, None, 0.01, 10e9)),
        (Datacenter("east", 0, 2), Datacenter("west", 2, 3), Datacenter("north", 3, 4)),
    )
    c = cost_model(dataclasses.replace(sched, topology=three), [normalize({"param_bytes": 1e9})])
    assert c.collective_time(*one, 4, "ddp") == pytest.approx([6 * 2.1])
    # north-east took the default link (10 ms): a ring of east and north only crosses it.
    assert c.ring_hops(0, 4)[3] == (0.01, 1.25e9)
    # The class override of cost files applies to the cross link as it does to ranks.
    c = cost_model(
        dataclasses.replace(sched, topology=dp_across),
        [normalize({"param_bytes": 1e9, "links": {"cross": {"bandwidth": "1Gbps"}}})],
    )
    assert c.collective_time(*one, 2, "ddp") == pytest.approx([0.08 + 8.0])
    with pytest.raises(PipecError) as e:
        cost_model(dataclasses.replace(sched, topology=dp_across), []).collective_time(*one, 3, "ddp")
    assert e.value.code == "E801" and "replica 2" in str(e.value)


def test_dp_across_the_slow_link_in_a_simulated_step():
    # The same Program and sizes: DP across the datacenters costs the reduction 0.88 s, inside 0.08002 s.
    sched, prog = p2_program()
    slow = Link("east", "west", 0.04, 10e9)
    doc = normalize({"F": 1, "B": 2, "param_bytes": 1e9})
    across = Topology((), (slow,), (Datacenter("east", 0, 1), Datacenter("west", 1, 2)))
    inside = Topology((), (slow,), (Datacenter("east", 0, 2),))
    spans = {}
    for name, topo in (("across", across), ("inside", inside)):
        c = cost_model(dataclasses.replace(sched, topology=topo), [doc])
        # Messages take the `dc` class's 10 us now, so the step without DP is a little over 9.
        spans[name] = times(prog, c)[1].makespan - times(dataclasses.replace(prog, dp=1), c)[1].makespan
    assert spans["across"] == pytest.approx(0.88)  # rank 0's reduction, exposed whole at the end
    assert spans["inside"] == pytest.approx(2e-5 + 0.08)


def test_rings_crossing_one_link_share_it():
    # DP across two datacenters, 40 ms and 10 Gbps (1.25e9 B/s), stages of 3.75 GB: a ring of two moves
    # 3.75 GB over the link (two steps of half), 3 s, then 2 x 40 ms of latency. Rank 1's starts at 7 and
    # has it alone until rank 0's joins at 9 (2 s done); they share it from then: rank 1's last second
    # takes 2 s (ends 11 + 0.08), rank 0's ring has done 1 s by 11 and takes 2 s more alone (13 + 0.08).
    sched, prog = p2_program()
    topo = Topology((), (Link("east", "west", 0.04, 10e9),), (Datacenter("east", 0, 1), Datacenter("west", 1, 2)))
    sched = dataclasses.replace(sched, topology=topo)
    c = cost_model(sched, [normalize({"F": 1, "B": 2, "param_bytes": 3.75e9, "latency.dc": 0})])
    tl, st = times(prog, c)
    assert tl.coll_start.tolist() == [9.0, 7.0] and tl.coll_end.tolist() == pytest.approx([13.08, 11.08])
    assert st.makespan == pytest.approx(13.08)
    assert c.collective_wire(np.array([REDUCE_GRAD]), np.array([0]), np.array([0]), 2, "ddp") == pytest.approx([3.0])
    # fsdp: both all-gathers (1.5 s alone) start at 0 and share the link: 3 s, + 40 ms; the computes move
    # by 3.04; then the reduce-scatters (1.5 s) no longer overlap: rank 1's [10.04, 11.58], rank 0's
    # [12.04, 13.58]. The second collective of a rank waits for its first to end.
    tl, st = times(fsdp_program(prog), c)
    uns = tl.coll_op == UNSHARD
    assert tl.coll_end[uns].tolist() == pytest.approx([3.04, 3.04])
    rg = tl.coll_op == REDUCE_GRAD
    assert tl.coll_start[rg].tolist() == pytest.approx([12.04, 10.04])
    assert tl.coll_end[rg].tolist() == pytest.approx([13.58, 11.58]) and st.makespan == pytest.approx(13.58)
    assert tl.start[tl.rank == 0].min() == pytest.approx(3.04)
    # A direct time is not bytes on the link: nothing to share, the rings run side by side.
    c = cost_model(sched, [normalize({"F": 1, "B": 2, "reduce_grad": 3.0, "latency.dc": 0})])
    assert times(prog, c)[0].coll_end.tolist() == [12.0, 10.0]


# ---------------------------------------------------------------- dp = 1 does not move


def _old_simulator():
    """The simulator of the commit before collectives, loaded from git (None when git cannot show it)."""
    try:
        text = subprocess.run(
            ["git", "show", f"{BEFORE}:pipec/sim/simulate.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    # The modules it imports moved into floors since (docs/architecture.md): read them from their rooms.
    text = text.replace("from pipec.opcodes ", "from pipec.ir.opcodes ").replace(
        "from pipec.program ", "from pipec.ir.program "
    )
    if "old_simulate" in sys.modules:
        return sys.modules["old_simulate"]
    spec = importlib.util.spec_from_loader("old_simulate", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_simulate"] = mod  # its dataclasses look their module up there
    exec(compile(text, "old_simulate.py", "exec"), mod.__dict__)  # noqa: S102 - our own file at a commit
    return mod


CASES = [
    ("1f1b", {"p": 4, "m": 8}, {"F": 1, "B": 2}),
    ("interleaved-1f1b", {"p": 4, "v": 2, "m": 8}, {"act_bytes": "16MiB", "latency": "1ms", "bandwidth": "10Gbps"}),
    ("zb-h1", {"p": 4, "m": 8}, {"overhead": 1e-3, "F": 1, "B": 1, "W": 1, "comm": 0.1}),
    ("dualpipe-v", {"p": 4, "m": 10}, {}),
]


@pytest.mark.parametrize(("name", "params", "doc"), CASES)
def test_dp1_figures_are_the_old_simulators(name, params, doc):
    old = _old_simulator()
    if old is None:
        pytest.skip(f"git cannot show {BEFORE}")
    sched = load(name, **params)
    prog = lower(sched)
    # Collective costs given, but dp = 1: nothing may move; and dp = 2 with free collectives neither.
    c = cost_model(sched, [normalize({**doc, "param_bytes": "1GB", "dp_latency": "1ms"})])
    c_free = cost_model(sched, [normalize({**doc, "dp_latency": 0})])  # `latency` alone would time DP hops
    ref = old.simulate(prog, c_free)
    for p, costs in ((prog, c), (dataclasses.replace(prog, dp=2), c_free)):
        tl = simulate(p, costs)
        assert np.array_equal(tl.start, ref.start) and np.array_equal(tl.end, ref.end)
        assert np.array_equal(tl.msg_arrival, ref.msg_arrival) and np.array_equal(tl.msg_send, ref.msg_send)
        assert tl.makespan == ref.makespan and stats(tl).cost == old.stats(ref).cost
    assert len(simulate(prog, c).coll_rank) == 0  # dp = 1: no collective rows


def test_both_passes_agree_with_collectives_on_shared_links():
    # Interleaved 1F1B across two datacenters shares the cross link (the event pass); collectives on top.
    sched = load("interleaved-1f1b", p=4, v=2, m=8)
    topo = Topology((Datacenter("east", 0, 2), Datacenter("west", 2, 4)), (Link("east", "west", 0.04, 10e9),))
    sched = dataclasses.replace(sched, topology=topo)
    prog = dataclasses.replace(lower(sched), dp=2)
    c = cost_model(sched, [normalize({"act_bytes": "16MiB", "param_bytes": "200MB", "T_F": 0.1, "T_B": 0.2})])
    a, b = simulate(prog, c), simulate(prog, c, _events=True)
    assert np.allclose(a.start, b.start) and np.allclose(a.coll_end, b.coll_end)
    assert a.makespan == pytest.approx(b.makespan) and len(a.coll_rank) == 8  # two stages per rank
    # Every REDUCE_GRAD runs after the last compute of its stage on its rank, and the step ends after it.
    for r, s, start in zip(a.coll_rank.tolist(), a.coll_stage.tolist(), a.coll_start.tolist()):
        assert start >= a.end[(a.rank == r) & (a.stage == s)].max()
    assert a.makespan >= a.coll_end.max()


# ---------------------------------------------------------------- pictures and reports


def test_trace_gantt_and_report_show_the_collectives(tmp_path):
    sched, prog = p2_program()
    prog = fsdp_program(prog)
    c = model(sched, F=1, B=2, param_bytes=1e9, dp_latency="1ms", dp_bandwidth="10Gbps")
    tl = simulate(prog, c)
    doc = trace_events(tl)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert {"compute", "collectives", "collective wait"} <= names
    colls = [e for e in doc["traceEvents"] if e.get("cat") == "collective"]
    want = [f"{op} {s}" for op in ("REDUCE_GRAD", "RESHARD", "UNSHARD") for s in (0, 1)]
    assert sorted(e["name"] for e in colls) == want
    path = tmp_path / "t.json"
    write_trace(tl, path)
    back = read_trace(path)
    for f in ("coll_rank", "coll_op", "coll_stage", "coll_issue", "coll_start", "coll_end", "coll_after", "wait_start"):
        assert np.array_equal(getattr(back, f), getattr(tl, f)), f
    assert back.makespan == tl.makespan and (back.dp, back.dp_kind) == (2, "fsdp")
    # Longer collectives (2 s each) leave room for their labels in the text Gantt.
    text = text_gantt(simulate(prog, model(sched, F=1, B=2, unshard=2, reduce_grad=2)), width=200)
    assert text.count(" coll") == 2 and "R0" in text and "U1" in text and "~" in text
    plot_timelines([Panel(tl, "fsdp")], tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 1000
    out = report_json(sched, prog, c)
    assert out["collectives"] == 6 and out["collective_busy"] == pytest.approx(4 * 0.401)
    assert out["per_rank"][0]["collective_exposed"] == pytest.approx(2 * 0.401)
    json.dumps(out)


def report_json(sched, prog, c) -> dict:
    """`pipec simulate --json`'s record for a Program under these costs."""
    from pipec.driver import Simulation
    from pipec.sim.memory import memory_model

    tl = simulate(prog, c)
    mem = memory_model(sched, None)
    from pipec.passes.compiler import CompiledSchedule

    compiled = CompiledSchedule(sched, prog, ())
    return report.to_json(Simulation(compiled, c, mem, tl, stats(tl, mem)))


def test_the_data_parallel_path_is_not_much_slower():
    # Speed is benchmarks/simulate_speed.py's; here only that the data-parallel path stays near the other:
    # 1F1B p = 8, m = 2000 (32,000 compute ops) with dp = 2, in a subprocess that reports its time.
    code = (
        "import dataclasses, time; from pipec.api import load; from pipec.passes.lower import lower;"
        "from pipec.sim.cost_files import normalize; from pipec.sim.costs import cost_model;"
        "from pipec.sim.simulate import simulate;"
        "s = load('1f1b', p=8, m=2000); prog = lower(s); c = cost_model(s, [normalize({'reduce_grad': 5})]);"
        "t = time.perf_counter(); a = simulate(prog, c).makespan; t1 = time.perf_counter() - t;"
        "t = time.perf_counter(); b = simulate(dataclasses.replace(prog, dp=2), c).makespan;"
        "t2 = time.perf_counter() - t; print(a, b, t1, t2)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    a, b, t1, t2 = map(float, out.stdout.split())
    assert b == pytest.approx(a + 5)  # the last rank's reduction is exposed whole at its STEP
    assert t2 < 3 * t1 + 0.5


# ---------------------------------------------------------------- with the lowering's placement


def test_the_lowerings_collectives_simulate():
    # The lowering puts REDUCE_GRAD s right after stage s's last compute: on interleaved 1F1B the
    # reduction of a rank's first-finished chunk overlaps its other chunk's backwards, so the exposed
    # time is less than the two reductions back to back; fsdp's all-gather before the first forward is
    # exposed on rank 0 in full.
    from pipec.ir.dataparallel import DataParallel

    sched = load("interleaved-1f1b", p=4, v=2, m=8)
    c = model(sched, T_F=1, T_B=2, reduce_grad=1.5, unshard=0.5)
    tl, st = times(lower(sched, DataParallel(2, "ddp")), c)
    assert len(tl.coll_rank) == 8 and (tl.coll_op == REDUCE_GRAD).all()
    for r in st.ranks:
        assert r.collective_busy == 3.0 and r.collective_exposed < 3.0
    base = stats(simulate(lower(sched), c)).makespan
    assert base < st.makespan <= base + 3.0
    tl, st = times(lower(sched, DataParallel(2, "fsdp")), c)
    first = tl.start[tl.rank == 0].min()
    assert first == 0.5 and st.ranks[0].collective_exposed >= 0.5


def test_the_cross_dc_table_is_the_scripts():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cross_dc_dp

    doc = (ROOT / "docs" / "cross-dc.md").read_text()
    table = cross_dc_dp.markdown(cross_dc_dp.rows())
    assert table in doc


# ---------------------------------------------------------------- properties over random schedules


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_schedules(max_ranks=3, max_stages=5, max_mb=3), st.data())
def test_collectives_keep_the_machines_rules(rs, data):
    """Over random schedules lowered with ddp or fsdp (any prefetch, any max_gathered) and random costs:
    both passes agree; a rank's collectives run one at a time in its Program order, none before it is
    issued; a REDUCE_GRAD starts after the last compute of its stage on its rank; a compute starts after
    the UNSHARDs of its stage issued before it; STEP-bound reductions end within the step; and with the
    collectives free, every compute and message time is dp = 1's, bit for bit."""
    from pipec.ir.dataparallel import DataParallel

    sched = build(Source("random.pipe", rs.text()), {})
    kind = data.draw(st.sampled_from(["ddp", "fsdp"]))
    opts = DataParallel(
        data.draw(st.sampled_from([2, 3])),
        kind,
        prefetch=data.draw(st.integers(0, 2)),
        max_gathered=data.draw(st.sampled_from([None, 1, 2])),
    )
    if data.draw(st.booleans()):  # DP across two datacenters: rings of several ranks share the link
        west = Datacenter("west", 1, opts.size)
        topo = Topology((), (Link("east", "west", 0.1, 8e9),), (Datacenter("east", 0, 1), west))
        sched = dataclasses.replace(sched, topology=topo)
    prog = lower(sched, opts)
    S = sched.num_stages
    per = st.floats(0.0, 3.0, allow_nan=False)
    doc = {
        "F": data.draw(st.lists(per, min_size=S, max_size=S)),
        "B": data.draw(st.lists(per, min_size=S, max_size=S)),
        "latency": data.draw(st.sampled_from([0.0, 0.2])),
        "overhead": data.draw(st.sampled_from([0.0, 0.05])),
    }
    if data.draw(st.booleans()):
        doc["param_bytes"] = data.draw(st.lists(st.sampled_from([0.0, 1e9, 3e9]), min_size=S, max_size=S))
    else:
        doc["reduce_grad"] = data.draw(st.lists(per, min_size=S, max_size=S))
        doc["unshard"] = data.draw(st.lists(per, min_size=S, max_size=S))
    c = model(sched, **doc)
    tl, st_ = times(prog, c)
    tl_e, _ = times(prog, c, _events=True)
    for col in ("start", "end", "msg_arrival", "coll_start", "coll_end"):
        assert np.allclose(getattr(tl, col), getattr(tl_e, col)), col
    for r in range(sched.num_ranks):
        mine = np.flatnonzero(tl.coll_rank == r)  # in Program order
        spans = tl.coll_op[mine] != RESHARD
        starts, ends = tl.coll_start[mine][spans], tl.coll_end[mine][spans]
        assert (starts[1:] >= ends[:-1] - 1e-9).all() and (tl.coll_start[mine] >= tl.coll_issue[mine] - 1e-12).all()
        computes = np.flatnonzero(tl.rank == r)  # in stream order
        rp = prog.ranks[r]
        is_c = np.isin(rp.op, [CODE["FWD"], CODE["BWD"], CODE["WGRAD"]])
        before = np.cumsum(is_c)[np.isin(rp.op, [REDUCE_GRAD, UNSHARD, RESHARD])]  # computes before each
        for j, k in zip(mine.tolist(), before.tolist()):
            s, op = int(tl.coll_stage[j]), int(tl.coll_op[j])
            own = computes[tl.stage[computes] == s]
            if op == REDUCE_GRAD:
                assert tl.coll_start[j] >= tl.end[own].max() - 1e-9
            if op == UNSHARD:  # the next compute of s after it in the stream waits for it
                later = computes[k:][tl.stage[computes[k:]] == s]
                assert not len(later) or tl.start[later[0]] >= tl.coll_end[j] - 1e-9
    assert st_.makespan >= tl.coll_end.max() - 1e-12 and st_.makespan >= tl.end.max()
    # Memory over time peaks where the memory model's walk of the Program does (fsdp: shards + windows): timed
    # with the Program (the driver's way), always; from the Timeline alone (a measured run's way), whenever
    # no compute takes zero time (then a window closed at the instant a compute starts and ends is ambiguous).
    from pipec.sim.memory import memory_model, program_memory
    from pipec.sim.memtime import memory_curves

    over = {"params": data.draw(st.sampled_from([0.0, 1.0, 4.0]))}
    walk = [r.peak for r in program_memory(prog, sched, over)]
    assert memory_curves(tl, prog, memory_model(sched, over)).device_peak.tolist() == pytest.approx(walk)
    if (tl.end > tl.start).all():
        assert [r.peak_memory for r in stats(tl, memory_model(sched, over)).ranks] == pytest.approx(walk)
    free = model(sched, **{**doc, "reduce_grad": 0, "unshard": 0, "param_bytes": 0, "dp_latency": 0})
    if sched.topology is not None:
        free = dataclasses.replace(free, replica_names=(), replica_links={})  # no ring across: all free
    a, b = simulate(prog, free), simulate(dataclasses.replace(prog, dp=1), free)
    for col in ("start", "end", "msg_send", "msg_arrival"):
        assert np.array_equal(getattr(a, col), getattr(b, col)), col


def test_the_docs_command_lines_print_what_the_docs_say():
    from cli_helpers import run_cli

    # docs/simulate.md, "Data parallelism": the first lines of the console example.
    rc, out, _ = run_cli(
        "simulate",
        "1f1b",
        "-D",
        "p=4",
        "-D",
        "m=8",
        "--dp",
        "2",
        "--cost",
        "F=1,B=2,param_bytes=1GB,dp_bandwidth=80Gbps",
    )
    doc = (ROOT / "docs" / "simulate.md").read_text()
    assert rc == 0 and "\n".join(out.splitlines()[:4]) in doc
    assert out.splitlines()[0].startswith("1f1b (p=4 m=8): makespan 33.1,")
    # docs/cross-dc.md: the command line of the first 6.7B row, DP across (12.137 s in the table).
    topo = 'dc "east" replicas 0 .. 1  dc "west" replicas 1 .. 2  link "east" <-> "west" latency 40ms bandwidth 10Gbps'
    cost = "T_F=0.04887,T_B=0.04887,T_W=0.04887,act_bytes=16MiB,param_bytes=3.35GB"
    argv = ["simulate", "1f1b", "-D", "p=4", "-D", "m=8", "--dp", "2", "--topology", topo, "--cost", cost]
    rc, out, _ = run_cli(*argv, "--json")
    assert rc == 0 and f"--topology '{topo}'" in (ROOT / "docs" / "cross-dc.md").read_text()
    assert json.loads(out)["results"][0]["makespan"] == pytest.approx(12.137, abs=0.01)


# ---------------------------------------------------------------- what a run adds around the ops


def test_step_time_is_charged_at_step_after_its_reduction():
    # The case above (makespan 12: rank 0's REDUCE_GRAD [9,12], rank 1's [7,10]) with optimizer steps of
    # 0.5 s (stage 0) and 0.25 s (stage 1): each STEP waits for its reduction, then computes. Rank 0's
    # STEP [12,12.5], rank 1's [10,10.25]: makespan 12.5; the computes and collectives stay where they were.
    sched, prog = p2_program()
    c = model(sched, F=1, B=2, param_bytes=3e9, dp_bandwidth="8Gbps", step=[0.5, 0.25])
    tl, st = times(prog, c)
    assert st.makespan == 12.5
    assert tl.step_rank.tolist() == [0, 1] and tl.step_stage.tolist() == [0, 1]
    assert tl.step_start.tolist() == [12.0, 10.0] and tl.step_end.tolist() == [12.5, 10.25]
    assert tl.coll_start.tolist() == [9.0, 7.0] and tl.coll_end.tolist() == [12.0, 10.0]
    assert times(prog, c, _events=True)[1].makespan == 12.5  # both passes agree
    assert [r.last for r in st.ranks] == [12.5, 10.25]  # each rank's step ends with its STEP
    # Without data parallelism the STEPs follow each rank's last backward: rank 0's B1 ends at 9, its
    # STEP [9,9.5]; rank 1's STEP [7,7.25]: makespan 9.5.
    tl1, st1 = times(dataclasses.replace(prog, dp=1), c)
    assert st1.makespan == 9.5 and tl1.step_start.tolist() == [9.0, 7.0] and tl1.step_end.tolist() == [9.5, 7.25]


def test_step_overhead_moves_the_whole_step():
    # 0.75 s outside the instructions on every rank: every time of the step 12 case is 0.75 later.
    sched, prog = p2_program()
    base = model(sched, F=1, B=2, param_bytes=3e9, dp_bandwidth="8Gbps")
    tl0, st0 = times(prog, base)
    tl, st = times(prog, model(sched, F=1, B=2, param_bytes=3e9, dp_bandwidth="8Gbps", step_overhead=0.75))
    assert st.makespan == 12.75
    assert (tl.start - tl0.start).tolist() == [0.75] * len(tl.start)
    assert tl.coll_end.tolist() == [12.75, 10.75]


def test_blocking_collectives_hold_up_the_rank():
    # 1F1B p = 2, m = 2, F = 1, B = 2, reduce_grad = 3, with one more REDUCE_GRAD 1 on rank 1 right after
    # its first backward's send (at 4). Overlapping: it runs [4,7] beside F1 [4,5] B1 [5,7], the last
    # REDUCE_GRAD [7,10]; rank 0's B0 [4,6], B1 (gradient at 7) [7,9], REDUCE_GRAD 0 [9,12]: makespan 12.
    # Blocking (dp_blocking): rank 1 waits [4,7], so F1 [7,8] B1 [8,10], REDUCE_GRAD [10,13], STEP at 13;
    # rank 0's B1 waits for the gradient of 10: [10,12], REDUCE_GRAD 0 [12,15]: makespan 15.
    sched, prog = p2_program()
    r1 = prog.ranks[1].instructions()
    at = next(j for j, i in enumerate(r1) if i.op == "SEND_GRAD") + 1
    r1.insert(at, Instr("REDUCE_GRAD", -1, 1))
    prog2 = with_ranks(prog, [prog.ranks[0].instructions(), r1])
    tl, st = times(prog2, model(sched, F=1, B=2, reduce_grad=3))
    assert st.makespan == 12.0 and tl.coll_start[tl.coll_rank == 1].tolist() == [4.0, 7.0]
    tl_b, st_b = times(prog2, model(sched, F=1, B=2, reduce_grad=3, dp_blocking=1))
    assert st_b.makespan == 15.0
    one = tl_b.coll_rank == 1
    assert tl_b.coll_start[one].tolist() == [4.0, 10.0] and tl_b.coll_end[one].tolist() == [7.0, 13.0]
    f1 = (tl_b.rank == 1) & (tl_b.mb == 1) & (tl_b.op == CODE["FWD"])
    assert (tl_b.start[f1], tl_b.end[f1]) == (7.0, 8.0)
    b1 = (tl_b.rank == 0) & (tl_b.mb == 1) & (tl_b.op == CODE["BWD"])
    assert (tl_b.start[b1], tl_b.end[b1]) == (10.0, 12.0)
    # the rank's wait for each collective is exposed: rank 1 3 + 3 s, rank 0 3 s
    assert [r.collective_exposed for r in st_b.ranks] == [3.0, 6.0]
    assert times(prog2, model(sched, F=1, B=2, reduce_grad=3, dp_blocking=1), _events=True)[1].makespan == 15.0


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("name,params", [("1f1b", {"p": 2, "m": 4}), ("interleaved-1f1b", {"p": 2, "v": 2, "m": 4})])
def test_the_new_keys_at_their_defaults_change_nothing(name, params, kind):
    from pipec.api import simulate as api_simulate
    from pipec.ir.dataparallel import DataParallel

    cost = "F=1,B=2,reduce_grad=3,unshard=1"
    a = api_simulate(name, params, cost=cost, data_parallel=DataParallel(2, kind)).timeline
    b = api_simulate(
        name, params, cost=cost + ",step=0,step_overhead=0,dp_blocking=0", data_parallel=DataParallel(2, kind)
    ).timeline
    assert a.makespan == b.makespan and a.makespan > 0
    for f in ("start", "end", "coll_start", "coll_end", "wait_start", "wait_end"):
        assert np.array_equal(getattr(a, f), getattr(b, f))
    assert len(b.step_end) == 0
    # blocking changes this schedule: interleaved's first chunk reduces while the second still computes
    blocked = api_simulate(name, params, cost=cost + ",dp_blocking=1", data_parallel=DataParallel(2, kind))
    assert blocked.stats.makespan >= a.makespan
    if name == "interleaved-1f1b":
        assert blocked.stats.makespan > a.makespan


def test_the_cost_reader_takes_the_new_keys():
    doc = normalize({"step": [0.5, "250ms"], "step_overhead": "10ms", "dp_blocking": True})
    assert doc["step"] == [0.5, 0.25] and doc["step_overhead"] == 0.01 and doc["dp_blocking"] is True
    assert parse_overrides("dp_blocking=1,step=2")["dp_blocking"] is True
    with pytest.raises(PipecError, match="dp_blocking must be 0 or 1"):
        normalize({"dp_blocking": 2})
    with pytest.raises(PipecError, match="step_overhead"):
        normalize({"step_overhead": -1})
    text = dump_costs({"F": [1.0, 1.0], "step": [0.5, 0.25], "step_overhead": 0.01, "dp_blocking": 1})
    back = read_cost_file_text(text)
    assert back["step"] == [0.5, 0.25] and back["step_overhead"] == 0.01 and back["dp_blocking"] is True


def read_cost_file_text(text: str, tmp=None) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.toml"
        path.write_text(text)
        return read_cost_file(path)
