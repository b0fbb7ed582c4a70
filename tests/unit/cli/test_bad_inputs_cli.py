"""Bad inputs of `pipec profile`, `pipec plan` and the cost file's version: each is misuse (exit 2, argparse's
message) or a diagnostic (exit 1) before any work, never a traceback; the property test feeds their options
bad values of every kind and holds the exit status to 1 or 2 with no traceback."""

from __future__ import annotations

import os

import numpy as np
import pytest
from cli_helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo import ROOT
from tables import random_layer_table

from pipec.formats.partition_files import write_json

MODEL = os.path.join(ROOT, "examples", "mlp.py")
PROFILE = ("profile", "1f1b", "-D", "p=2", "-D", "m=2", "--model", MODEL, "--no-comm", "--one-process")


def _misuse(rc: int, stderr: str, message: str) -> None:
    assert rc == 2, stderr
    assert message in stderr, stderr
    assert "Traceback" not in stderr


# ---- pipec profile ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--device", "foo"), "argument --device: expected cpu, cuda or cuda:N, got `foo`"),
        (("--device", "cuda:x"), "argument --device: expected cpu, cuda or cuda:N"),
        (("--threads", "0"), "argument --threads: expected an integer from 1 to 4,096, got 0"),
        (("--threads", "-1"), "argument --threads: expected an integer from 1 to 4,096, got -1"),
        (("--threads", str(10**9)), "argument --threads: expected an integer from 1 to 4,096"),
        (("--reps", "0"), "argument --reps: expected an integer from 1 to 1,000,000, got 0"),
        (("--warmup", "-1"), "argument --warmup: expected an integer from 0 to 1,000,000, got -1"),
    ],
)
def test_profile_refuses_bad_options_as_misuse(flags, message):
    rc, _, stderr = run_cli(*PROFILE, *flags)
    _misuse(rc, stderr, message)


def test_profile_on_cuda_without_a_cuda_device_is_misuse(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, _, stderr = run_cli(*PROFILE, "--device", "cuda")
    _misuse(rc, stderr, "--device cuda: this machine has no CUDA device")


def test_profile_on_a_cuda_device_past_the_last_is_misuse(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    rc, _, stderr = run_cli(*PROFILE, "--device", "cuda:3")
    _misuse(rc, stderr, "--device cuda:3: this machine has 1 CUDA device(s)")


def test_profile_of_a_million_ranks_is_refused_before_it_is_built(monkeypatch):
    pytest.importorskip("torch")
    from pipec import driver

    built = []
    real = driver.build
    monkeypatch.setattr(driver, "build", lambda *a, **k: built.append(k.get("ranks")) or real(*a, **k))
    rc, _, stderr = run_cli("profile", "1f1b", "-D", "p=1000000", "--model", MODEL)
    _misuse(rc, stderr, "this profile builds 1,000,000 stages and runs 1,000,000 processes")
    assert built == [[0]]  # rank 0 alone was evaluated: no whole schedule, no compile


# ---- pipec plan ------------------------------------------------------------------------------------------


@pytest.fixture
def table(tmp_path) -> str:
    t = random_layer_table(np.random.default_rng(0), 6)
    doc = t.to_json()
    doc["microbatches"] = 4
    path = str(tmp_path / "layers.json")
    write_json(path, doc)
    return path


def _plan(table: str, *flags: str) -> tuple[int, str, str]:
    pytest.importorskip("ortools")
    return run_cli("plan", "--layers-cost", table, "-p", "2", "--global-batch", "8", "--time-limit", "5", *flags)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--microbatches=",), "--microbatches: expected 1 to 10,000 counts"),
        (("--microbatches=,,",), "--microbatches: expected 1 to 10,000 counts"),
        (("--microbatches=1_0",), "--microbatches: expected an integer (ASCII digits), got `1_0`"),
        (("--microbatches=0",), "--microbatches: expected an integer from 1 to"),
        (("--schedules=",), "--schedules: expected one or more of"),
        (("--schedules= , ",), "--schedules: expected one or more of"),
        (("-o=",), "-o: expected a folder, got an empty path"),
    ],
)
def test_plan_refuses_empty_and_malformed_lists(table, flags, message):
    rc, _, stderr = _plan(table, *flags)
    _misuse(rc, stderr, message)


def test_plan_refuses_an_output_folder_under_a_file_before_the_search(table, tmp_path, monkeypatch):
    from pipec import planner

    monkeypatch.setattr(planner, "plan", lambda *a, **k: pytest.fail("the search ran"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc, _, stderr = _plan(table, "-o", str(blocker / "plan"))
    _misuse(rc, stderr, f"cannot write -o `{blocker / 'plan'}`: `{blocker}` is a file, not a folder")
    rc, _, stderr = _plan(table, "-o", str(blocker))
    _misuse(rc, stderr, f"-o `{blocker}` is a file; give a folder")
    rc, _, stderr = _plan(table, "--save-layers", str(tmp_path / "no" / "such" / "t.json"))
    _misuse(rc, stderr, "its folder")


def test_plan_refuses_a_folder_it_may_not_write(table, tmp_path, monkeypatch):
    from pipec import planner

    monkeypatch.setattr(planner, "plan", lambda *a, **k: pytest.fail("the search ran"))
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    rc, _, stderr = _plan(table, "-o", str(tmp_path / "plan"))
    _misuse(rc, stderr, f"`{tmp_path}` is not writable")


def test_plan_that_cannot_write_its_files_is_misuse(table, tmp_path, monkeypatch):
    from pipec.planner.outputs import Outputs

    def fail(self, folder):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Outputs, "write", fail)
    rc, _, stderr = _plan(table, "-o", str(tmp_path / "plan"))
    _misuse(rc, stderr, "cannot write the plan's files into")
    assert "No space left on device" in stderr


# ---- the cost file's version -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "shown"), [('"2"', "'2'"), ("1.0", "1.0"), ("true", "true"), ("3", "3"), ("[]", "[]")]
)
def test_a_cost_file_of_an_unknown_version_is_e801(tmp_path, version, shown):
    path = tmp_path / "c.toml"
    path.write_text(f"version = {version}\nF = 1\n")
    rc, _, stderr = run_cli("simulate", "1f1b", "--cost", str(path))
    assert rc == 1 and f"error[E801]: {path}: cost file version {shown} is not supported" in stderr, stderr


# ---- the property: bad values to the options of view, profile and plan -----------------------------------

_VALUES = st.one_of(
    st.sampled_from(["", " ", "nan", "inf", "-1", "0", "1e400", "9" * 5000, "1_0", "٤", "x", ",", "[[[", "\x00"]),
    st.text(max_size=6),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
)
_OPTIONS = [
    ("profile", "--threads"),
    ("profile", "--device"),
    ("profile", "--reps"),
    ("profile", "--warmup"),
    ("plan", "--microbatches"),
    ("plan", "--schedules"),
    ("plan", "--memory-limit"),
    ("plan", "--time-limit"),
    ("view", "--memory-limit"),
    ("view", "--dp"),
]


def _int_in(v: str, lo: int, hi: int) -> bool:
    """Whether options.count(lo, hi) takes `v` (ASCII digits, an optional sign, at most 12 digits)."""
    t = v.strip()
    digits = t[1:] if t[:1] in "+-" else t
    return digits.isascii() and digits.isdigit() and len(digits) <= 12 and lo <= int(t) <= hi


_GOOD = {
    "--threads": lambda v: _int_in(v, 1, 4096),
    "--device": lambda v: v.strip() == "cpu" or (v.strip().startswith("cuda") and bool(_cuda())),
    "--reps": lambda v: _int_in(v, 1, 10**6),
    "--warmup": lambda v: _int_in(v, 0, 10**6),
}


def _cuda() -> int:
    """CUDA devices here (0 without torch): a cuda device is then a value profile takes."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(option=st.sampled_from(_OPTIONS), value=_VALUES)
def test_property_bad_option_values_exit_1_or_2_without_a_traceback(table, tmp_path, monkeypatch, option, value):
    command, flag = option
    if flag in _GOOD and _GOOD[flag](value):
        return  # a value the option takes: the run itself is tested elsewhere
    if command == "profile":
        pytest.importorskip("torch")
        from pipec.runtime.profile import stages

        monkeypatch.setattr(stages, "profile", lambda *a, **k: pytest.fail("profiled a bad option"))
        argv = [*PROFILE, f"{flag}={value}"]
    elif command == "plan":
        pytest.importorskip("ortools")
        from pipec import planner

        monkeypatch.setattr(planner, "plan", lambda *a, **k: pytest.fail("planned a bad option"))
        argv = ["plan", "--layers-cost", table, "-p", "2", "--global-batch", "8", f"{flag}={value}"]
    else:
        argv = ["view", "1f1b", "-D", "p=2", "-D", "m=2", f"{flag}={value}", "-o", str(tmp_path / "v.html")]
    try:
        rc, _, stderr = run_cli(*argv)
    except pytest.fail.Exception:
        if flag in ("--memory-limit", "--time-limit", "--schedules", "--microbatches"):
            return  # a value that parses (a number >= 0, a library name): the search was reached, as it should be
        raise
    assert rc in (0, 1, 2), (argv, rc, stderr)
    assert rc != 0 or command == "view", (argv, "profile and plan stop before their work or reach the stub")
    assert "Traceback" not in stderr, (argv, stderr)
