"""`pipec simulate` with faults and order families (issue 44): the family machine's static and dynamic step
and the predicted gain, the very figures of `pipec.sim.machine.predicted_gain` on the same inputs; `--static`
only the static; bad fault flags E811 diagnostics; a schedule without a family or faults printed as before."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from cli_helpers import run_cli
from repo import ROOT

from pipec.driver import build
from pipec.errors import Source
from pipec.sim.faults import faults_of
from pipec.sim.machine import PREDICTED_STEPS, predicted_gain

COSTS = ("--cost", "F=0.01,B=0.02", "--cost", "latency=50us")


def _window(tmp_path, family: str = "window 4 prefer depth", name: str = "1f1b") -> str:
    text = (ROOT / "schedules" / f"{name}.pipe").read_text()
    text = re.sub(r"(rank r \{\n)", r"\1        " + family + "\n", text, count=1)
    path = tmp_path / f"{name}-window.pipe"
    path.write_text(text)
    return str(path)


def _json(*argv: str) -> dict:
    rc, out, err = run_cli("simulate", *argv, "--json")
    assert rc == 0, err
    return json.loads(out)["results"][0]


@pytest.mark.parametrize(
    ("straggler", "jitter"), [("1:2:0.3", None), (None, "exp:10ms"), ("2:3:0.5", "uniform:1ms:5ms")]
)
def test_the_printed_gain_is_predicted_gain_on_the_same_inputs(tmp_path, straggler, jitter):
    path = _window(tmp_path)
    flags = [*COSTS, "--fault-seed", "7"]
    flags += ["--straggler", straggler] if straggler else []
    flags += ["--jitter", jitter] if jitter else []
    got = _json(path, *flags)["family_prediction"]
    sched = build(Source(path, open(path).read()), {})
    cost = np.array([[0.01] * 4, [0.02] * 4])
    want = predicted_gain(
        sched, cost, 5e-5, np.inf, 0.0, sched.family, faults_of(straggler, jitter, 7), steps=range(PREDICTED_STEPS)
    )
    assert got["static"] == pytest.approx(want["static"], rel=1e-12)
    assert got["dynamic"] == pytest.approx(want["dynamic"], rel=1e-12)
    assert got["gain"] == pytest.approx(want["gain"], abs=1e-12)
    assert got["dynamic"] < got["static"]  # a window of 4 under these faults gains
    rc, out, _ = run_cli("simulate", path, *flags)
    assert rc == 0
    assert f"predicted gain {want['gain']:+.2%}" in out and f"static step {want['static']:.6g}" in out


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved-1f1b"])
def test_the_static_step_is_the_simulators_makespan(tmp_path, name):
    """One machine model: without faults the family machine's static order is the simulator's run, messages
    on the wire (latency, bytes over bandwidth in issue order per pair) included."""
    path = _window(tmp_path, "window 3", name)
    res = _json(path, *COSTS, "--cost", "W=0.01,bandwidth=1GB/s,bytes=10MB", "--static")
    assert res["family_prediction"]["static"] == pytest.approx(res["makespan"], rel=1e-12)


def test_static_gives_only_the_static_step(tmp_path):
    path = _window(tmp_path)
    dyn = _json(path, *COSTS, "--straggler", "1")["family_prediction"]
    st = _json(path, *COSTS, "--straggler", "1", "--static")["family_prediction"]
    assert st["static"] == dyn["static"] and "dynamic" not in st and "gain" not in st
    rc, out, _ = run_cli("simulate", path, *COSTS, "--straggler", "1", "--static")
    assert rc == 0 and "--static: the compiled order only" in out and "predicted gain" not in out


def test_faults_without_a_family_predict_the_static_order():
    got = _json("1f1b", *COSTS, "--jitter", "const:1ms")["family_prediction"]
    assert got["family"] is False and "gain" not in got
    # every message held 1 ms more is a latency 1 ms longer: the simulator's run with latency 1.05 ms
    slower = _json("1f1b", "--cost", "F=0.01,B=0.02", "--cost", "latency=1050us")["makespan"]
    assert got["static"] == pytest.approx(slower, rel=1e-12)


def test_without_faults_or_family_the_output_is_unchanged():
    rc, out, _ = run_cli("simulate", "1f1b", *COSTS)
    assert rc == 0 and "family machine" not in out
    assert "family_prediction" not in _json("1f1b", *COSTS)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--jitter", "gauss:1ms"], "--jitter: expected exp:MEAN, uniform:LO:HI or const:D"),
        (["--jitter", "uniform:5ms:1ms"], "--jitter: uniform jitter needs LO <= HI"),
        (["--straggler", "1:0.5"], "--straggler: a straggler needs a rank >= 0, a factor >= 1"),
        (["--straggler", "x"], "--straggler: expected RANK[:FACTOR[:SHARE]]"),
        (["--straggler", "9"], "--straggler: rank 9 is not in 0..3"),
    ],
)
def test_bad_fault_flags_are_diagnostics(flags, message):
    rc, out, err = run_cli("simulate", "1f1b", *flags)
    assert rc == 1 and out == ""
    assert err.startswith("<command line>: error[E811]: " + message), err
    assert "Traceback" not in err
