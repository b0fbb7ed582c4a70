"""Memory ops (RECOMPUTE, OFFLOAD, RELOAD) through lowering, Program validation, the dry run, the
simulator and the torch exporter (issue 19).

Schedules with memory ops are library schedules with `Schedule.memops` set by hand (the language's form
for them is another module's); times are worked out by hand for 1F1B at p=2, m=2 under F=1, B=2 (a full
backward), where rank 0 runs F0 [0,1], F1 [1,2], B0 [4,6], B1 [7,9] and rank 1 F0 [1,2], B0 [2,4],
F1 [4,5], B1 [5,7]: makespan 9.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipec.driver import build
from pipec.errors import PipecError
from pipec.formats.program_file import from_json, from_text, to_json, to_text
from pipec.formats.torch_csv_writer import export_csv
from pipec.frontend.library import read
from pipec.ir.dataparallel import DataParallel
from pipec.ir.opcodes import BWD, FWD, OFFLOAD, RECOMPUTE, RELOAD
from pipec.ir.program import Instr, Program, RankProgram
from pipec.ir.schedule import MemOp
from pipec.passes.deadlock import global_order
from pipec.passes.dryrun import _columns, _witnessed, dry_run
from pipec.passes.lower import lower, lower_with_proof, op_times
from pipec.sim.cost_files import normalize
from pipec.sim.costs import cost_model
from pipec.sim.simulate import simulate, stats


def _sched(name: str = "1f1b", **params):
    return build(read(name), params or {"p": 2, "m": 2})


def _at(sched, r: int, kind: str, mb: int, stage: int) -> int:
    """The index of op (kind, mb, stage) in rank r's order."""
    return next(j for j, o in enumerate(sched.ops(r)) if (o.kind, o.mb, o.stage) == (kind, mb, stage))


def _with(sched, *per_rank):
    return dataclasses.replace(sched, memops=tuple(tuple(r) for r in per_rank))


def _offload_pair(sched, r: int, mb: int, stage: int) -> list[MemOp]:
    """OFFLOAD right after F(mb, stage), RELOAD right before its B."""
    return [
        MemOp("OFFLOAD", mb, stage, _at(sched, r, "F", mb, stage) + 1),
        MemOp("RELOAD", mb, stage, _at(sched, r, "B", mb, stage)),
    ]


def _ops(prog: Program, r: int) -> list[str]:
    return [str(i) for i in prog.ranks[r].instructions()]


# ---- lowering ------------------------------------------------------------------


def test_lowering_places_each_memop_before_its_step():
    s = _sched()
    rec = MemOp("RECOMPUTE", 0, 0, _at(s, 0, "B", 0, 0))
    prog = lower(_with(s, [rec, *_offload_pair(s, 0, 1, 0)], []))
    ops = _ops(prog, 0)
    # RECOMPUTE and OFFLOAD 1 0 both go before B(0)'s step: after the receive posted for it, before the BWD;
    # RELOAD 1 0 before B(1)'s step, after its receive.
    assert ops == [
        "FWD 0 0",
        "SEND_ACT 0 0 1",
        "FWD 1 0",
        "SEND_ACT 1 0 1 &",
        "RECV_GRAD 0 0 1",
        "RECOMPUTE 0 0",
        "OFFLOAD 1 0",
        "BWD 0 0",
        "RECV_GRAD 1 0 1",
        "RELOAD 1 0",
        "BWD 1 0",
        "REDUCE_GRAD 0",
        "STEP 0",
    ]
    assert _ops(prog, 1) == _ops(lower(s), 1)  # a rank without memory ops lowers as before


@pytest.mark.parametrize("dp", [DataParallel(size=2), DataParallel(size=2, kind="fsdp")])
def test_lowering_with_collectives_puts_memops_after_them(dp):
    s = _sched()
    rec = MemOp("RECOMPUTE", 0, 1, _at(s, 1, "B", 0, 1))
    prog = lower(_with(s, [], [rec]), dp)
    ops = _ops(prog, 1)
    j = ops.index("RECOMPUTE 0 1")
    assert ops[j + 1] == "BWD 0 1" and ops.index("FWD 0 1") < j
    if dp.kind == "fsdp":  # inside stage 1's window: after its UNSHARD, before its RESHARD
        assert ops.index("UNSHARD 1") < j < ops.index("RESHARD 1")
    base = [x for x in ops if x != "RECOMPUTE 0 1"]
    assert base == _ops(lower(s, dp), 1)


def test_the_witness_still_proves_a_program_with_memops():
    s = _sched("zb-h1", p=2, m=4)
    mem = []
    for r in range(2):
        row = []
        for o in s.ops(r):
            if o.kind == "F":
                b = _at(s, r, "B", o.mb, o.stage)
                row += _offload_pair(s, r, o.mb, o.stage) if o.mb % 2 else [MemOp("RECOMPUTE", o.mb, o.stage, b)]
        mem.append(row)
    s2 = _with(s, *mem)
    prog, run = lower_with_proof(s2)
    assert run.completed
    cols = _columns(prog)
    assert _witnessed(cols, op_times(s2, global_order(s2)))  # no replay needed: memops wait on no peer
    assert dry_run(prog).completed  # and the replay agrees


def test_a_memop_placed_out_of_range_is_located():
    s = _sched()
    with pytest.raises(PipecError) as e:
        lower(_with(s, [MemOp("RECOMPUTE", 0, 0, 9)], []))
    assert e.value.code == "E424" and "outside 0 .. 4" in str(e.value)


def test_lowering_memops_that_break_a_rule_is_e424():
    s = _sched()
    bad = _with(s, [MemOp("RELOAD", 1, 0, 0), MemOp("OFFLOAD", 1, 0, 2)], [])
    with pytest.raises(PipecError) as e:
        lower(bad)
    assert e.value.code == "E424"
    assert "rank 0, instruction #0 `RELOAD 1 0`: has no OFFLOAD 1 0 before it" in str(e.value)


# ---- validation ------------------------------------------------------------------


def _program(rank0: list[Instr]) -> Program:
    """1F1B p=2 m=2 with rank 0's stream replaced."""
    base = lower(_sched())
    return dataclasses.replace(base, ranks=(RankProgram.from_instructions(rank0), base.ranks[1]))


def _rank0(*insert: tuple[int, Instr]) -> list[Instr]:
    """Rank 0's lowered stream with instructions inserted before these indices (of the original)."""
    instrs = lower(_sched()).ranks[0].instructions()  # FWD 0 0, SEND, FWD 1 0, SEND &, RECV, BWD 0 0, RECV, BWD 1 0
    out = []
    for j, x in enumerate(instrs + [None]):
        out += [i for at, i in insert if at == j]
        if x is not None:
            out.append(x)
    return out


def _m(op: str, mb: int, stage: int = 0) -> Instr:
    return Instr(op, mb, stage)


@pytest.mark.parametrize(
    "insert, rule",
    [
        (((0, _m("RECOMPUTE", 0)),), "comes before the FWD it recomputes"),
        (((8, _m("RECOMPUTE", 0)),), "comes after BWD 0 0"),
        (((0, _m("OFFLOAD", 0)), (5, _m("RELOAD", 0))), "comes before FWD 0 0, whose saved activations it moves"),
        (((1, _m("OFFLOAD", 0)),), "is never reloaded"),
        (((5, _m("RELOAD", 0)),), "has no OFFLOAD 0 0 before it"),
        (((1, _m("OFFLOAD", 0)), (8, _m("RELOAD", 0))), "comes after BWD 0 0, which waits for it"),
        (((1, _m("OFFLOAD", 0)), (5, _m("RECOMPUTE", 0)), (5, _m("RELOAD", 0))), "comes before RELOAD 0 0"),
        (((5, _m("RECOMPUTE", 0)), (5, _m("RECOMPUTE", 0))), "a second RECOMPUTE of micro-batch 0 on stage 0"),
        (((1, _m("OFFLOAD", 0, 1)),), "stage 1 is placed on rank 1"),
    ],
)
def test_validation_names_rank_instruction_and_rule(insert, rule):
    prog = _program(_rank0(*insert))
    with pytest.raises(PipecError) as e:
        dry_run(prog)  # validates first
    assert e.value.code == "E502"
    assert "rank 0, instruction #" in str(e.value) and rule in str(e.value)


def test_valid_memops_pass_and_round_trip_through_both_forms():
    s = _sched()
    prog = lower(_with(s, [MemOp("RECOMPUTE", 0, 0, 2), *_offload_pair(s, 0, 1, 0)], _offload_pair(s, 1, 1, 1)))
    assert from_text(to_text(prog)) == prog
    assert from_json(to_json(prog)) == prog
    assert "RECOMPUTE 0 0\n" in to_text(prog) and "OFFLOAD 1 1\n" in to_text(prog)


def test_the_text_reader_points_at_the_bad_memop_line():
    text = to_text(_program(_rank0((5, _m("RELOAD", 0)))))
    with pytest.raises(PipecError) as e:
        from_text(text, "p.txt")
    line = next(n for n, ln in enumerate(text.split("\n"), 1) if ln == "RELOAD 0 0")
    assert e.value.code == "E502" and e.value.span.line == line


# ---- simulation (1F1B p=2 m=2, F=1, B=2; the module docstring's times) ----------------------------


def _sim(sched, events: bool = False, **cost):
    prog = lower(sched)
    return simulate(prog, cost_model(sched, [normalize({"F": 1.0, "B": 2.0, **cost})]), _events=events)


def _event(tl, r: int, op: int, mb: int, stage: int) -> tuple[float, float]:
    j = np.flatnonzero((tl.rank == r) & (tl.op == op) & (tl.mb == mb) & (tl.stage == stage))
    assert len(j) == 1
    return float(tl.start[j[0]]), float(tl.end[j[0]])


@pytest.mark.parametrize("events", [False, True])
def test_recompute_costs_a_forward_on_the_backward_side(events):
    s = _sched()
    assert _sim(s, events).makespan == 9.0
    tl = _sim(_with(s, [], [MemOp("RECOMPUTE", 0, 1, _at(s, 1, "B", 0, 1))]), events)
    # rank 1: F0 [1,2], RECOMPUTE [2,3], B0 [3,5]; rank 0's B0 [5,7], rank 1's F1 [5,6], B1 [6,8]; B1 [8,10]
    assert _event(tl, 1, RECOMPUTE, 0, 1) == (2.0, 3.0)
    assert _event(tl, 1, BWD, 0, 1) == (3.0, 5.0)
    assert tl.makespan == 10.0
    st = stats(tl)
    assert st.ranks[1].busy == 7.0  # recompute is compute: 2 F + 1 recompute + 2 B
    assert st.ideal == 7.0 and st.bubble_rate == pytest.approx(3 / 10)


@pytest.mark.parametrize("events", [False, True])
def test_offload_and_reload_run_on_the_host_link(events):
    s = _sched()
    s2 = _with(s, _offload_pair(s, 0, 0, 0), [])  # OFFLOAD 0 0 after F0 (at 1), RELOAD 0 0 before B0's step
    fast = _sim(s2, events, offload=0.5)
    # OFFLOAD [1, 1.5]; RELOAD issued after F1 at 2: [2, 2.5]; B0 still waits for its gradient at 4
    assert fast.host_op.tolist() == [OFFLOAD, RELOAD]
    assert fast.host_start.tolist() == [1.0, 2.0] and fast.host_end.tolist() == [1.5, 2.5]
    assert _event(fast, 0, BWD, 0, 0) == (4.0, 6.0) and fast.makespan == 9.0
    slow = _sim(s2, events, offload=5.0)
    # OFFLOAD [1, 6]; RELOAD after it on the one link: [6, 11]; B0 [11, 13], B1 [13, 15]
    assert slow.host_start.tolist() == [1.0, 6.0] and slow.host_end.tolist() == [6.0, 11.0]
    assert _event(slow, 0, BWD, 0, 0) == (11.0, 13.0) and slow.makespan == 15.0
    assert _event(slow, 0, FWD, 1, 0) == (1.0, 2.0)  # the link overlaps compute
    assert len(slow.wait_rank) == 0  # a wait for the host link is not a collective's exposure


def test_host_time_from_bytes_and_the_host_link_else_half_a_forward():
    s = _sched()
    s2 = _with(s, _offload_pair(s, 0, 0, 0), [])
    tl = _sim(s2, saved_bytes=4e9, host_bandwidth="2GB/s", host_latency=0.25)  # 4e9 B / 2e9 B/s + 0.25 s
    assert (tl.host_end - tl.host_start).tolist() == [2.25, 2.25]
    tl = _sim(s2, saved_bytes=4e9)  # bytes without a link: the default, half the stage's F
    assert (tl.host_end - tl.host_start).tolist() == [0.5, 0.5]
    tl = _sim(s2, saved_bytes=4e9, host_bandwidth="2GB/s", offload=0.75)  # a given time wins
    assert (tl.host_end - tl.host_start).tolist() == [0.75, 0.75]
    host = cost_model(s2, [normalize({"saved_bytes": 4e9, "host_bandwidth": "2GB/s"})]).describe()["host"]
    assert host["saved_bytes"] == 4e9 and host["host_bandwidth_bps"] == 16e9 and host["offload"] is None
    rec = _with(s, [*_offload_pair(s, 0, 0, 0), MemOp("RECOMPUTE", 0, 0, _at(s, 0, "B", 0, 0))], [])
    tl = _sim(rec, saved_bytes=4e9, input_bytes=1e9, host_bandwidth="1GB/s")  # a recomputed F keeps its input
    # OFFLOAD [1, 2], RELOAD (issued after F1) [2, 3]; the RECOMPUTE recomputes from what came back: [3, 4]
    assert tl.host_start.tolist() == [1.0, 2.0] and tl.host_end.tolist() == [2.0, 3.0]
    assert _event(tl, 0, RECOMPUTE, 0, 0) == (3.0, 4.0) and _event(tl, 0, BWD, 0, 0) == (4.0, 6.0)


def test_a_recompute_keeps_only_the_input_until_it_runs_on_the_timeline_curves_too():
    from pipec.sim.memtime import memory_curves, timeline_curves

    s = _sched()
    memory = {k: np.ones(2) for k in ("act", "wact", "params")} | {"ckpt": np.full(2, 0.25)}
    memory |= {"limit": np.full(2, np.nan), "host_limit": np.full(2, np.nan)}
    changed = _with(s, [MemOp("RECOMPUTE", 1, 0, _at(s, 0, "B", 1, 0))], [])
    tl = _sim(changed)  # the RECOMPUTE of micro-batch 1 runs [6, 7]; B1 [7, 9]
    assert _event(tl, 0, RECOMPUTE, 1, 0) == (6.0, 7.0)
    prog = lower(changed)
    curve = memory_curves(tl, prog, memory).device[0]
    # rank 0 holds params 1, F0 +1 at 0, F1 +0.25 at 1 (recomputed: its input only), B0 frees 1 at 6,
    # the RECOMPUTE adds the other 0.75 at 6, B1 frees 1 at 9
    assert curve[0].tolist() == [0, 1, 6, 9] and curve[1].tolist() == [2, 2.25, 2, 1]
    # A Timeline alone (a measured run's) gives the same curves: its streams are what ran.
    alone = timeline_curves(tl, memory)
    for (t, v), (t0, v0) in zip(alone.device, memory_curves(tl, prog, memory).device):
        assert t.tolist() == t0.tolist() and v.tolist() == pytest.approx(v0.tolist())


def test_torch_export_refuses_memops_unless_dropped():
    s = _sched()
    s2 = _with(s, [], [MemOp("RECOMPUTE", 0, 1, _at(s, 1, "B", 0, 1))])
    prog = lower(s2)
    for program in (None, prog):
        with pytest.raises(PipecError) as e:
            export_csv(s2, program)
        assert e.value.code == "E614" and "`RECOMPUTE 0 1` on rank 1" in str(e.value)
        assert export_csv(s2, program, drop_memops=True) == export_csv(s, None if program is None else lower(s))
