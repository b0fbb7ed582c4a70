"""Deadlock and memory checks, lowering, the rendezvous dry run and the program formats."""

from __future__ import annotations

import re

import networkx as nx
import pytest
from cli_helpers import run_cli
from deadlocks import DEADLOCK_1F1B
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo import ROOT
from strategies import RandomSchedule, deps, random_schedules

from pipec.api import load
from pipec.driver import build
from pipec.errors import PipecError, Source
from pipec.formats.program_file import from_json, from_text, to_json, to_text
from pipec.frontend import library
from pipec.ir.program import COMPUTE, OPCODES, RECVS, SENDS
from pipec.passes.compiler import compile_schedule
from pipec.passes.dryrun import dry_run
from pipec.passes.lower import forward_program, lower
from pipec.sim.memory import rank_memory


def test_hand_written_deadlock_is_explained_as_a_chain_of_waits():
    sched = build(Source("dl.pipe", DEADLOCK_1F1B), {})
    with pytest.raises(PipecError) as info:
        compile_schedule(sched)
    err = info.value
    assert err.code == "E401"
    assert (err.span.line, err.span.col) == (7, 19)  # B(0) on rank 0
    notes = err.diagnostics[0].notes
    assert "rank 0 waits at `B(0, stage 0)` (line 7) for the gradient of `B(0, stage 1)` from rank 1" in notes[0]
    assert "rank 1 only reaches `B(0, stage 1)` after `F(1, stage 1)` (line 9)" in notes[0]
    assert "rank 1 waits at `F(1, stage 1)` (line 9) for the activation of `F(1, stage 0)` from rank 0" in notes[1]
    assert "rank 0 only reaches `F(1, stage 0)` after `B(0, stage 0)` (line 7)" in notes[1]
    assert "ranks 0 -> 1 -> 0" in err.diagnostics[0].message


def _grid(name: str):
    """A thinned parameter grid: p 1..8, m over 1..4p, v 1..3 where the schedule has v."""
    src = library.read(name)
    has_v = "v:" in src.text.split("{", 1)[0] or "(v" in src.text or " v =" in src.text.split("{", 1)[0]
    for p in range(1, 9):
        for m in sorted({1, 2, p, 2 * p, 4 * p} | ({2 * p - 1} if p > 1 else set())):
            for v in (1, 2, 3) if has_v else (None,):
                params = {"p": p, "m": m} | ({"v": v} if v else {})
                try:
                    yield params, build(src, params)
                except PipecError as e:
                    assert e.code == "E202", e  # only the schedule's own `require`s may reject a grid point


@pytest.mark.parametrize("name", library.names())
def test_library_compiles_and_dry_run_completes_over_grid(name):
    count = 0
    for params, sched in _grid(name):
        prog = compile_schedule(sched).program
        assert dry_run(prog).completed, params
        count += 1
    assert count > 0


def _reference_peaks(sched):
    """Independent walk of each rank's ops and memory ops (the memory model of docs/memory.md, default
    sizes: a recomputed F keeps ckpt = act / 8, its RECOMPUTE restores act; OFFLOAD/RELOAD move what F kept)."""
    act = sched.num_ranks / sched.num_stages
    wact, ckpt = act / 2, act / 8
    sl = sched.slicing  # token slices or lengths: a unit holds its tokens' share of a sequence's
    share = [t / sl.seqlen for t in sl.unit_tokens().tolist()] if sl else None
    peaks = []
    for r in range(sched.num_ranks):
        mem = sched.memops[r] if r < len(sched.memops) else ()
        redo = {(m.mb, m.stage) for m in mem if m.op == "RECOMPUTE"}
        steps = sorted(
            [(2 * j + 1, op.kind, op.mb, op.stage) for j, op in enumerate(sched.ops(r))]
            + [(2 * m.before, m.op, m.mb, m.stage) for m in mem],
            key=lambda x: x[0],
        )
        live, peak = 0.0, 0.0
        for _, kind, i, s in steps:
            w = share[i] if share else 1.0
            kept = (ckpt if (i, s) in redo else act) * w
            if kind == "F":
                live += kept
            elif kind == "B":
                live += ((wact if sched.split_backward else 0.0) - act) * w
            elif kind == "W":
                live -= wact * w
            elif kind == "RECOMPUTE":
                live += act - ckpt
            else:
                live += kept if kind == "RELOAD" else -kept
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("name", library.names())
def test_memory_matches_reference_walk(name):
    for _params, sched in list(_grid(name))[::3]:
        assert [m.peak for m in rank_memory(sched)] == pytest.approx(_reference_peaks(sched))


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 5), (4, 8), (4, 2), (8, 32)])
def test_memory_closed_forms(p, m):
    one = rank_memory(load("1f1b", p=p, m=m))
    assert [x.peak for x in one] == [min(p - r, m) for r in range(p)]
    gp = rank_memory(load("gpipe", p=p, m=m))
    assert [x.peak for x in gp] == [m] * p
    assert one[0].live_act == tuple((i, 0) for i in range(min(p, m)))


def test_memory_limit_names_rank_op_peak_and_limit():
    sched = load("1f1b", p=4, m=8)
    with pytest.raises(PipecError) as info:
        compile_schedule(sched, {"limit": 3})
    d = info.value.diagnostics[0]
    assert d.code == "E402"
    assert d.message == "rank 0 needs 4 memory at `F(3, stage 0)`, above its limit 3"
    assert "0@0, 1@0, 2@0, 3@0" in d.notes[0]
    compile_schedule(sched, {"limit": 4})  # exactly at the limit is fine


def test_declared_memory_limit_and_params():
    text = library.read("1f1b").text.replace("ops F, B", "ops F, B\n    memory params = 2\n    memory limit = 5")
    with pytest.raises(PipecError) as info:
        compile_schedule(build(Source("t.pipe", text), {"p": 4, "m": 8}))
    assert info.value.code == "E402"
    assert "rank 0 needs 6 memory" in info.value.diagnostics[0].message


def _oracle_has_cycle(rs: RandomSchedule, orders) -> bool:
    g = nx.DiGraph()
    S = len(rs.placement)
    for order in orders:
        g.add_nodes_from(order)
        g.add_edges_from(zip(order, order[1:]))
        for op in order:
            g.add_edges_from((d, op) for d in deps(*op, S, rs.split))
    return not nx.is_directed_acyclic_graph(g)


SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SLOW
@given(random_schedules())
def test_random_valid_schedules_compile_and_dry_run(rs):
    sched = build(Source("random.pipe", rs.text()), {})
    prog = compile_schedule(sched).program
    assert dry_run(prog).completed
    # Every compute op appears once; every send has exactly one matching receive on its peer.
    sends, recvs = set(), set()
    for r, rp in enumerate(prog.ranks):
        for ins in rp.instructions():
            code = OPCODES.index(ins.op)
            if code in SENDS:
                sends.add((ins.op[5:], ins.mb, ins.stage, r, ins.peer))
            elif code in RECVS:
                sender = ins.stage - 1 if ins.op == "RECV_ACT" else ins.stage + 1
                recvs.add((ins.op[5:], ins.mb, sender, ins.peer, r))
    assert sends == recvs
    assert sum(int((rp.op < len(COMPUTE)).sum()) for rp in prog.ranks) == sched.num_ops


@SLOW
@given(random_schedules(), st.data())
def test_swaps_that_make_a_cycle_are_reported_with_real_waits(rs, data):
    ranks = [r for r, o in enumerate(rs.orders) if len(o) >= 2]
    if not ranks:
        return
    r = data.draw(st.sampled_from(ranks))
    a = data.draw(st.integers(0, len(rs.orders[r]) - 2))
    b = data.draw(st.integers(a + 1, len(rs.orders[r]) - 1))
    order = list(rs.orders[r])
    order[a], order[b] = order[b], order[a]
    orders = tuple(tuple(order) if i == r else o for i, o in enumerate(rs.orders))
    mutated = RandomSchedule(rs.p, rs.m, rs.placement, rs.split, orders)
    cyclic = _oracle_has_cycle(mutated, orders)
    try:
        sched = build(Source("mutated.pipe", mutated.text()), {})
        compile_schedule(sched)
    except PipecError as e:
        assert cyclic, e
        assert e.code in ("E304", "E401")  # same-rank order, or a cycle across ranks
        if e.code == "E401":
            notes = e.diagnostics[0].notes
            assert len(notes) >= 2
            S = len(rs.placement)
            from pipec.passes.deadlock import find_deadlock

            for w in find_deadlock(sched):
                needed = (w.needs.kind, w.needs.mb, w.needs.stage)
                assert needed in deps(w.op.kind, w.op.mb, w.op.stage, S, rs.split)  # a true dependency
                assert rs.placement[w.needs.stage] == w.peer != w.rank
                peer_order = [x for x in orders[w.peer]]
                stuck = (w.peer_op.kind, w.peer_op.mb, w.peer_op.stage)
                assert peer_order.index(stuck) <= peer_order.index(needed)  # the peer has not reached it
        return
    assert not cyclic


@settings(max_examples=40, deadline=None)
@given(random_schedules())
def test_program_formats_round_trip(rs):
    prog = lower(build(Source("random.pipe", rs.text()), {}))
    assert from_text(to_text(prog)) == prog
    assert from_json(to_json(prog)) == prog
    assert to_text(from_text(to_text(prog))) == to_text(prog)


@pytest.mark.parametrize("name", library.names())
def test_library_program_round_trip(name):
    prog = lower(load(name))
    assert from_text(to_text(prog)) == prog
    assert from_json(to_json(prog)) == prog


def test_a_forward_only_program_round_trips_as_forward_only():
    """An evaluation pass written to a file reads back as one (`forward_only`), in both forms; a file
    without the header is a training Program, and a malformed value is E501."""
    prog = forward_program(lower(load("1f1b", p=2, m=3)))
    assert prog.forward_only
    for back in (from_text(to_text(prog)), from_json(to_json(prog))):
        assert back == prog and back.forward_only
    assert "forward_only true\n" in to_text(prog) and "forward_only" not in to_text(lower(load("1f1b", p=2, m=3)))
    with pytest.raises(PipecError) as info:
        from_text(to_text(prog).replace("forward_only true", "forward_only yes"), "x.prog")
    assert info.value.code == "E501" and "forward_only" in str(info.value)


def test_adjacent_send_and_receive_with_one_peer_are_batched():
    prog = lower(load("1f1b", p=2, m=3))
    text = to_text(prog)
    assert "SEND_ACT 1 0 1 &\nRECV_GRAD 0 0 1\n" in text
    assert "SEND_ACT 2 0 1 &\nRECV_GRAD 1 0 1\n" in text


def test_local_hand_off_has_no_wire_instructions():
    text = """schedule "two-on-one" (p: int = 1, m: int = 2) {
        stages 2
        place s -> 0
        rank r { F(0, stage: 0) F(0, stage: 1) B(0, stage: 1) B(0, stage: 0)
                 F(1, stage: 0) F(1, stage: 1) B(1, stage: 1) B(1, stage: 0) }
    }"""
    prog = lower(build(Source("t.pipe", text), {}))
    assert [i.op for i in prog.ranks[0].instructions()] == ["FWD", "FWD", "BWD", "BWD"] * 2 + [
        "REDUCE_GRAD",
        "REDUCE_GRAD",
        "STEP",
        "STEP",
    ]


def test_malformed_program_text_is_a_diagnostic():
    text = to_text(lower(load("1f1b", p=2, m=2))).replace("FWD 1 0", "FWD 1")
    with pytest.raises(PipecError) as info:
        from_text(text, "x.prog")
    assert info.value.code == "E501"
    assert info.value.span.line == text.splitlines().index("FWD 1") + 1


def _e4xx_sections() -> dict[str, str]:
    text = (ROOT / "docs" / "errors.md").read_text()
    part = text.split("## Checks on the compiled program (E4xx)")[1]
    pieces = re.split(r"^### (E\d{3})\b[^\n]*\n", part, flags=re.M)
    return {pieces[i]: pieces[i + 1] for i in range(1, len(pieces), 2)}


@pytest.mark.parametrize("code", ["E401", "E402"])
def test_errors_doc_examples_print_what_they_show(code, tmp_path, monkeypatch):
    body = _e4xx_sections()[code]
    pipe = re.search(r"```pipe\n(.*?)```", body, flags=re.S).group(1)
    shown = re.search(r"```console\n\$ pipec check t\.pipe\n(.*?)```", body, flags=re.S).group(1)
    (tmp_path / "t.pipe").write_text(pipe)
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli("check", "t.pipe")
    assert rc == 1 and err == shown


@pytest.mark.parametrize("code", ["E403", "E404"])
def test_errors_doc_python_examples_run(code, capsys):
    body = _e4xx_sections()[code]
    program = re.search(r"```python\n(.*?)```", body, flags=re.S).group(1)
    expected = [line[2:] for line in program.splitlines() if line.startswith("# ")]
    if code == "E404":
        with pytest.raises(PipecError) as info:
            exec(program, {})
        assert info.value.code == "E404"
        assert info.value.diagnostics[0].format().splitlines() == ["pipec: " + expected[0]] + expected[1:]
    else:
        exec(program, {})
        assert capsys.readouterr().out.splitlines() == expected
