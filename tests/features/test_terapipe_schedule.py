"""TeraPipe, the library schedule (schedules/terapipe.pipe), and how every pass shows token slices.

The schedule checks, compiles and passes the testing kit's independent invariants over a parameter grid in
both orders; its bubble is GPipe's over m * n units with equal slices; its two orders equal rule-based
references. Then the displays: `pipec show`'s grid, the text gantt, the trace (names, args and the round
trip), the plot, the simulate report, the memory report, deadlock explanations of a schedule and of an
edited Program, and the export refusals (E615, E616).
"""

from __future__ import annotations

import json
from dataclasses import replace
from fractions import Fraction

import matplotlib
import pytest

from pipec.api import load
from pipec.driver import simulation
from pipec.errors import PipecError
from pipec.formats.program_file import from_text, to_text
from pipec.formats.torch_csv_writer import export_csv
from pipec.formats.torchtitan import export_torchtitan
from pipec.formats.trace import read_trace, trace_events, write_trace
from pipec.ir.program import RankProgram
from pipec.ir.schedule import unit_json, unit_label
from pipec.passes.compiler import compile_schedule
from pipec.passes.memcheck import format_table
from pipec.sim.memory import rank_memory
from pipec.testing import InvariantError, Listing, check_invariants, program_problem
from pipec.testing.mutations import _dependency_pairs, _move_before
from pipec.view import report
from pipec.view.grid import cells, format_grid, grid_title
from pipec.view.render import Panel, plot_timelines, text_gantt

LIB = "terapipe"


def tp(**params):
    return load(LIB, **params)


def ops_of(s, r: int) -> list[tuple[str, int, int]]:
    """Rank r's order as (kind, micro-batch, slice)."""
    n = s.slicing.slices
    return [(o.kind, *divmod(o.mb, n)) for o in s.ops(r)]


# ---------------------------------------------------------------- the schedule


def test_grid_checks_compiles_and_holds_the_invariants():
    """Every (p, m, n, order, L) of a small grid: evaluated and checked with its `expect`s, lowered and
    proven, and the testing kit's independent checks agree (slice rules, messages, memory, timeline)."""
    seen = 0
    for p in (1, 2, 3, 4):
        for m in (1, 2, 3):
            for n in (1, 2, 4):
                for f1b1 in (False, True):
                    for L in {4 * n, 4 * n + 1}:  # equal slices, then unequal ones
                        s = tp(p=p, m=m, n=n, L=L, f1b1=f1b1)
                        assert s.num_sequences == m and s.num_microbatches == m * n
                        assert s.slicing.tokens == tuple(L // n + (j < L % n) for j in range(n))
                        checked = check_invariants(s)
                        assert checked.ops == 2 * p * m * n
                        assert checked.expectations == p  # in_flight per rank (the bubble formula: below)
                        seen += 1
    assert seen == 4 * 3 * 3 * 2 * 2


def test_gpipe_bubble_is_over_units():
    """Equal slices, unit costs, attn = 0: each unit costs 1/n of a sequence, so the bubble is GPipe's over
    m * n micro-batches, (p - 1) / (m n + p - 1), exactly; the 1F1B order loses the same."""
    for p in (2, 3, 4, 6):
        for m in (1, 2):
            for n in (2, 4, 8):
                for f1b1 in (False, True):
                    sim = simulation(tp(p=p, m=m, n=n, L=64 * n, f1b1=f1b1))
                    want = Fraction(p - 1, m * n + p - 1)
                    assert sim.stats.bubble_rate == pytest.approx(float(want), abs=1e-12), (p, m, n, f1b1)
                    assert sim.stats.makespan == pytest.approx(3 * (m + (p - 1) / n))


def test_slicing_beats_microbatches_at_one_sequence():
    """One sequence per step: without slices the pipeline is idle (p - 1) / p of the time; n slices cut that."""
    one = simulation(tp(p=4, m=1, n=1)).stats.bubble_rate
    four = simulation(tp(p=4, m=1, n=4)).stats.bubble_rate
    assert one == pytest.approx(3 / 4) and four == pytest.approx(3 / 7)


def ref_gpipe(m: int, n: int) -> list[tuple[str, int, int]]:
    return [("F", i, j) for i in range(m) for j in range(n)] + [("B", i, n - 1 - j) for i in range(m) for j in range(n)]


def ref_1f1b(p: int, r: int, m: int, n: int) -> list[tuple[str, int, int]]:
    """1F1B over units as a rule: rank r runs the next forward while fewer than p - r + n - 1 units are in
    flight, else the next backward, the backwards of a sequence last slice first."""
    fwd = [("F", i, j) for i in range(m) for j in range(n)]
    bwd = [("B", i, n - 1 - j) for i in range(m) for j in range(n)]
    out, f, b = [], 0, 0
    while b < len(bwd):
        if f < len(fwd) and f - b < p - r + n - 1:
            out.append(fwd[f])
            f += 1
        else:
            out.append(bwd[b])
            b += 1
    return out


def test_orders_equal_the_references():
    for p in (1, 2, 4):
        for m in (1, 3):
            for n in (1, 2, 3):
                g, o = tp(p=p, m=m, n=n), tp(p=p, m=m, n=n, f1b1=True)
                for r in range(p):
                    assert ops_of(g, r) == [(k, i, j) for k, i, j in ref_gpipe(m, n)]
                    assert ops_of(o, r) == ref_1f1b(p, r, m, n), (p, m, n, r)


def test_1f1b_order_holds_fewer_units():
    g, o = rank_memory(tp(p=4, m=4, n=4)), rank_memory(tp(p=4, m=4, n=4, f1b1=True))
    assert [x.peak for x in g] == [4.0] * 4  # GPipe: every sequence's activations, keys and values
    assert [x.peak for x in o] == [(4 - r + 3) / 4 for r in range(4)]  # p - r + n - 1 units of 1/4 each


def test_bad_parameters_are_located():
    with pytest.raises(PipecError) as e:
        tp(n=8, L=4)
    assert e.value.code == "E202" and "one token per slice" in str(e.value)


# ---------------------------------------------------------------- what the passes show


def test_show_grid_names_slices():
    s = tp(p=2, m=2, n=2, L=10, f1b1=True)
    assert cells(s, 1) == ["F0s0", "F0s1", "B0s1", "F1s0", "B0s0", "F1s1", "B1s1", "B1s0"]
    assert grid_title(s) == (
        "terapipe (p=2 m=2 n=2 L=10 f1b1=True): 2 stages on 2 ranks, 2 micro-batches x 2 slices of 5 tokens"
        " (cells: F<mb>s<slice>)"
    )
    assert format_grid(s).splitlines()[1].split() == ["Step", "00", "F0s0", "F0s0"]
    assert grid_title(tp(p=2, m=1, n=3, L=8)).endswith(
        "1 micro-batches x 3 slices of 3, 3, 2 tokens (cells: F<mb>s<slice>)"
    )
    # without slices, what it always was
    assert grid_title(load("gpipe", p=2, m=3)) == "gpipe (p=2 m=3): 2 stages on 2 ranks, 3 micro-batches"
    assert cells(load("gpipe", p=2, m=2), 0) == ["F0", "F1", "B0", "B1"]


def test_unit_forms():
    s = tp(m=2, n=3, L=9).slicing
    assert [unit_label(s, u) for u in (0, 2, 3, 5)] == ["0s0", "0s2", "1s0", "1s2"]
    assert unit_json(s, 5) == {"mb": 1, "slice": 2, "unit": 5}
    assert unit_label(None, 5) == "5" and unit_json(None, 5) == {"mb": 5}


def test_text_gantt_and_report_name_slices():
    sim = simulation(tp(p=2, m=1, n=2, L=8))
    assert sim.timeline.slicing == sim.schedule.slicing
    rows = text_gantt(sim.timeline, 200).splitlines()
    assert rows[1].split() == ["rank", "0", "F0s0", "F0s1", "...............B0s1", "B0s0"]
    assert rows[2].split() == ["rank", "1", ".....F0s0", "F0s1", "B0s1", "B0s0", ".........."]
    text = report.summary_text(sim)
    assert (
        text.splitlines()[2]
        == "slices: 1 micro-batches x 2 slices of 4 tokens (2 units, each costed by its tokens and context)"
    )
    assert "slices:" not in report.summary_text(simulation(load("gpipe", p=2, m=2)))
    assert report.to_json(sim)["slicing"] == {"slices": 2, "seqlen": 8, "tokens": [4, 4], "lengths": [8]}


def test_trace_names_slices_and_round_trips(tmp_path):
    sim = simulation(tp(p=2, m=2, n=2, L=8))
    doc = trace_events(sim.timeline)
    comp = [e for e in doc["traceEvents"] if e.get("cat") == "FWD" and e["pid"] == 0]
    assert [e["name"] for e in comp] == ["F0s0", "F0s1", "F1s0", "F1s1"]
    args = {k: comp[3]["args"][k] for k in ("op", "mb", "slice", "unit", "stage")}
    assert args == {"op": "FWD", "mb": 1, "slice": 1, "unit": 3, "stage": 0}
    sends = [e for e in doc["traceEvents"] if e.get("cat") == "send"]
    assert sends[1]["name"] == "act 0s1.0 -> rank 1" and sends[1]["args"]["slice"] == 1
    assert doc["otherData"]["slicing"] == {
        "sequences": 2,
        "slices": 2,
        "seqlen": 8,
        "tokens": [4, 4],
        "lengths": [8, 8],
    }
    path = tmp_path / "t.json"
    write_trace(sim.timeline, path)
    back = read_trace(path)
    assert back.slicing == sim.timeline.slicing
    assert back.mb.tolist() == sim.timeline.mb.tolist() and back.msg_mb.tolist() == sim.timeline.msg_mb.tolist()
    plain = trace_events(simulation(load("gpipe", p=2, m=2)).timeline)
    assert "slicing" not in plain["otherData"]
    assert all("slice" not in e.get("args", {}) for e in plain["traceEvents"])


def test_plot_labels_and_shades_slices(tmp_path):
    sim = simulation(tp(p=2, m=1, n=3, L=9))
    path = tmp_path / "p.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as text, to read it back
        plot_timelines([Panel(sim.timeline, "tp")], path)
    svg = path.read_text()
    for label in ("0s0", "0s1", "0s2", "F, slice 2", "B, slice 2"):
        assert f">{label}<" in svg, label


def test_memory_report_names_slices():
    s = tp(p=2, m=2, n=2, L=8)
    table = format_table(rank_memory(s))
    assert "F(1, slice 1, stage 0)  0s0,0s1,1s0,1s1" in table.splitlines()[1]
    with pytest.raises(PipecError) as e:
        compile_schedule(s, {"limit": 1.5})
    err = str(e.value)
    assert e.value.code == "E402" and "at `F(1, slice 1, stage 0)`" in err
    assert "live activations (micro-batch@stage): 0s0@0, 0s1@0, 1s0@0, 1s1@0" in err


# ---------------------------------------------------------------- deadlocks


DEADLOCK = """schedule "dl" (p: int = 2, m: int = 2, n: int = 2) {
    stages p
    slices n
    seqlen 8
    ops F, B
    rank r {
        if r == 0 {
            for i in 0 .. m { F(i, slice: 0)  F(i, slice: 1)  B(i, slice: 1)  B(i, slice: 0) }
        } else {
            for i in 0 .. m { F(i, slice: 0)  F(i, slice: 1) }
            for i in 0 .. m { B(i, slice: 1)  B(i, slice: 0) }
        }
    }
}
"""


def test_schedule_deadlock_names_slices(tmp_path):
    f = tmp_path / "dl.pipe"
    f.write_text(DEADLOCK)
    with pytest.raises(PipecError) as e:
        compile_schedule(load(str(f)))
    notes = [d for d in str(e.value).splitlines() if "note:" in d]
    assert e.value.code == "E401"
    assert notes[0].endswith(
        "rank 0 waits at `B(0, slice 1, stage 0)` (line 8) for the gradient of `B(0, slice 1, stage 1)` from "
        "rank 1; rank 1 only reaches `B(0, slice 1, stage 1)` after `F(1, slice 0, stage 1)` (line 10)"
    )


def test_program_deadlock_names_slices():
    """The Program of a valid TeraPipe schedule, edited in its text form so that rank 0 runs sequence 0's
    backwards before sequence 1's forwards: the ranks' message orders differ (NCCL would hang), and the
    diagnostic names each message's micro-batch and slice."""
    text = to_text(compile_schedule(tp(p=2, m=2, n=2, L=8)).program)
    assert 'slicing {"slices":2,"seqlen":8,"tokens":[4,4],"lengths":[8,8]}' in text
    fwd = "FWD 2 0\nSEND_ACT 2 0 1\nFWD 3 0\nSEND_ACT 3 0 1 &\n"
    bwd = "RECV_GRAD 1 0 1\nBWD 1 0\nRECV_GRAD 0 0 1\nBWD 0 0\n"
    assert fwd + bwd in text
    edited = from_text(text.replace(fwd + bwd, bwd + fwd.replace(" &", "")))
    with pytest.raises(PipecError) as e:
        compile_check(edited)
    assert e.value.code == "E404"
    assert "rank 0's message 2 with rank 1 is `RECV_GRAD 1 0 1` (micro-batch 0, slice 1)" in str(e.value)
    assert "rank 1's message 2 with rank 0 is `RECV_ACT 2 1 0` (micro-batch 1, slice 0)" in str(e.value)
    assert program_problem(edited) is not None  # the kit's own check sees it too


def compile_check(prog):
    from pipec.passes.dryrun import prove

    prove(prog)


def test_dry_run_waits_name_slices():
    from pipec.ir.program import Instr
    from pipec.passes.dryrun import Wait, _mb_text, _unit_text

    sl = tp(m=2, n=2, L=8).slicing
    w = Wait(0, 3, Instr("RECV_GRAD", 1, 0, 1), "arrival", 1, f"the gradient of {_mb_text(sl, 1)} from stage 1")
    w = Wait(*[getattr(w, k) for k in ("rank", "index", "instr", "event", "peer", "what")], _unit_text(sl, 1))
    assert w.describe() == (
        "rank 0 blocks at `RECV_GRAD 1 0 1` (micro-batch 0, slice 1) waiting for the gradient of micro-batch 0, "
        "slice 1 from stage 1, sent by rank 1"
    )
    assert _unit_text(None, 1) == "" and _mb_text(None, 3) == "micro-batch 3"


# ---------------------------------------------------------------- the testing kit


def test_swapped_slices_are_caught_by_the_slice_rule():
    """A mutation that runs slice 1 of a sequence before slice 0 on a stage: pipec says E304 with the slice
    rule's note, and the kit's independent check agrees (so check_invariants raises pipec's error)."""
    base = Listing.from_schedule(tp(p=2, m=2, n=3, L=9))
    assert "    slices 3" in base.text() and "F(0, slice: 1, stage: 0)" in base.text()
    slots = base._slots(0)
    _move_before(slots, ("F", 1, 0), ("F", 0, 0))
    bad = base._with_slots({0: slots})
    with pytest.raises(PipecError) as e:
        check_invariants(bad)
    assert e.value.code == "E304"
    assert "F(0, slice 1, stage 0) on rank 0 needs F(0, slice 0, stage 0), which comes later" in str(e.value)
    assert "note: slice 1 attends to the keys and values of slice 0 of its sequence on the same stage" in str(e.value)
    for r, needed, needer in _dependency_pairs(base):  # every same-rank rule, the slice rules among them
        slots = base._slots(r)
        _move_before(slots, needer, needed)
        with pytest.raises(PipecError) as e:
            check_invariants(base._with_slots({r: slots}))
        assert e.value.code == "E304"
    kinds = {(a[0], b[0], a[1] % 3 != b[1] % 3) for _, a, b in _dependency_pairs(base)}
    assert ("F", "F", True) in kinds and ("B", "B", True) in kinds  # slice rules are among the pairs


def test_listing_round_trip_keeps_the_slicing():
    s = tp(p=2, m=2, n=3, L=10, f1b1=True)
    back = Listing.from_schedule(s).build()
    assert back.slicing == s.slicing
    assert [back.ops(r) for r in range(2)] == [s.ops(r) for r in range(2)]


def test_program_slice_order_is_checked_independently():
    """A Program whose rank runs FWD of slice 1 before slice 0 on one stage: the Program reader refuses its
    text (E502), and the kit's program_problem says why on its own."""
    prog = compile_schedule(tp(p=1, m=1, n=2, L=4)).program
    text = to_text(prog)
    assert "FWD 0 0\nFWD 1 0\n" in text
    with pytest.raises(PipecError) as e:
        from_text(text.replace("FWD 0 0\nFWD 1 0\n", "FWD 1 0\nFWD 0 0\n"))
    assert e.value.code == "E502" and "the slice before it" in str(e.value)
    ins = prog.ranks[0].instructions()
    ins[0], ins[1] = ins[1], ins[0]
    bad = replace(prog, ranks=(RankProgram.from_instructions(ins),))
    assert program_problem(bad) == "rank 0: FWD 1 0 runs before FWD 0 0, which it needs"
    with pytest.raises(InvariantError):
        check_invariants(bad)


# ---------------------------------------------------------------- interop


def test_exports_refuse_slices():
    s = tp(p=2, m=2, n=2, L=8)
    for run in (
        lambda: export_csv(s),
        lambda: export_csv(s, compile_schedule(s).program),
        lambda: export_torchtitan(s, "out.csv"),
    ):
        with pytest.raises(PipecError) as e:
            run()
        assert e.value.code == "E615"
        assert "token slices have no torch form" in str(e.value) and "slices n" in str(e.value)
    assert export_csv(tp(p=2, m=2, n=1)) == "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n"  # one slice: a plain GPipe


def test_exports_refuse_variable_lengths(tmp_path):
    f = tmp_path / "vl.pipe"
    f.write_text(
        'schedule "t" (p: int = 2, m: int = 2) {\n    stages p\n    length i -> 512 - 100 * i\n    ops F, B\n'
        "    rank r {\n        for i in 0 .. m { F(i) }\n        for i in 0 .. m { B(i) }\n    }\n}\n"
    )
    s = load(str(f))
    for run in (lambda: export_csv(s), lambda: export_torchtitan(s, "out.csv")):
        with pytest.raises(PipecError) as e:
            run()
        assert e.value.code == "E616" and "note: lengths: 512, 412" in str(e.value)


def test_check_json_head_counts_sequences():
    head = tp(p=2, m=3, n=4, L=8).head()
    assert head["microbatches"] == 3 and head["slicing"]["slices"] == 4
    assert json.dumps(head)  # JSON-ready
