"""`pipec synth` under a memory limit below 1F1B's: recomputation and offload (docs/synth.md, "Under a memory
limit").

The found schedule keeps the limit by pipec's own memory check (the order of `pipec check`, and the simulated
curve of `pipec simulate`), passes every check, and reads back from the file it writes with the same figures;
memory ops appear only below 1F1B's memory (at 1F1B's memory the search is the plain one); a limit below the
least memory any schedule holds is E703. The figure against V-Half is benchmarks/synth_memory.py's.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest
from cli_helpers import run_cli as cli

from pipec import synth
from pipec.driver import build
from pipec.driver import simulation as simulate_schedule
from pipec.errors import PipecError, Source
from pipec.passes.compiler import compile_schedule
from pipec.sim.cost_files import normalize
from pipec.sim.memory import rank_memory

EQUAL = normalize({"T_F": 1, "T_B": 1, "T_W": 1})
CHEAP_OFFLOAD = normalize({"T_F": 1, "T_B": 1, "T_W": 1, "offload": 0.2})  # not the default (half a forward)


def v_spec(limit: float, **kw) -> synth.Spec:
    """p=2, m=4 in ZB-V's placement: a rank holds half a micro-batch per chunk, 1F1B's peak is 2, and no
    order without memory ops holds less than 1 (both chunks of a micro-batch between its F and B)."""
    return synth.Spec(p=2, m=4, v=2, placement="v", cost_docs=(CHEAP_OFFLOAD,), limit=(limit,) * 2, **kw)


@functools.cache
def found() -> synth.Result:
    """Half of 1F1B's memory and less (0.75 of 2) for `v_spec`: the heuristic's schedule, shared by the tests."""
    return synth.synthesize(v_spec(0.75), use_solver=False)


def _kept(spec: synth.Spec, res: synth.Result) -> None:
    """The limit holds in the found schedule by pipec's own checks: every check of the schedule, its order's
    memory (`pipec check`, device and host) and its simulated memory curve (`pipec simulate`)."""
    sched = synth.to_schedule(spec, res.orders, "found", res.memops)
    compile_schedule(sched)  # every check, the memory limit (E402) and host limit (E406) included
    for rep in rank_memory(sched):
        assert rep.peak <= spec.limit[rep.rank] + 1e-9
    sim = simulate_schedule(sched, spec.cost_docs)
    assert max(r.peak_memory for r in sim.stats.ranks) <= max(spec.limit) + 1e-9
    assert sim.stats.makespan == pytest.approx(res.figures.makespan)


def test_a_limit_no_plain_order_meets_is_met_with_memory_ops():
    spec = v_spec(0.75)
    with pytest.raises(PipecError) as e:  # without memory ops nothing fits
        synth.synthesize(replace(spec, memops=()), use_solver=False)
    assert e.value.code == "E701"
    res = found()
    assert res.memops and max(res.figures.peak) <= 0.75 + 1e-9
    _kept(spec, res)
    # rank 1 (stages 1, 2) runs F(i, 2) right after F(i, 1): an offload of F(i, 1) is still on the host link
    # then (both pools hold it), so its least is a recomputed F's input (act / 8) beside a chunk's act
    assert res.floor == pytest.approx((0.5, 0.5 + 0.5 / 8))


def test_recompute_alone_when_offload_is_not_allowed():
    spec = v_spec(0.75, memops=("recompute",))
    res = synth.synthesize(spec, use_solver=False)
    ops = {x.op for rank in res.memops for x in rank}
    assert ops == {"RECOMPUTE"}
    _kept(spec, res)


def test_a_host_limit_holds_too():
    spec = v_spec(0.75, host_limit=(0.5, 0.5))
    res = synth.synthesize(spec, use_solver=False)
    assert res.memops
    _kept(spec, res)
    sched = synth.to_schedule(spec, res.orders, "found", res.memops)
    assert max(rep.host_peak for rep in rank_memory(sched)) <= 0.5 + 1e-9


@pytest.mark.skipif(synth.solver_available() is not None, reason="OR-Tools not installed (the extra pipec[synth])")
def test_the_solver_with_memory_op_decisions_keeps_the_limit_and_is_no_worse():
    spec = v_spec(0.75)
    res = synth.synthesize(spec, time_limit=2, use_solver=True)
    assert res.solver_status in ("optimal", "improved", "no better")
    assert res.figures.key3 <= res.heuristic_figures.key3
    _kept(spec, res)


def test_at_1f1b_memory_no_memory_ops():
    for spec in (
        synth.Spec(p=2, m=4, cost_docs=(EQUAL,), limit=(2.0,) * 2),
        synth.Spec(p=2, m=4, v=2, placement="v", cost_docs=(EQUAL,), limit=(2.0,) * 2),
    ):
        assert not synth.below_1f1b(spec)
        res = synth.synthesize(spec, use_solver=False)
        assert res.memops == () and res.floor is not None
        plain = synth.synthesize(replace(spec, memops=()), use_solver=False)
        assert res.figures == plain.figures and res.orders == plain.orders


def test_the_written_file_has_the_memory_ops_and_reads_back_the_same(tmp_path):
    # offload alone, instant (not the default, half a forward): the file must declare it to simulate the same
    free_link = normalize({"T_F": 1, "T_B": 1, "T_W": 1, "offload": 0})
    res = synth.synthesize(replace(v_spec(0.75), cost_docs=(free_link,), memops=("offload",)), use_solver=False)
    text = synth.write_pipe(res, "found")
    assert "OFFLOAD(" in text and "RELOAD(" in text and "RECOMPUTE(" not in text
    assert "cost offload = 0" in text
    sched = build(Source("found.pipe", text), {})
    placed = tuple(tuple((x.op, x.mb, x.stage, x.before) for x in r) for r in sched.memops)
    assert placed == tuple(tuple((x.op, x.mb, x.stage, x.before) for x in r) for r in res.memops)
    assert [list(r.kind) for r in sched.ranks] == [[k for k, _, _ in o] for o in res.orders]
    sim = simulate_schedule(sched)  # the file alone: its declarations are the costs and memory model
    assert sim.stats.makespan == pytest.approx(res.figures.makespan)
    path = tmp_path / "found.pipe"
    path.write_text(text)
    rc, out, err = cli("check", str(path), "--memory")
    assert rc == 0, err
    rc, out, err = cli("simulate", str(path), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["results"][0]["makespan"] == pytest.approx(res.figures.makespan)
    assert doc["results"][0]["peak_memory"] <= 0.75 + 1e-9


def test_cli_writes_a_schedule_under_half_of_1f1b_memory(tmp_path):
    out = tmp_path / "found.pipe"
    args = ("synth", "-p", "2", "-m", "4", "-v", "2", "--cost", "T_F=1,T_B=1,T_W=1", "--memory-limit", "0.75")
    rc, stdout, err = cli(*args, "--no-solver", "-q", "-o", str(out))
    assert rc == 0, err
    assert "# Memory ops:" in out.read_text()
    rc, _, err = cli("check", str(out))
    assert rc == 0, err
    rc, _, err = cli(*args, "--memops", "sometimes")
    assert rc == 2 and "--memops" in err


def test_a_limit_below_the_floor_is_E703():
    rc, _, err = cli("synth", "-p", "4", "-m", "8", "-v", "2", "--memory-limit", "0.25", "-q")
    assert rc == 1 and "error[E703]" in err
    assert "the least it can hold is 0.5" in err and "--memory-limit 0.5625" in err
    with pytest.raises(PipecError) as e:
        synth.synthesize(synth.Spec(p=4, m=8, limit=(0.5,) * 4))  # one stage per rank: a forward holds 1
    assert e.value.code == "E703" and "the least it can hold is 1" in e.value.diagnostics[0].message
