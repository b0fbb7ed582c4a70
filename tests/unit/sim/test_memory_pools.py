"""The two-pool memory model (docs/memory.md): recomputation and offload as memory ops, bytes, host limits.

Schedules get their memops directly (`dataclasses.replace(..., memops=...)`, the Schedule the language's
memory ops evaluate to); peaks are checked against hand-computed walks of small cases (p = 2, m = 3).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from repo import ROOT

import pipec.cli.app
import pipec.ir.program
from pipec.api import load
from pipec.driver import schedule_of, simulation
from pipec.errors import PipecError
from pipec.formats.trace import trace_events
from pipec.ir.program import Instr, RankProgram
from pipec.ir.schedule import MemOp
from pipec.passes.compiler import compile_schedule
from pipec.passes.lower import lower
from pipec.passes.memcheck import check_memory, format_table
from pipec.sim.cost_files import read_cost_file
from pipec.sim.memory import (
    fmt_memory,
    instruction_deltas,
    memory_model,
    program_memory,
    rank_memory,
    resident,
)
from pipec.sim.memtime import memory_curves
from pipec.view import report

GiB, MiB = 2.0**30, 2.0**20
BYTES = "examples/mlp-bytes.toml"


def with_memops(sched, per_rank):
    """The schedule with these memops: per rank a list of (op, mb, stage, before)."""
    memops = tuple(tuple(MemOp(*m) for m in per_rank.get(r, ())) for r in range(sched.num_ranks))
    return dataclasses.replace(sched, memops=memops)


def recompute_all(sched, rank):
    """A RECOMPUTE of each of the rank's forwards just before its backward."""
    ops = sched.ops(rank)
    return [("RECOMPUTE", o.mb, o.stage, j) for j, o in enumerate(ops) if o.kind == "B"]


def offload_gpipe_rank0():
    """GPipe p=2 m=3, rank 0 (F0 F1 F2 B0 B1 B2): micro-batches 0 and 1 offloaded after their F and
    reloaded just before their B."""
    return with_memops(
        load("gpipe", p=2, m=3),
        {0: [("OFFLOAD", 0, 0, 1), ("OFFLOAD", 1, 0, 2), ("RELOAD", 0, 0, 3), ("RELOAD", 1, 0, 4)]},
    )


def test_recompute_lowers_the_peak_by_hand():
    # 1F1B p=2 m=3, rank 0: F0 F1 B0 F2 B1 B2, act 1, ckpt 1/8. Recomputing every forward just before its
    # backward walks c, 2c, a + c (RECOMPUTE 0), c, 2c, a + c, c, a, 0: the peak a + c instead of 2a.
    s = load("1f1b", p=2, m=3)
    assert [r.peak for r in rank_memory(s)] == [2.0, 1.0]
    r = with_memops(s, {0: recompute_all(s, 0)})
    reps = rank_memory(r)
    assert [x.peak for x in reps] == [1.125, 1.0]
    assert reps[0].peak_memop == 0  # first reached at RECOMPUTE 0, before B0
    assert [x.peak for x in rank_memory(r, {"ckpt": 0.25})] == [1.25, 1.0]
    # Recomputing only micro-batch 0 does not help 1F1B's rank 0: RECOMPUTE 0 restores it beside F1's act.
    one = with_memops(s, {0: [("RECOMPUTE", 0, 0, 2)]})
    assert [x.peak for x in rank_memory(one)] == [2.0, 1.0]


def test_offload_moves_the_activations_to_the_host():
    # Device: 1, 0, 1, 0, 1, 2 (RELOAD 0), 1, 2 (RELOAD 1), 1, 0; host: 1, 2, 1, 0.
    reps = rank_memory(offload_gpipe_rank0())
    assert (reps[0].peak, reps[0].host_peak) == (2.0, 2.0)
    assert (reps[1].peak, reps[1].host_peak) == (3.0, 0.0)
    assert reps[0].live_host == ((0, 0), (1, 0))
    assert "host peak" in format_table(reps)
    # The peaks in bytes: saved_bytes of 1 GiB per stage.
    b = rank_memory(offload_gpipe_rank0(), {"saved_bytes": GiB})
    assert (b[0].peak, b[0].host_peak, b[0].unit) == (2 * GiB, 2 * GiB, "bytes")
    table = format_table(b)
    assert "2 GiB" in table and "3 GiB" in table


def test_offload_of_a_recomputed_forward_moves_its_input_only():
    s = with_memops(
        load("gpipe", p=2, m=3),
        {0: [("OFFLOAD", 0, 0, 1), ("RELOAD", 0, 0, 3), ("RECOMPUTE", 0, 0, 3)]},
    )
    reps = rank_memory(s, {"saved_bytes": 64 * MiB, "input_bytes": 8 * MiB})
    assert reps[0].host_peak == 8 * MiB
    # F0 c; OFFLOAD; F1 a; F2 a; RELOAD c; RECOMPUTE a - c: 3a at the recompute; B0 -a ...
    assert reps[0].peak == 3 * 64 * MiB


def test_host_limit_is_E406_at_the_offload_that_passes_it():
    s = offload_gpipe_rank0()
    span = s.span_of(0, 1)
    memops = (tuple(dataclasses.replace(m, span=span) if m.mb == 1 and m.op == "OFFLOAD" else m for m in s.memops[0]),)
    s = dataclasses.replace(s, memops=memops + ((),))
    with pytest.raises(PipecError) as e:
        check_memory(s, rank_memory(s, {"host_limit": 1.5}))
    assert e.value.code == "E406"
    assert "`OFFLOAD 1 0`" in str(e.value) and "above its host limit 1.5" in str(e.value)
    assert e.value.span == span
    with pytest.raises(PipecError) as e:  # and through the compiler, in bytes
        compile_schedule(s, {"saved_bytes": GiB, "host_limit": 1.5 * GiB})
    assert e.value.code == "E406" and "2 GiB of host memory" in str(e.value) and "1.5 GiB" in str(e.value)
    check_memory(s, rank_memory(s, {"host_limit": 2}))  # at the limit is within it
    with pytest.raises(PipecError) as e:  # the device limit stays E402, named at the RELOAD that reaches it
        check_memory(s, rank_memory(s, {"limit": 1.5}))
    assert e.value.code == "E402" and "rank 0 needs 2 memory at `RELOAD 0 0`" in str(e.value)


def test_bytes_mode_from_a_cost_file():
    s = load("1f1b", p=4, m=8)
    docs = [read_cost_file(BYTES)]
    sim = simulation(s, docs)
    # Rank 0 holds p = 4 forwards' saved_bytes (256 MiB each) over its 4 GiB of state.
    assert sim.curves.unit == "bytes"
    assert sim.curves.device_peak.tolist() == [5 * GiB, 4.75 * GiB, 4.5 * GiB, 4.25 * GiB]
    text = report.summary_text(sim)
    assert "peak memory 5 GiB" in text and "4.75 GiB" in text
    doc = report.to_json(sim)
    assert doc["memory_unit"] == "bytes" and doc["peak_memory"] == 5 * GiB and doc["peak_memory_text"] == "5 GiB"
    # wact and ckpt not given: act / 2 and act / 8 of the measured act; the unit declarations are not used.
    model = memory_model(s, {"saved_bytes": 256 * MiB})
    assert model["wact"].tolist() == [128 * MiB] * 4 and model["ckpt"].tolist() == [32 * MiB] * 4
    assert model["params"].tolist() == [0.0] * 4
    vh = load("v-half", p=4, m=8)  # declares `memory limit = 3` in units
    assert np.isnan(memory_model(vh, {"saved_bytes": MiB})["limit"]).all()
    assert memory_model(vh)["limit"].tolist() == [3.0] * 4
    with pytest.raises(PipecError) as e:
        memory_model(s, {"state_bytes": GiB})
    assert e.value.code == "E801" and "saved_bytes" in str(e.value)


def test_fmt_memory():
    assert [fmt_memory(x, "bytes") for x in (5 * GiB, 1.5 * GiB, 300 * MiB, 2048.0, 12.0)] == [
        "5 GiB",
        "1.5 GiB",
        "300 MiB",
        "2 KiB",
        "12 B",
    ]
    assert fmt_memory(2.5) == "2.5"


def test_check_memory_table_in_bytes(capsys):
    assert pipec.cli.app.main(["check", "1f1b", "--cost", BYTES, "--memory", "--memory-limit", "5GiB"]) == 0
    out = capsys.readouterr().out
    assert "5 GiB" in out and "4.25 GiB" in out and "limit" in out
    assert pipec.cli.app.main(["check", "1f1b", "--cost", BYTES, "--memory-limit", "4.9GiB"]) != 0
    assert "error[E402]: rank 0 needs 5 GiB memory" in capsys.readouterr().err


def test_deltas_match_the_peaks_and_the_curves():
    cases = [
        with_memops(load("1f1b", p=2, m=3), {0: recompute_all(load("1f1b", p=2, m=3), 0)}),
        with_memops(load("zb-v", p=2, m=4), {1: recompute_all(load("zb-v", p=2, m=4), 1)}),
        load("interleaved-1f1b", p=2, m=4),
    ]
    for s in cases:
        c = compile_schedule(s)
        model = memory_model(s)
        peaks = [r.peak for r in program_memory(c.program, s)]
        assert peaks == [r.peak for r in rank_memory(s)]
        walked = [
            resident(c.program.placement, model, c.program.num_ranks)[r] + max(float(np.cumsum(d).max()), 0.0)
            for r, (d, _) in enumerate(instruction_deltas(c.program, model))
        ]
        assert walked == pytest.approx(peaks)
        sim = simulation(s)  # no host link: every change in instruction order, the same peaks over time
        assert sim.curves.device_peak.tolist() == pytest.approx(peaks)
        assert [float(v[-1]) for _, v in sim.curves.device] == pytest.approx([0.0] * s.num_ranks)


def test_memops_on_a_lowered_program():
    s = offload_gpipe_rank0()
    c = compile_schedule(s)
    names = [str(i) for i in c.program.ranks[0].instructions()]
    assert {"OFFLOAD 0 0", "RELOAD 1 0"} <= set(names)
    assert names.index("OFFLOAD 0 0") < names.index("FWD 1 0") < names.index("RELOAD 0 0") < names.index("BWD 0 0")
    reps = program_memory(c.program, s)
    assert [(r.peak, r.host_peak) for r in reps] == [(2.0, 2.0), (3.0, 0.0)]
    assert reps[0].host_memop == 1  # the host peak, first at the second OFFLOAD: memop 1 of rank 0


def test_memops_on_a_hand_built_program():
    # GPipe p=2 m=3 lowered without memops, then rank 0's stream edited: the walk needs no Schedule memops.
    prog = lower(load("gpipe", p=2, m=3))
    instrs = prog.ranks[0].instructions()
    out = []
    for x in instrs:
        if x.op == "BWD" and x.mb in (0, 1):
            out.append(Instr("RELOAD", x.mb, 0))
        out.append(x)
        if x.op == "FWD" and x.mb in (0, 1):
            out.append(Instr("OFFLOAD", x.mb, 0))
    edited = dataclasses.replace(prog, ranks=(RankProgram.from_instructions(out), prog.ranks[1]))
    reps = program_memory(edited, schedule_of(edited))
    assert [(r.peak, r.host_peak) for r in reps] == [(2.0, 2.0), (3.0, 0.0)]
    assert reps[0].host_memop == -1 and reps[0].host_op == "OFFLOAD 1 0"


def test_curves_over_time_with_the_host_link():
    sim = simulation(offload_gpipe_rank0())
    mc = sim.curves
    assert mc.offloads and mc.host_peak.tolist() == [2.0, 0.0]
    t, v = mc.host[0]
    assert float(v[-1]) == 0.0 and float(v.max()) == 2.0
    # While a transfer runs both pools hold the micro-batch: the device curve never goes below what the
    # order-based walk holds at the same point, and it ends empty.
    assert float(mc.device[0][1][-1]) == 0.0 and mc.device_peak[0] >= 2.0
    ev = trace_events(sim.timeline, mc)
    names = {e["name"] for e in ev["traceEvents"] if e["ph"] == "C"}
    assert names == {"memory", "host memory"}
    assert max(e["args"]["host memory"] for e in ev["traceEvents"] if e["name"] == "host memory") == 2.0
    doc = json.loads(json.dumps(report.to_json(sim)))
    assert doc["per_rank"][0]["host_peak_memory"] == 2 and doc["per_rank"][0]["host_memory_curve"][-1][1] == 0
    assert "host peak" in report.summary_text(sim)


def test_plot_draws_the_host_pool(tmp_path):
    from pipec.view.render import plot_timelines

    sim = simulation(offload_gpipe_rank0())
    assert report.panel(simulation(load("gpipe", p=2, m=3))).host is None
    panel = report.panel(sim)
    assert panel.host is not None and len(panel.host) == 2
    plot_timelines([panel], tmp_path / "m.svg", width=6, dpi=40)
    svg = (tmp_path / "m.svg").read_text()
    assert "host memory" in svg and "offload" in svg


@pytest.mark.parametrize("name", ["zb-v", "1f1b-offload", "1f1b-recompute"])
def test_curves_of_a_timeline_alone_match_the_programs(name):
    from pipec.sim.costs import cost_model
    from pipec.sim.memtime import timeline_curves
    from pipec.sim.simulate import simulate

    s = load(name, p=2, m=4)
    c = compile_schedule(s)
    tl = simulate(c.program, cost_model(s))
    new = memory_curves(tl, c.program, memory_model(s))
    alone = timeline_curves(tl, memory_model(s))
    assert alone.device_peak.tolist() == pytest.approx(new.device_peak.tolist())
    assert alone.host_peak.tolist() == pytest.approx(new.host_peak.tolist())
    for (t0, v0), (t1, v1) in zip(alone.device + alone.host, new.device + new.host):
        assert t0.tolist() == t1.tolist() and v0.tolist() == pytest.approx(v1.tolist())


def test_errors_doc_example_of_E406_prints_what_it_shows(capsys):

    text = (ROOT / "docs" / "errors.md").read_text()
    body = text.split("### E406")[1].split("\n### ")[0]
    program = body.split("```python\n")[1].split("```")[0]
    exec(program, {})
    lines = program.splitlines()
    code = max(i for i, line in enumerate(lines) if not line.startswith("# "))
    expected = [line[2:] for line in lines[code + 1 :]]  # the comment block that ends the example
    assert expected and capsys.readouterr().out.splitlines() == expected


def test_trace_keeps_the_host_link_and_recomputes(tmp_path):
    from pipec.formats.trace import read_trace, write_trace

    s = offload_gpipe_rank0()
    s = dataclasses.replace(s, memops=(s.memops[0], tuple(MemOp(*m) for m in recompute_all(s, 1))))
    sim = simulation(s)
    tl = sim.timeline
    write_trace(tl, tmp_path / "t.json", sim.curves)
    back = read_trace(tmp_path / "t.json")
    for f in ("rank", "op", "mb", "stage", "start", "end", "host_rank", "host_op", "host_mb", "host_start", "host_end"):
        assert np.array_equal(getattr(back, f), getattr(tl, f)), f
    assert len(tl.host_rank) == 4 and (tl.op == pipec.ir.program.CODE["RECOMPUTE"]).sum() == 3


def test_errors_doc_console_example_of_E406(capsys):

    text = (ROOT / "docs" / "errors.md").read_text()
    body = text.split("### E406")[1].split("\n### ")[0]
    command, *shown = body.split("```console\n")[1].split("```")[0].splitlines()
    assert pipec.cli.app.main(command.split()[2:]) == 1
    assert capsys.readouterr().err.splitlines() == shown
