"""The property-testing kit itself (pipec.testing, `pipec test`, the pytest plugin, `expect`, docs/testing.md).

- the strategies: random schedules are valid, mutations produce exactly the diagnostic they are tagged
  with (a property test of the checker), parameter sets satisfy the `require`s and shrink to small ones;
- the independent checks agree with pipec, and catch a tampered Program;
- the seeded bugs in tests/seeded/ are found and shrunk to the smallest failing parameters, which a
  brute-force scan of the bounded space confirms; the library passes;
- `expect`: parsing, scoping, E405, `when`;
- every command in docs/testing.md works as written.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, find, given, settings
from hypothesis import strategies as st
from repo import ROOT

from pipec.api import load
from pipec.cli import app as cli
from pipec.driver import build, check_expectations, metrics
from pipec.errors import PipecError, Source
from pipec.frontend import library
from pipec.ir.program import Program, RankProgram
from pipec.passes.checks import check_schedule
from pipec.passes.compiler import compile_schedule
from pipec.testing import (
    InvariantError,
    Listing,
    Sampler,
    check_file,
    check_invariants,
    default_budget,
    mutations,
    parameter_space,
    params,
    program_problem,
    sample_space,
    schedules,
)
from pipec.testing.files import _check_point
from pipec.testing.space import m_limit

SEEDED = ROOT / "tests" / "seeded"
KIT = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)

_PIPEC_TEST_RUNS: dict[tuple, tuple[int, str, str]] = {}


def pipec_test(argv: list[str], cwd: Path, capsys) -> tuple[int, str, str]:
    """`pipec ARGV` (a `pipec test` command) run in `cwd`: exit status, stdout, stderr.

    Several tests here run the same command on the same files (the library with --budget 1s, the seeded
    files with the defaults, also in docs/testing.md's walkthrough): it runs once per session and each
    test asserts what it asserts on that one output. The key is the command, the default budget where
    the command gives none (CI's is smaller), and the bytes of every .pipe file its arguments name, so an
    edited file runs again."""
    import hashlib

    digest = hashlib.sha256()
    for arg in argv:
        path = cwd / arg
        files = sorted(path.rglob("*.pipe")) if path.is_dir() else [path] if path.is_file() else []
        for f in files:
            digest.update(str(f.relative_to(cwd)).encode() + b"\0" + f.read_bytes() + b"\0")
    budget = None if "--budget" in argv else default_budget()  # CI=true changes nothing else
    key = (tuple(argv), budget, digest.hexdigest())
    if key not in _PIPEC_TEST_RUNS:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(cwd)
            capsys.readouterr()
            rc = cli.main(argv)
            out = capsys.readouterr()
        _PIPEC_TEST_RUNS[key] = (rc, out.out, out.err)
    return _PIPEC_TEST_RUNS[key]


# ---- imports -------------------------------------------------------------------------------------


def test_importing_pipec_and_the_kit_imports_neither_torch_nor_hypothesis():
    code = (
        "import sys, pipec, pipec.testing, pipec.cli.app, pipec.pytest_plugin, pipec.passes.expect\n"
        "bad = [m for m in ('torch', 'hypothesis') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---- strategies -------------------------------------------------------------------------------------


@settings(KIT, max_examples=40)
@given(schedules())
def test_random_schedules_pass_every_check(listing):
    checked = check_invariants(listing)
    assert checked.ops == sum(len(o) for o in listing.orders)
    assert checked.makespan >= checked.critical_path - 1e-9


def _reported(m) -> PipecError:
    """Build and compile a mutation the way `pipec check` does; the diagnostic it stops with."""
    sched = m.listing.build(check=False)
    with pytest.raises(PipecError) as info:
        check_schedule(sched)
        compile_schedule(sched)
    return info.value


@settings(KIT, max_examples=80)
@given(schedules().flatmap(mutations))
def test_each_mutation_produces_exactly_its_diagnostic(m):
    err = _reported(m)
    assert err.code == m.code, f"{m.what}: {err}"
    if m.rank is not None:  # the diagnostic points at the mutated rank's line
        assert err.span.line == m.listing.rank_line(m.rank), f"{m.what}: {err}"
    # The independent checks agree: check_invariants raises the same diagnostic, not an InvariantError.
    with pytest.raises(PipecError) as info:
        check_invariants(m.listing.build(check=False))
    assert info.value.code == m.code


@settings(KIT, max_examples=25)
@given(schedules(max_ranks=4, max_stages=6, max_mb=4), st.data())
def test_cycle_mutations_deadlock_across_two_ranks(listing, data):
    """E401 mutations are rare among all kinds: draw them on their own where the schedule has one."""
    strategy = mutations(listing, codes=("E401",))
    assume(not strategy.is_empty)
    m = data.draw(strategy)
    err = _reported(m)
    assert err.code == "E401", f"{m.what}: {err}"
    assert "deadlock: ranks" in err.diagnostics[0].message


def test_mutations_of_a_library_schedule_cover_every_code():
    sched = load("1f1b", p=3, m=4)
    seen = set()
    for code in ("E301", "E302", "E303", "E304", "E401", "E402"):
        m = find(mutations(sched, codes=(code,)), lambda _: True, settings=KIT)
        assert _reported(m).code == code
        seen.add(m.code)
    assert len(seen) == 6


def test_listing_round_trips_a_schedule_with_overlapped_pairs():
    sched = load("dualpipe-v", p=2, m=4)
    listing = Listing.from_schedule(sched)
    again = listing.build()
    for r in range(sched.num_ranks):
        assert again.ops(r) == sched.ops(r)
        assert np.array_equal(again.ranks[r].paired, sched.ranks[r].paired)
    check_invariants(again)


def test_parameter_space_respects_requires_and_starts_small():
    points = parameter_space("zb-v")
    assert points[0] == {"p": 1, "m": 1}
    assert all(pt["m"] >= 2 * pt["p"] - 1 for pt in points)
    assert len(points) == sum(1 for p in range(1, 7) for m in range(1, 13) if m >= 2 * p - 1)
    sums = [pt["p"] + pt["m"] for pt in points]
    assert sums == sorted(sums)


def test_params_shrink_toward_small_p_and_m():
    assert find(params("zb-v"), lambda pt: pt["p"] >= 3, settings=KIT) == {"p": 3, "m": 5}
    assert find(params("1f1b"), lambda pt: pt["m"] >= 4, settings=KIT) == {"p": 1, "m": 4}


def test_bounds_and_fixed_parameters():
    points = parameter_space("interleaved-1f1b", {"p": [2, 4]}, {"v": "3"})
    assert {pt["p"] for pt in points} == {2, 4} and {pt["v"] for pt in points} == {3}
    with pytest.raises(ValueError, match="no parameter `q`"):
        parameter_space("1f1b", fixed={"q": 1})


# ---- independent checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "dualpipe-v", "interleaved-1f1b"])
def test_library_programs_pass_the_independent_checks(name):
    compiled = compile_schedule(load(name, p=3, m=6) if name != "zb-v" else load(name, p=3, m=5))
    assert check_invariants(compiled).expectations >= 1
    bare = check_invariants(compiled.program)
    assert bare.instructions == compiled.program.num_instructions


def _with_rank(prog: Program, r: int, instrs) -> Program:
    ranks = list(prog.ranks)
    ranks[r] = RankProgram.from_instructions(instrs)
    return Program(
        prog.name,
        prog.params,
        prog.num_stages,
        prog.num_ranks,
        prog.num_microbatches,
        prog.split_backward,
        prog.placement,
        tuple(ranks),
    )


def test_a_tampered_program_is_caught():
    prog = compile_schedule(load("1f1b", p=3, m=4)).program
    assert program_problem(prog) is None
    instrs = prog.ranks[1].instructions()
    # A receive dropped: the compute that needs it has no input.
    j = next(i for i, x in enumerate(instrs) if x.op == "RECV_ACT")
    assert "no receive" in program_problem(_with_rank(prog, 1, instrs[:j] + instrs[j + 1 :]))
    # Two sends to one peer swapped: both ends of the channel no longer agree on the order.
    # The first activation sent after the second: both are sent after they are computed, but rank 1
    # receives them in the other order.
    first = prog.ranks[0].instructions()
    a, b = [i for i, x in enumerate(first) if x.op == "SEND_ACT"][:2]
    after = b + 1 + first[b].group  # past the receive it is batched with
    swapped = first[:a] + first[a + 1 : after] + [first[a]] + first[after:]
    assert "different orders" in program_problem(_with_rank(prog, 0, swapped))
    with pytest.raises(InvariantError, match="different orders"):
        check_invariants(_with_rank(prog, 0, swapped))


def test_a_wrong_verdict_of_pipec_is_an_invariant_error(monkeypatch):
    import pipec.testing.invariants as kit
    from pipec.errors import error

    def says_deadlock(sched, memory=None):
        raise error("E401", "deadlock (a pretend bug in pipec)")

    monkeypatch.setattr(kit, "compile_schedule", says_deadlock)
    with pytest.raises(InvariantError, match="valid and fits"):
        check_invariants(load("1f1b", p=2, m=2))


# ---- seeded bugs: found, and shrunk to the smallest failing parameters ---------------------------------------


def _confirm_smallest(path: Path, point: dict, code: str) -> None:
    """Brute force: the set fails with this code, and every smaller set of the space passes."""
    source = library.read(str(path))
    res = _check_point(source, str(path), point, False)
    assert res is not None and res != "skip" and res.kind == code, res
    for smaller in sample_space(source).smaller(point):
        res = _check_point(source, str(path), smaller, False)
        assert res is None or res == "skip", f"{smaller} fails too: {res}"


SEEDED_CASES = [
    ("interleaved_warmup_deadlock.pipe", "E401", {"p": 4, "v": 2, "m": 8}),
    ("snake_placement_odd_p.pipe", "E208", {"p": 3, "m": 1}),
    ("zb_h1_last_rank_w_first.pipe", "E304", {"p": 1, "m": 1}),
    ("deep_bubble_promise.pipe", "E405", {"p": 7, "m": 1}),  # the `expect` fails from p = 7 on
    ("tuned_for_p16.pipe", "E405", {"p": 16, "m": 2}),  # the `expect` fails at p = 16 only
]


@pytest.mark.parametrize(("name", "code", "smallest"), SEEDED_CASES)
def test_seeded_bug_is_found_with_the_defaults_and_shrunk(name, code, smallest, capsys, monkeypatch):
    path = SEEDED / name
    rel = str(path.relative_to(ROOT))
    monkeypatch.delenv("CI", raising=False)  # the defaults a user has; the search stops at the first failure
    monkeypatch.chdir(ROOT)
    rc, _, out = pipec_test(["test", rel], ROOT, capsys)  # a failure's report is a diagnostic: stderr
    assert rc == 1
    shown = " ".join(f"{k}={v}" for k, v in smallest.items())
    assert f"{rel}: FAILED at {shown} (" in out
    assert f"error[{code}]" in out
    command = f"pipec check {rel} " + " ".join(f"-D {k}={v}" for k, v in smallest.items())
    assert f"  reproduce: {command}\n" in out
    assert "  tried: p " in out
    # The command reproduces it, and it is the smallest failing set there is.
    assert cli.main(command.split()[1:]) == 1
    assert f"error[{code}]" in capsys.readouterr().err
    _confirm_smallest(path, smallest, code)


def test_the_seeded_deadlock_is_found_for_other_seeds_too():
    for seed in (1, 2):
        res = check_file(str(SEEDED / "interleaved_warmup_deadlock.pipe"), seed=seed, budget=300)
        assert not res.ok and res.failure.params == {"p": 4, "v": 2, "m": 8}


@pytest.mark.slow  # pipec test end to end: the seeded-bug tests; the library's checks: test_library
def test_the_library_passes(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc, out, _ = pipec_test(["test", "schedules/", "--budget", "1s"], ROOT, capsys)
    assert rc == 0
    assert f"{len(library.names())} files: {len(library.names())} ok, 0 failed" in out
    assert out.count("  tried: p ") == len(library.names())


@pytest.mark.parametrize("name", library.names())
def test_the_sampler_starts_small_and_reaches_p32_early(name):
    """Without checking anything: the order `pipec test` checks sets in, for every library schedule."""
    source = library.read(name)
    space = sample_space(source)
    sampler = Sampler(space, source)
    first = [pt for _, pt in zip(range(80), sampler)]
    for pt in first:  # every set passes the top-level `require`s
        build(source, pt, check=False, ranks=())
    assert space.cost(first[0]) <= 2  # p = 1 or 2 with m = 1 (or the smallest m the `require`s allow)
    assert 32 in {pt["p"] for pt in first}, "the ladder reaches p = 32 within 80 sets"
    if "v" in space.axis:
        assert {pt["v"] for pt in first} == {1, 2, 3, 4}


def test_the_sampler_weights_the_boundaries_of_m():
    source = library.read("1f1b")
    space = sample_space(source)
    first = [pt for _, pt in zip(range(200), Sampler(space, source))]
    at16 = {pt["m"] for pt in first if pt["p"] == 16}
    assert {1, 15, 16, 17, 31} <= at16  # m < p, m = p, m = p + 1, m = 2p - 1
    assert max(pt["m"] for pt in first) <= m_limit(32)
    # A `require`'s edge: zb-v needs m >= 2p - 1; its sets at p = 16 start at m = 31.
    zbv = library.read("zb-v")
    sp = sample_space(zbv)
    assert min(pt["m"] for _, pt in zip(range(120), Sampler(sp, zbv)) if pt["p"] == 16) == 31


def test_the_space_reaches_production_degrees():
    space = sample_space("interleaved-1f1b")
    assert space.axis["p"] == tuple(range(1, 33)) and space.axis["v"] == (1, 2, 3, 4)
    assert max(m["m"] for m in space.members() if m["p"] == 32) == 128
    assert max(m["m"] for m in space.members() if m["p"] == 2) == 12
    # Parameters with many values are drawn per set rather than multiplying the space.
    cross = sample_space("crossdc-zb")
    assert cross.drawn == ("cut", "g") and cross.size() == sample_space("1f1b").size()
    # --range and -D still rule.
    narrow = sample_space("1f1b", {"m": [2, 3]}, {"p": "4"})
    assert narrow.members() == [{"p": 4, "m": 2}, {"p": 4, "m": 3}]


def test_a_count_limit_and_the_coverage_it_reports():
    res = check_file("interleaved-1f1b", examples=12)
    assert res.ok and res.examples == 12 and res.budget is None
    cov = res.coverage
    assert sum(cov.values("p").values()) == 12 and sum(cov.values("v").values()) == 12
    big = dict(cov.largest)
    assert big["p"] in cov.values("p") and big["m"] in cov.values("m") and big["v"] in cov.values("v")
    assert not cov.exhausted
    text = cov.text()
    assert text.startswith("p ") and f"largest p x m: {big['p']} x {big['m']}" in text


def test_a_small_space_is_exhausted(capsys):
    assert cli.main(["test", "1f1b", "--range", "p=1..4", "--range", "m=1..4"]) == 0
    out = capsys.readouterr().out
    assert "1f1b: ok (all 9 parameter sets, " in out
    assert "  tried: p 1..3 (1:3 2:3 3:3), m 1..3 (1:3 2:3 3:3); largest p x m: 3 x 3\n" in out


def test_pipec_test_json(capsys, monkeypatch):
    import json

    monkeypatch.chdir(ROOT)
    rel = "tests/seeded/snake_placement_odd_p.pipe"
    assert cli.main(["test", "1f1b", rel, "--examples", "6", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["ok"], doc["command"], doc["passed"], doc["failed"]) == (False, "test", 1, 1)
    good, bad = doc["files"]
    assert good["ok"] and good["checked"] == 6 and sum(good["coverage"]["values"]["p"].values()) == 6
    assert bad["failure"]["params"] == {"p": 3, "m": 1} and bad["failure"]["kind"] == "E208"
    assert bad["failure"]["command"] == f"pipec check {rel} -D p=3 -D m=1"


def test_the_default_budget_is_smaller_on_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert default_budget() == 30.0
    monkeypatch.setenv("CI", "true")
    assert default_budget() == 5.0


def test_budget_values():
    import argparse

    from pipec.options import duration

    assert [duration(t) for t in ("30s", "2m", "500ms", "1.5")] == [30.0, 120.0, 0.5, 1.5]
    for bad in ("0s", "soon", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            duration(bad)


def test_pipec_test_misuse_exits_2(tmp_path, capsys):
    assert cli.main(["test", str(tmp_path)]) == 2  # no .pipe files
    assert cli.main(["test", "1f1b", "--examples", "0"]) == 2
    assert cli.main(["test", "1f1b", "--range", "p=oops"]) == 2
    assert cli.main(["test", "1f1b", "--range", "q=1..3"]) == 2
    err = capsys.readouterr().err
    assert "no .pipe files" in err and "--examples" in err and "NAME=LO..HI" in err
    assert "no schedule here has a parameter `q`" in err
    with pytest.raises(SystemExit) as info:
        cli.main(["test", "1f1b", "--budget", "soon"])
    assert info.value.code == 2 and "expected a time such as 30s" in capsys.readouterr().err


def test_a_file_that_does_not_parse_fails_at_once(tmp_path, capsys):
    (tmp_path / "bad.pipe").write_text('schedule "x" (p: int = 2) { stages p) }\n')
    assert cli.main(["test", str(tmp_path / "bad.pipe")]) == 1
    assert "error[E001]" in capsys.readouterr().err  # a failure is reported on stderr


def test_pytest_plugin_reports_the_smallest_case(tmp_path):
    target = SEEDED / "snake_placement_odd_p.pipe"
    run = subprocess.run(
        # under pytest-xdist (-n 2): the coverage lines travel from the worker to the controller's summary
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pipec", str(target), "-q", "-n", "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "fails at p=3 m=1" in run.stdout
    assert "-D p=3 -D m=1" in run.stdout
    assert "pipec coverage" in run.stdout and "tried: p 2..3" in run.stdout
    # Without --pipec, .pipe files are not collected.
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(target), "-q"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 4 or "no tests ran" in run.stdout, run.stdout


def test_runtime_check_compares_with_the_reference(monkeypatch):
    pytest.importorskip("torch")
    from pipec.runtime.local import LocalPipeline
    from pipec.testing import runtime_check

    assert runtime_check(load("zb-v", p=2, m=3)) < 1e-12
    real = LocalPipeline.named_gradients

    def off(self):  # a runtime bug: one gradient comes back scaled
        grads = real(self)
        key = sorted(grads)[0]
        grads[key] = grads[key] * 1.5
        return grads

    monkeypatch.setattr(LocalPipeline, "named_gradients", off)
    with pytest.raises(InvariantError, match="gradient of stage 0"):
        runtime_check(load("1f1b", p=2, m=2))


def test_pipec_test_runtime(capsys):
    pytest.importorskip("torch")
    assert cli.main(["test", "1f1b", "--examples", "20", "--runtime"]) == 0
    assert re.search(r"\b[123] on the runtime", capsys.readouterr().out)


# ---- expect -----------------------------------------------------------------------------------------------

PROMISES = """\
schedule "t" (p: int = 3, m: int = 4) {
    expect bubble <= (p - 1) / (m + p - 1), "1F1B's bubble"
    expect makespan == 3 * (m + p - 1) when m >= 1
    expect ideal == 3 * m and bubble_time >= 0
    stages p
    rank r {
        expect in_flight(r) <= p - r
        expect peak_memory(r) <= min(p - r, m) when r < p - 1
        let warm = min(p - 1 - r, m)
        for i in 0 .. warm      { F(i) }
        for i in 0 .. m - warm  { F(i + warm)  B(i) }
        for i in m - warm .. m  { B(i) }
    }
}
"""


def _with(old: str, new: str, text: str = PROMISES) -> str:
    assert old in text
    return text.replace(old, new, 1)


def test_expectations_are_stored_per_rank_and_hold():
    sched = build(Source("t.pipe", PROMISES), {})
    assert [e.rank for e in sched.expects] == [None, None, None, 0, 0, 1, 1, 2]  # `when r < p - 1`: not rank 2
    assert check_expectations(sched) == 8


def test_a_broken_promise_is_E405_with_both_sides(capsys, tmp_path):
    text = _with("expect in_flight(r) <= p - r\n", "expect in_flight(r) <= p - r - 1\n")
    (tmp_path / "t.pipe").write_text(text)
    assert cli.main(["check", str(tmp_path / "t.pipe")]) == 1
    err = capsys.readouterr().err
    assert "t.pipe:7:9: error[E405]: expectation not met on rank 0: `in_flight(r) <= p - r - 1`" in err
    assert "= note: measured 3, bound 2" in err and "= note: with p=3, m=4" in err
    text = _with('(m + p - 1), "1F1B', '(m + p), "1F1B')
    with pytest.raises(PipecError) as info:
        check_expectations(build(Source("t.pipe", text), {}))
    d = info.value.diagnostics[0]
    assert (d.code, d.span.line) == ("E405", 2) and d.message == "expectation not met: 1F1B's bubble"
    assert d.notes[0] == "expected `bubble <= (p - 1) / (m + p)`"


def test_a_guard_skips_an_expectation():
    text = _with("when m >= 1", "when m >= 5")
    text = _with("== 3 * (m + p - 1)", "== 0", text)
    check_expectations(build(Source("t.pipe", text), {}))  # m = 4: skipped
    with pytest.raises(PipecError, match="E405"):
        check_expectations(build(Source("t.pipe", text), {"m": 5}))


@pytest.mark.parametrize(
    ("old", "new", "code", "what"),
    [
        ("expect in_flight(r) <= p - r\n", "for i in 0 .. 1 { expect bubble >= 0 }\n", "E109", "not in a loop"),
        ("expect in_flight(r) <= p - r\n", "def f() { expect bubble >= 0 }\n", "E109", "not in a loop or function"),
        ("expect in_flight(r) <= p - r\n", "let x = bubble\n", "E101", "unknown name `bubble`"),
        ("expect ideal == 3 * m and bubble_time >= 0\n", "expect in_flight(r) >= 0\n", "E101", "unknown name `r`"),
        ("expect ideal == 3 * m and bubble_time >= 0\n", "expect bubble\n", "E103", "`expect` needs bool"),
        ("expect ideal == 3 * m and bubble_time >= 0\n", "expect peak_memory(0, 1) > 0\n", "E102", "1 argument"),
        ("expect ideal == 3 * m and bubble_time >= 0\n", "expect peak_memory > 0\n", "E103", "call it"),
        ("when m >= 1", "when bubble >= 0", "E101", "unknown name `bubble`"),
        ("expect in_flight(r) <= p - r\n", "let expect = 1\n", "E104", "keyword"),
    ],
)
def test_expect_misuse_is_a_diagnostic(old, new, code, what):
    with pytest.raises(PipecError) as info:
        build(Source("t.pipe", _with(old, new)), {})
    assert info.value.code == code and what in info.value.diagnostics[0].message, info.value


def test_errors_inside_an_expectation_are_diagnostics():
    text = _with("expect ideal == 3 * m and bubble_time >= 0\n", "expect bubble <= 1 / (m - 4)\n")
    with pytest.raises(PipecError) as info:
        check_expectations(build(Source("t.pipe", text), {}))
    assert info.value.code == "E201" and info.value.span.line == 4
    text = _with("expect ideal == 3 * m and bubble_time >= 0\n", "expect peak_memory(p) >= 0\n")
    with pytest.raises(PipecError) as info:
        check_expectations(build(Source("t.pipe", text), {}))
    assert info.value.code == "E405" and "`peak_memory(3)`: rank 3 is not in 0..2" in str(info.value)


def test_metrics_match_the_simulator_and_memory_model():
    sched = load("zb-h1", p=4, m=8)
    m = metrics(sched)
    assert m.bubble_time == pytest.approx(3.0) and m.ideal == pytest.approx(24.0)
    assert [m.in_flight(r) for r in range(4)] == [4, 4, 4, 4]
    assert m.peak_memory(3) == pytest.approx(2.5)


def test_every_library_schedule_states_a_promise():
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2", "zb-v", "dualpipe-v"):
        assert re.search(r"^\s*expect ", library.read(name).text, re.M), name


# ---- docs/testing.md, as written --------------------------------------------------------------------------

DOC = ROOT / "docs" / "testing.md"
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def _expected_pattern(text: str) -> re.Pattern:
    """Shown output as a pattern: `...` lines match any lines, a line ending in `...` any line that starts
    so; timings (`0.6 s`) match any timing, and so do the counts of parameter sets checked and failing,
    which depend on the machine's speed within a budget (the parameters shown, the smallest failing ones,
    do not)."""
    parts = []
    for line in text.splitlines():
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        elif line.endswith("..."):  # a line shown in part (a coverage line): its start
            parts.append(re.escape(line[:-3]) + r"[^\n]*\n")
        else:
            esc = re.escape(line)
            esc = re.sub(r"\d+\\\.\d+\\ s", r"\\d+\\.\\d+\\ s", esc)
            esc = re.sub(r"smallest\\ of\\ \d+", r"smallest\\ of\\ \\d+", esc)
            esc = re.sub(r"(?:all\\ )?\d[\d,]*\\ parameter\\ sets", r"(?:all\\ )?[\\d,]+\\ parameter\\ sets", esc)
            esc = esc.replace(r"in\ \.\.\.", r"in\ .*")
            parts.append(esc + r"\n")
    return re.compile("".join(parts))


def _run_doc_command(cmd: str, cwd: Path, capsys) -> tuple[int, str]:
    argv = cmd.split()
    if argv[0] == "pipec":
        if argv[1] == "test":  # perhaps run already, by a test above, on the same files
            rc, out, err = pipec_test(argv[1:], cwd, capsys)
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.chdir(cwd)
                capsys.readouterr()
                rc = cli.main(argv[1:])
                captured = capsys.readouterr()
            out, err = captured.out, captured.err
        err = re.sub(r"^  \.\.\. .*\n", "", err, flags=re.M)  # progress lines of long runs: not shown
        return rc, err + out  # pipec test: failures (stderr) come before the summary line (stdout)
    assert argv[0] == "pytest", cmd
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *argv[1:]], capture_output=True, text=True, cwd=cwd
    )
    return run.returncode, run.stdout + run.stderr


def test_the_walkthrough_works_as_written(tmp_path, capsys, monkeypatch):
    """Every ```pipe file=..., ```diff and ```console block of docs/testing.md, in order, in a copy of the
    repository's tests/seeded and schedules; each command's output must be what the page shows."""
    import shutil

    monkeypatch.delenv("CI", raising=False)  # the page shows the defaults a user has

    work = tmp_path / "repo"
    shutil.copytree(SEEDED, work / "tests" / "seeded")
    shutil.copytree(ROOT / "schedules", work / "schedules", ignore=shutil.ignore_patterns("__init__.py"))
    text = DOC.read_text()
    current = None
    ran = 0
    for m in _FENCE.finditer(text):
        info, body = m.group(1).strip(), m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        if info.startswith("pipe file="):
            current = work / info.split("=", 1)[1]
            current.write_text(body)
        elif info == "diff":
            old = "".join(x[1:] + "\n" for x in body.splitlines() if x.startswith("-"))
            new = "".join(x[1:] + "\n" for x in body.splitlines() if x.startswith("+"))
            content = current.read_text()
            assert content.count(old) == 1, f"docs/testing.md:{line}: the diff does not apply"
            current.write_text(content.replace(old, new))
        elif info == "console":
            chunks = re.split(r"^\$ ", body, flags=re.M)[1:]
            for chunk in chunks:
                cmd, _, shown = chunk.partition("\n")
                rc, out = _run_doc_command(cmd, work, capsys)
                pattern = _expected_pattern(shown)
                assert pattern.fullmatch(out), f"docs/testing.md:{line}: `{cmd}` printed\n{out}\nnot\n{shown}"
                failing = "FAILED" in shown or "error[" in shown or " failed" in shown.replace(", 0 failed", "")
                assert rc == (1 if failing else 0), f"docs/testing.md:{line}: `{cmd}` exited {rc}"
                ran += 1
        elif info == "python":
            namespace: dict = {}
            with pytest.MonkeyPatch.context() as mp:
                mp.chdir(work)
                exec(compile(body, f"docs/testing.md:{line}", "exec"), namespace)
            ran += 1
    assert ran >= 10


def test_the_E405_example_of_docs_errors_md(tmp_path, capsys):
    section = (ROOT / "docs" / "errors.md").read_text().split("### E405", 1)[1].split("\n### ", 1)[0]
    schedule = re.search(r"```pipe\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"```console\n\$ pipec check t\.pipe\n(.*?)```", section, re.S).group(1)
    (tmp_path / "t.pipe").write_text(schedule)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert cli.main(["check", "t.pipe"]) == 1
    assert capsys.readouterr().err == shown
