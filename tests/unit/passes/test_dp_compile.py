"""PP x DP in the compiler: the options, the lowering's placement of REDUCE_GRAD / UNSHARD / RESHARD, the
validator's rules for them, the fsdp memory model, both Program formats, the torch CSV and the CLI flags.

Every expectation is computed independently of the code under test: by walking instructions here, by
the independent oracle (`pipec.testing.program_problem`), or by hand in a comment.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from cli_helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipec
from pipec.driver import param_names
from pipec.errors import PipecError, Source, Span
from pipec.formats.program_file import from_json, from_text, to_json, to_text
from pipec.formats.torch_csv_reader import read_csv
from pipec.formats.torch_csv_writer import export_csv
from pipec.frontend import library
from pipec.ir.dataparallel import DataParallel
from pipec.ir.program import Instr, Program, RankProgram
from pipec.ir.schedule import Collective
from pipec.ir.validate import validate
from pipec.passes.compiler import compile_schedule
from pipec.passes.dryrun import dry_run
from pipec.passes.lower import lower
from pipec.testing import check_invariants, program_problem, schedules

COMPUTES = ("FWD", "BWD", "WGRAD")


def lib(name: str, **params):
    """A library schedule at small sizes (p = 4, m = 8; v = 2 where it takes one)."""
    return pipec.load(name, **({"p": 4, "m": 8} | params))


def ins(prog: Program, r: int) -> list[Instr]:
    return prog.ranks[r].instructions()


def with_ranks(prog: Program, ranks: list[list[Instr]], **changes) -> Program:
    return dataclasses.replace(prog, ranks=tuple(RankProgram.from_instructions(x) for x in ranks), **changes)


def open_windows(instrs: list[Instr]) -> list[set[int]]:
    """The stages gathered after each instruction, by walking UNSHARD/RESHARD."""
    held: set[int] = set()
    out = []
    for x in instrs:
        if x.op == "UNSHARD":
            held = held | {x.stage}
        elif x.op == "RESHARD":
            held = held - {x.stage}
        out.append(held)
    return out


# ---- options ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, what",
    [
        ({"size": 0}, "size"),
        ({"size": 10**400}, "size"),
        ({"size": True}, "size"),
        ({"kind": "zero"}, "kind"),
        ({"prefetch": -1}, "prefetch"),
        ({"kind": "fsdp", "max_gathered": 0}, "max_gathered"),
    ],
)
def test_bad_options_are_E421(kwargs, what):
    with pytest.raises(PipecError) as e:
        DataParallel(**kwargs)
    assert e.value.code == "E421" and what in e.value.diagnostics[0].message


def test_public_api_takes_data_parallel_and_imports_no_torch():
    import sys

    prog = pipec.compile("1f1b", p=2, m=2, data_parallel=pipec.DataParallel(size=2, kind="fsdp", prefetch=1))
    assert (prog.dp, prog.dp_kind) == (2, "fsdp")
    assert "torch" not in sys.modules or "pipec" not in sys.modules["torch"].__name__  # pipec never imports torch
    assert pipec.check("1f1b", p=2, m=2, data_parallel=DataParallel(4)).program.dp == 4
    assert pipec.simulate("1f1b", p=2, m=2, data_parallel=DataParallel(2, "fsdp")).compiled.program.dp_kind == "fsdp"


def test_a_pair_needs_room_for_both_its_stages():
    """DualPipe-V overlaps two stages of one rank in a pair: --max-gathered 1 cannot hold them (E421)."""
    with pytest.raises(PipecError) as e:
        lower(lib("dualpipe-v"), DataParallel(2, "fsdp", max_gathered=1))
    assert e.value.code == "E421" and "overlapped pair" in e.value.diagnostics[0].message
    lower(lib("dualpipe-v"), DataParallel(2, "fsdp", max_gathered=2))  # two fit


# ---- default placement ------------------------------------------------------------------------------


def test_no_data_parallelism_is_the_program_of_before():
    """size 1, ddp: REDUCE_GRADs then STEPs close each stream, no dp header, identical text and JSON."""
    s = lib("interleaved-1f1b", v=2)
    a, b = lower(s), lower(s, DataParallel())
    assert to_text(a) == to_text(b) and to_json(a) == to_json(b)
    assert "\ndp" not in to_text(a) and '"dp' not in to_json(a)
    for r in range(s.num_ranks):
        own = len(s.stages_of(r))
        tail = [x.op for x in ins(a, r)[-2 * own :]]
        assert tail == ["REDUCE_GRAD"] * own + ["STEP"] * own


def _check_reduce_right_after_last_compute(prog: Program, sched) -> None:
    for r in range(prog.num_ranks):
        xs = ins(prog, r)
        placed = {c.stage for c in sched.collectives[r] if c.op == "REDUCE_GRAD"} if sched.collectives else set()
        for s in (s for s, q in enumerate(prog.placement) if q == r and s not in placed):
            last = max(j for j, x in enumerate(xs) if x.op in COMPUTES and x.stage == s)
            at = next(j for j, x in enumerate(xs) if x.op == "REDUCE_GRAD" and x.stage == s)
            assert at > last, (r, s)
            # Between them only that compute's sends (the last maybe batched with a receive) and other
            # stages' reductions at the same point: nothing waits, nothing is received for later.
            p2p = [(j, x) for j, x in enumerate(xs[last + 1 : at], last + 1) if x.op != "REDUCE_GRAD"]
            for n, (j, x) in enumerate(p2p):
                batched_recv = x.op.startswith("RECV") and n == len(p2p) - 1 and xs[j - 1].group
                assert x.op.startswith("SEND") or batched_recv, (r, s, str(x))
        steps = [x for x in xs if x.op == "STEP"]
        assert [x.op for x in xs[-len(steps) :]] == ["STEP"] * len(steps)  # the STEPs close the stream


@pytest.mark.parametrize("name", library.names())
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("size", [2, 4])
def test_default_placement_every_library_schedule(name, kind, size):
    params = {"v": 2} if "v" in param_names(library.read(name)) else {}
    s = lib(name, **params)
    compiled = compile_schedule(s, None, DataParallel(size, kind))
    prog = compiled.program
    assert (prog.dp, prog.dp_kind) == (size, kind)
    validate(prog)
    assert dry_run(prog).completed
    assert program_problem(prog, s) is None  # the independent oracle, data-parallel rules included
    _check_reduce_right_after_last_compute(prog, s)
    for r in range(prog.num_ranks):
        xs = ins(prog, r)
        windows = [x for x in xs if x.op in ("UNSHARD", "RESHARD")]
        if kind == "ddp":
            assert not windows
            continue
        own = [q for q, owner in enumerate(prog.placement) if owner == r]
        if s.collectives:  # the schedule's own windows (zeropp): program_problem above proved them
            continue
        # No bound: each stage gathered once, RESHARD right after its REDUCE_GRAD.
        assert sorted(x.stage for x in windows if x.op == "UNSHARD") == own
        for q in own:
            red = next(j for j, x in enumerate(xs) if x.op == "REDUCE_GRAD" and x.stage == q)
            assert xs[red + 1 : red + 3] and any(x.op == "RESHARD" and x.stage == q for x in xs[red + 1 : red + 3])


def test_reduce_grad_moves_up_for_a_stage_that_finishes_early():
    """Interleaved 1F1B, p = 4: rank 0's stage 4 ends its backwards before stage 0 does, so its REDUCE_GRAD
    is issued mid-stream, overlapping stage 0's last backwards."""
    prog = lower(lib("interleaved-1f1b", v=2), DataParallel(2))
    xs = ins(prog, 0)
    red2 = next(j for j, x in enumerate(xs) if x.op == "REDUCE_GRAD" and x.stage == 4)
    assert any(x.op == "BWD" and x.stage == 0 for x in xs[red2:])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    listing=schedules(max_ranks=3, max_stages=6, max_mb=3),
    prefetch=st.integers(0, 3),
    bound=st.one_of(st.none(), st.integers(1, 4)),
    size=st.sampled_from([1, 2, 3]),
)
def test_windows_cover_every_compute_and_respect_the_bound(listing, prefetch, bound, size):
    s = listing.build()
    dp = DataParallel(size, "fsdp", prefetch=prefetch, max_gathered=bound)
    try:
        prog = lower(s, dp)
    except PipecError as e:  # only when a pair needs more stages than the bound holds
        assert e.code == "E421" and bound == 1
        return
    assert program_problem(prog, s) is None
    for r in range(prog.num_ranks):
        xs = ins(prog, r)
        held = open_windows(xs)
        for j, x in enumerate(xs):
            if x.op in COMPUTES:
                assert x.stage in held[j], (r, j, str(x))
            if bound is not None:
                assert len(held[j]) <= bound, (r, j, held[j])
        if bound is None or bound >= len(s.stages_of(r)):
            # Unbounded: one window per stage, opened `prefetch` steps before its first compute or earlier.
            firsts = {}
            step = 0
            for x in xs:
                if x.op in COMPUTES:
                    firsts.setdefault(x.stage, step)
                    step += not x.group
            for q, first in firsts.items():
                u = next(j for j, x in enumerate(xs) if x.op == "UNSHARD" and x.stage == q)
                done = sum(1 for x in xs[:u] if x.op in COMPUTES and not x.group)
                assert done == max(first - prefetch, 0), (r, q, done, first)
                if first - prefetch < 0:
                    assert all(x.op in ("UNSHARD",) for x in xs[:u]), "before the stream's first instruction"


def _belady_misses(stream: list[int], k: int) -> list[int]:
    """The stages gathered, in order, by the textbook rule: on a miss with k held, drop the one whose next
    use is furthest ahead (never again counts as furthest)."""
    held: set[int] = set()
    misses = []
    for n, q in enumerate(stream):
        if q in held:
            continue
        if len(held) == k:
            ahead = {x: next((j for j in range(n, len(stream)) if stream[j] == x), len(stream)) for x in held}
            held.remove(max(held, key=ahead.__getitem__))
        held.add(q)
        misses.append(q)
    return misses


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("name, params", [("interleaved-1f1b", {"p": 2, "m": 4, "v": 3}), ("zb-v", {"p": 2, "m": 5})])
def test_windows_follow_belady(name, params, k):
    """max_gathered k of a rank's stages: its UNSHARDs are exactly the misses of Belady's rule over its
    compute stream (prefetch 0, so they come in miss order)."""
    prog = lower(pipec.load(name, **params), DataParallel(2, "fsdp", prefetch=0, max_gathered=k))
    for r in range(prog.num_ranks):
        xs = ins(prog, r)
        stream = [x.stage for x in xs if x.op in COMPUTES]
        assert [x.stage for x in xs if x.op == "UNSHARD"] == _belady_misses(stream, k)
        assert max(len(h) for h in open_windows(xs)) <= k


# ---- schedule-placed collectives ------------------------------------------------------------------


def test_schedule_placed_collectives_are_honoured():
    """A ZeroPP-style placement: rank 0 gathers stage 0 before op 0, frees it after op 1 and gathers it
    again before op 2; the defaults fill in REDUCE_GRAD for it and the whole of rank 1."""
    s = pipec.load("1f1b", p=2, m=2)  # rank 0: F0 F1 B0 B1
    span = Span(1, 1, 1, 2)
    mine = (Collective("UNSHARD", 0, 0, span), Collective("RESHARD", 0, 2, span), Collective("UNSHARD", 0, 2, span))
    mine += (Collective("RESHARD", 0, 4, span),)
    prog = lower(dataclasses.replace(s, collectives=(mine, ())), DataParallel(2, "fsdp"))
    ops0 = [str(x) for x in ins(prog, 0) if x.op not in ("SEND_ACT", "RECV_GRAD")]
    want = "UNSHARD 0|FWD 0 0|FWD 1 0|RESHARD 0|UNSHARD 0|BWD 0 0|BWD 1 0|RESHARD 0|REDUCE_GRAD 0|STEP 0"
    assert ops0 == want.split("|")
    assert [x.op for x in ins(prog, 1)].count("UNSHARD") == 1  # rank 1: the default window
    assert program_problem(prog) is None
    # Under ddp the windows go (replicated parameters), REDUCE_GRAD stays where the schedule put it.
    red = (Collective("REDUCE_GRAD", 0, 4, span),)
    prog = lower(dataclasses.replace(s, collectives=(mine + red, ())), DataParallel(2, "ddp"))
    assert not any(x.op in ("UNSHARD", "RESHARD") for x in ins(prog, 0))


def test_a_misplaced_collective_is_E423_at_its_span():
    s = pipec.load("1f1b", p=2, m=2)
    span = Span(7, 3, 7, 12)
    bad = (Collective("UNSHARD", 0, 1, span), Collective("RESHARD", 0, 4, span))  # F0 outside the window
    with pytest.raises(PipecError) as e:
        lower(dataclasses.replace(s, collectives=(bad, ())), DataParallel(2, "fsdp"))
    d = e.value.diagnostics[0]
    assert e.value.code == "E423" and d.span == span and "rank 0" in d.message and "FWD 0 0" in d.message
    early = (Collective("REDUCE_GRAD", 0, 1, span),)  # before stage 0's last backward
    with pytest.raises(PipecError) as e:
        lower(dataclasses.replace(s, collectives=(early, ())), DataParallel(2))
    assert e.value.code == "E423" and "REDUCE_GRAD 0" in e.value.diagnostics[0].message
    with pytest.raises(PipecError) as e:
        lower(dataclasses.replace(s, collectives=((Collective("UNSHARD", 0, 9, span),), ())), DataParallel(2, "fsdp"))
    assert e.value.code == "E423" and "outside 0 .. 4" in e.value.diagnostics[0].message


# ---- validate -----------------------------------------------------------------------------------------


def _fsdp():
    return lower(pipec.load("1f1b", p=2, m=2), DataParallel(2, "fsdp"))


def _broken(prog: Program, r: int, edit) -> Program:
    ranks = [ins(prog, q) for q in range(prog.num_ranks)]
    ranks[r] = edit(ranks[r])
    return with_ranks(prog, ranks)


def _index(xs: list[Instr], text: str) -> int:
    return [str(x) for x in xs].index(text)


def _drop(text: str):
    return lambda xs: [x for x in xs if str(x) != text]


def _e502(prog: Program, *words: str) -> str:
    with pytest.raises(PipecError) as e:
        validate(prog)
    msg = e.value.diagnostics[0].message + " ".join(e.value.diagnostics[0].notes)
    assert e.value.code == "E502", msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_validate_ddp_has_no_windows():
    prog = lower(pipec.load("1f1b", p=2, m=2), DataParallel(2))
    bad = _broken(prog, 1, lambda xs: [Instr("UNSHARD", -1, 1), *xs[:-1], Instr("RESHARD", -1, 1), xs[-1]])
    _e502(bad, "rank 1, instruction #0 `UNSHARD 1`", "fsdp")


def test_validate_fsdp_window_rules():
    prog = _fsdp()
    validate(prog)
    # A compute outside the windows: rank 0's UNSHARD dropped (and with it its only window).
    msg = _e502(_broken(prog, 0, _drop("UNSHARD 0")), "rank 0")
    assert "not gathered" in msg and "no UNSHARD .. RESHARD window" in msg
    # rank 0 is UNSHARD 0, FWD 0 0, SEND_ACT 0 0 1, FWD 1 0, ...: close the window before FWD 0 0, reopen after.
    gap = _broken(prog, 0, lambda xs: [xs[0], Instr("RESHARD", -1, 0), *xs[1:3], Instr("UNSHARD", -1, 0), *xs[3:]])
    _e502(gap, "rank 0, instruction #2 `FWD 0 0`: computes on stage 0 outside its UNSHARD .. RESHARD windows")
    # Gathered twice.
    _e502(_broken(prog, 1, lambda xs: [xs[0], *xs]), "rank 1, instruction #1 `UNSHARD 1`", "gathered already")
    # Never resharded.
    _e502(_broken(prog, 1, _drop("RESHARD 1")), "rank 1, instruction #0 `UNSHARD 1`", "never resharded")

    # STEP before the last RESHARD.
    def swap(xs):
        j = _index(xs, "RESHARD 0")
        return [*xs[:j], xs[j + 1], xs[j]]

    _e502(_broken(prog, 0, swap), "`STEP 0`", "before its last RESHARD")


def test_validate_reduce_grad_once_after_last_compute_before_step():
    prog = lower(pipec.load("1f1b", p=2, m=2), DataParallel(2))

    def early(xs):
        j = _index(xs, "REDUCE_GRAD 0")
        return [xs[j], *xs[:j], *xs[j + 1 :]]

    _e502(_broken(prog, 0, early), "rank 0, instruction #0 `REDUCE_GRAD 0`", "last compute")
    _e502(_broken(prog, 0, _drop("REDUCE_GRAD 0")), "rank 0", "0 REDUCE_GRAD")


@pytest.mark.parametrize("change, words", [({"dp": 0}, "positive integer"), ({"dp_kind": "zero"}, "kind")])
def test_validate_header(change, words):
    _e502(dataclasses.replace(_fsdp(), **change), words)


# ---- memory -----------------------------------------------------------------------------------------


def test_fsdp_memory_by_hand():
    """interleaved-1f1b p=2 v=2 m=2, params 4 per stage, act p/S = 0.5 per forward. Rank 0 runs stages 0 and 2:
    F0.0 F1.0 F0.2 F1.2 B0.2 B1.2 B0.0 B1.0, four forwards live after F1.2 (2.0 of activations).
      ddp: params 4 + 4 = 8 whole, peak 8 + 2 = 10.
      fsdp N=2, no bound: shards 8 / 2 = 4, both stages gathered (+2 each): 4 + 4 + 2 = 10.
      fsdp N=2, max_gathered 1: shards 4, only stage 2 gathered at F1.2 (+2): 4 + 2 + 2 = 8."""
    s = pipec.load("interleaved-1f1b", p=2, m=2, v=2)
    mem = {"params": 4}
    ddp = compile_schedule(s, mem, DataParallel(2)).memory[0]
    full = compile_schedule(s, mem, DataParallel(2, "fsdp")).memory[0]
    one = compile_schedule(s, mem, DataParallel(2, "fsdp", max_gathered=1)).memory[0]
    assert (ddp.peak, ddp.params) == (10.0, 8.0)
    assert (full.peak, full.params, full.gathered) == (10.0, 4.0, (0, 2))
    assert (one.peak, one.params, one.gathered, str(one.peak_op)) == (8.0, 4.0, (2,), "F(1, stage 2)")
    with pytest.raises(PipecError) as e:
        compile_schedule(s, mem | {"limit": 7.5}, DataParallel(2, "fsdp", max_gathered=1))
    d = e.value.diagnostics[0]
    assert e.value.code == "E402" and d.message == "rank 0 needs 8 memory at `F(1, stage 2)`, above its limit 7.5"
    assert any("stages 2 gathered" in n for n in d.notes)
    # The independent oracle recomputes the fsdp peaks from the windows.
    check_invariants(s, mem, data_parallel=DataParallel(2, "fsdp", max_gathered=1), expectations=False)


def test_fsdp_memory_of_a_program_file(tmp_path):
    s = pipec.load("interleaved-1f1b", p=2, m=2, v=2)
    prog = compile_schedule(s, None, DataParallel(2, "fsdp", max_gathered=1)).program
    path = tmp_path / "p.txt"
    path.write_text(to_text(prog))
    c = pipec.check(str(path), memory={"params": 4})
    assert c.memory[0].peak == 8.0
    with pytest.raises(PipecError) as e:
        pipec.check(str(path), data_parallel=DataParallel(4, "fsdp"))
    assert e.value.code == "E422" and "2 x fsdp" in e.value.diagnostics[0].message


# ---- formats ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["zb-v", "interleaved-1f1b", "dualpipe-v"])
@pytest.mark.parametrize(
    "dp", [DataParallel(2, "fsdp"), DataParallel(4, "fsdp", 2, 2), DataParallel(3), DataParallel(1, "fsdp")]
)
def test_round_trip(name, dp):
    params = {"v": 2} if name == "interleaved-1f1b" else {}
    prog = lower(lib(name, **params), dp)
    text, doc = to_text(prog), to_json(prog)
    assert from_text(text) == prog and from_json(doc) == prog
    assert (f"\ndp {dp.size}\n" in text) == (dp.size != 1) and ("dp_kind fsdp" in text) == (dp.kind == "fsdp")
    head = json.loads(doc)
    assert head.get("dp", 1) == dp.size and head.get("dp_kind", "ddp") == dp.kind


def test_readers_refuse_bad_dp_headers():
    text = to_text(_fsdp())
    for bad, code in (("dp 2\n", "dp two\n"), ("dp_kind fsdp\n", "dp_kind zero\n")):
        with pytest.raises(PipecError) as e:
            from_text(text.replace(bad, code))
        assert e.value.code in ("E501", "E502")
    doc = json.loads(to_json(_fsdp()))
    for dp in ("2", 10**400, True):
        with pytest.raises(PipecError) as e:
            from_json(json.dumps(doc | {"dp": dp}))
        assert e.value.code == "E502" and "data-parallel size" in e.value.diagnostics[0].message


# ---- torch CSV ---------------------------------------------------------------------------------------


def test_torch_csv_keeps_the_programs_windows():
    s = pipec.load("interleaved-1f1b", p=2, m=4, v=2)
    prog = compile_schedule(s, None, DataParallel(2, "fsdp", max_gathered=1)).program
    text = export_csv(s, prog)
    row0 = text.splitlines()[0].split(",")
    want = [f"{x.stage}{x.op}" for x in ins(prog, 0) if x.op in ("UNSHARD", "RESHARD")]
    assert [c for c in row0 if c.endswith(("UNSHARD", "RESHARD"))] == want
    back = read_csv(Source("t.csv", text))
    assert [f"{c.stage}{c.op}" for c in back.collectives[0] if c.op != "REDUCE_GRAD"] == want
    again = compile_schedule(back, None, DataParallel(2, "fsdp")).program  # the file's windows, as placed
    assert [f"{x.stage}{x.op}" for x in ins(again, 0) if x.op in ("UNSHARD", "RESHARD")] == want
    # A ddp Program keeps the export of before: each stage gathered before its first use, freed at the end.
    ddp = export_csv(s, compile_schedule(s).program).splitlines()[0].split(",")
    assert [c for c in ddp if c.endswith(("UNSHARD", "RESHARD"))] == ["0UNSHARD", "2UNSHARD", "2RESHARD", "0RESHARD"]


# ---- command line -----------------------------------------------------------------------------------


def test_cli_check_with_dp():
    rc, out, _ = run_cli(
        "check", "zb-h1", "-D", "p=4", "-D", "m=8", "--dp", "2", "--dp-kind", "fsdp", "--mem", "params=4", "--memory"
    )
    assert rc == 0 and "data parallelism 2 x fsdp: OK" in out and "gathered" in out.splitlines()[1]
    rc, out, _ = run_cli("check", "zb-h1", "-D", "p=4", "-D", "m=8", "--dp", "2", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["data_parallel"] == {"size": 2, "kind": "ddp"}
    rc, out, _ = run_cli("check", "zb-h1", "-D", "p=4", "-D", "m=8", "--json")
    assert "data_parallel" not in json.loads(out)
    rc, _, err = run_cli("check", "1f1b", "--dp", "0")
    assert rc == 1 and "E421" in err


def test_cli_compile_show_simulate_with_dp(tmp_path):
    rc, out, _ = run_cli(
        "compile", "1f1b", "-D", "p=2", "-D", "m=2", "--dp", "2", "--dp-kind", "fsdp", "--prefetch", "0"
    )
    assert rc == 0 and "dp 2\ndp_kind fsdp\n" in out and "UNSHARD 0\nFWD 0 0" in out
    path = tmp_path / "p.json"
    rc, out, _ = run_cli("compile", "1f1b", "-D", "p=2", "-D", "m=2", "--dp", "2", "--dp-kind", "fsdp", "-o", str(path))
    assert rc == 0 and pipec.read_program(path).dp_kind == "fsdp"
    rc, _, err = run_cli("check", str(path), "--dp", "4")
    assert rc == 1 and "E422" in err
    rc, out, _ = run_cli("check", str(path))
    assert rc == 0 and "2 x fsdp" in out
    rc, out, _ = run_cli(
        "show",
        "interleaved-1f1b",
        "-D",
        "p=2",
        "-D",
        "m=4",
        "-D",
        "v=2",
        "--dp",
        "2",
        "--dp-kind",
        "fsdp",
        "--max-gathered",
        "1",
    )
    assert rc == 0 and "data parallelism 2 x fsdp" in out
    rank0 = next(line for line in out.splitlines() if line.startswith("Rank 0:"))
    assert rank0.startswith("Rank 0: UNSHARD 0 @00, RESHARD 0 @02, UNSHARD 2 @02") and rank0.endswith("RESHARD 0 @end")
    rc, out, _ = run_cli("show", "1f1b", "-D", "p=2", "-D", "m=2", "--dp", "2", "--json")
    doc = json.loads(out)
    assert {"rank": 0, "op": "REDUCE_GRAD", "stage": 0, "before": 4} in doc["collectives"]
    rc, out, _ = run_cli("show", str(path))  # a Program file with data parallelism shows its collectives
    assert rc == 0 and "Rank 1: UNSHARD 1 @00, REDUCE_GRAD 1 @end, RESHARD 1 @end" in out
    rc, out, _ = run_cli("simulate", "1f1b", "-D", "p=2", "-D", "m=4", "--dp", "2", "--dp-kind", "fsdp", "--json")
    assert rc == 0 and json.loads(out)["results"][0]["makespan"] > 0
    rc, out, _ = run_cli("show", "1f1b", "-D", "p=2", "-D", "m=2", "--dp", "2", "--timeline", "--width", "60")
    assert rc == 0 and "rank 0" in out


def test_every_library_schedule_at_dp_runs_through_the_simulator():
    for name in ("1f1b", "zb-v"):
        sim = pipec.simulate(name, p=4, m=8, data_parallel=DataParallel(2, "fsdp", max_gathered=1))
        assert np.isfinite(sim.stats.makespan) and sim.compiled.program.dp == 2


@pytest.mark.parametrize("cls_name", ["ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS"])
def test_torchs_own_fsdp_windows_compile_as_they_are(cls_name):
    """torch's compute+comms order (its `_add_unshard_reshard` windows and `_add_reduce_grad`), read as a
    CSV: under fsdp pipec places exactly torch's UNSHARD/RESHARD, and the oracle accepts the Program."""
    pytest.importorskip("torch")
    from unittest import mock

    import torch.distributed.pipelining.schedules as ts
    from torch.distributed.pipelining import PipelineStage

    p, v, m = 2, 2, 4
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, p * v
    order = getattr(ts, cls_name)([stage] * v, m).pipeline_order_with_comms
    text = "".join(",".join(str(a) for a in order[r] if a is not None) + "\n" for r in range(p))
    s = read_csv(Source("t.csv", text), {"m": m})
    prog = compile_schedule(s, None, DataParallel(2, "fsdp")).program
    assert program_problem(prog, s) is None
    for r in range(p):
        theirs = [str(a) for a in order[r] if a is not None and str(a).endswith(("UNSHARD", "RESHARD"))]
        assert [f"{x.stage}{x.op}" for x in ins(prog, r) if x.op in ("UNSHARD", "RESHARD")] == theirs


def test_zeropp_under_fsdp_passes_the_oracle():
    """The library's ZeroPP-style schedule places its own windows; pipec keeps them, memory included."""
    s = lib("zeropp")
    c = check_invariants(s, {"params": 2}, data_parallel=DataParallel(2, "fsdp"), expectations=False)
    assert c.instructions > s.num_ops


def test_cli_export_comms_with_fsdp_windows():
    inter = ("interleaved-1f1b", "-D", "p=2", "-D", "m=4", "-D", "v=2")
    rc, out, _ = run_cli("export", *inter, "--comms", "--dp", "2", "--dp-kind", "fsdp", "--max-gathered", "1")
    prog = compile_schedule(lib("interleaved-1f1b", p=2, m=4, v=2), None, DataParallel(2, "fsdp", max_gathered=1))
    want = [f"{x.stage}{x.op}" for x in ins(prog.program, 0) if x.op in ("UNSHARD", "RESHARD")]
    assert rc == 0 and [c for c in out.splitlines()[0].split(",") if c.endswith("SHARD")] == want
    rc, _, err = run_cli("export", *inter, "--dp-kind", "fsdp")
    assert rc == 2 and "--comms" in err


def test_cli_show_lists_the_schedule_s_own_collectives_without_dp():
    """A schedule that places collectives (zeropp) shows them under the grid even before --dp lowers them,
    at the same steps as the lowered Program shows them."""
    args = ("show", "zeropp", "-D", "p=2", "-D", "m=4", "-D", "v=2", "-D", "b=2")
    rc, plain, _ = run_cli(*args)
    rc2, lowered, _ = run_cli(*args, "--dp", "2", "--dp-kind", "fsdp")
    assert rc == rc2 == 0 and "placed by the schedule" in plain
    ranks = [[line for line in out.splitlines() if line.startswith("Rank ")] for out in (plain, lowered)]
    assert ranks[0] == ranks[1] and len(ranks[0]) == 2
    rc, out, _ = run_cli(*args, "--json")
    assert rc == 0 and {"rank": 1, "op": "UNSHARD", "stage": 1, "before": 0} in json.loads(out)["collectives"]
    rc, out, _ = run_cli("show", "1f1b", "-D", "p=2", "-D", "m=2")
    assert rc == 0 and "collectives" not in out


def test_cli_profile_takes_the_data_parallel_options(monkeypatch):
    """`pipec profile --dp 2 --dp-kind fsdp` profiles the Program lowered with its collectives (the profile
    itself is stubbed: what is checked is the Program it is given)."""
    pytest.importorskip("torch")
    from pipec.runtime.errors import PipelineError

    given = []

    def fake_profile(program, model, **kwargs):
        given.append(program)
        raise PipelineError("stopped by the test")

    monkeypatch.setattr("pipec.runtime.profile.stages.profile", fake_profile)
    rc, _, err = run_cli(
        "profile", "1f1b", "-D", "p=2", "-D", "m=2", "--model", "examples/mlp.py", "--dp", "2", "--dp-kind", "fsdp"
    )
    assert rc == 1 and "stopped by the test" in err
    (prog,) = given
    assert (prog.dp, prog.dp_kind) == (2, "fsdp")
    assert "UNSHARD" in {i.op for i in prog.ranks[0].instructions()}
