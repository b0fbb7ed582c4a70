"""pipec profile: the cost file it writes is one the simulator reads, with the schedule's stages, its kind of
backward and the message sizes of the model (timings are not asserted: they depend on the machine)."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")

from runtime_harness import ROOT  # noqa: E402

from pipec.api import load  # noqa: E402
from pipec.cli import main  # noqa: E402
from pipec.compiler import compile_schedule  # noqa: E402
from pipec.costs import cost_model, read_cost_file  # noqa: E402
from pipec.runtime import load_model  # noqa: E402
from pipec.runtime.profile import measure_link, profile  # noqa: E402

MLP = {"MLP_WIDTH": "16", "MLP_DEPTH": "4", "MLP_BATCH": "8", "MLP_DTYPE": "float64"}
MODEL = str(ROOT / "examples" / "mlp.py")


@pytest.fixture
def small_mlp(monkeypatch):
    for k, v in MLP.items():
        monkeypatch.setenv(k, v)


def _simulate(capsys, args: list[str]) -> dict:
    capsys.readouterr()
    assert main(["simulate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "name,params,split",
    [
        ("1f1b", ["p=2", "m=4"], False),
        ("zb-h1", ["p=2", "m=4"], True),
        ("interleaved-1f1b", ["p=2", "v=2", "m=4"], False),
    ],
)
def test_profile_round_trips_through_the_simulator(tmp_path, capsys, small_mlp, name, params, split):
    out = tmp_path / "costs.toml"
    defines = [x for kv in params for x in ("-D", kv)]
    argv = ["profile", name, *defines, "--model", MODEL, "-o", str(out), "--reps", "2", "--warmup", "0", "--no-comm"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and f"pipec simulate {name}" in printed
    doc = read_cost_file(out)  # the simulator's own reader
    S = compile_schedule(load(name, **dict(kv.split("=") for kv in params))).program.num_stages
    assert len(doc["F"]) == len(doc["B"]) == S and all(x > 0 for x in doc["F"])
    assert ("W" in doc) == split  # without split backward, B is the full backward
    # 16 float64 columns, 2 rows per micro-batch, between every pair of neighbouring stages
    assert doc["act_bytes"] == [2 * 16 * 8] * (S - 1) + [0]
    assert doc["grad_bytes"] == [0] + [2 * 16 * 8] * (S - 1)
    assert "latency" not in doc and "overhead" not in doc  # --no-comm
    sim = _simulate(capsys, [name, *defines, "--cost", str(out)])
    costs = sim["costs"]
    as_list = lambda v: v if isinstance(v, list) else [v] * S  # noqa: E731
    assert as_list(costs["F"]) == pytest.approx(doc["F"])
    assert as_list(costs["B"]) == pytest.approx(doc["B"])
    assert costs["full_backward"] == (None if split else "B + W")
    if not split:
        assert as_list(costs["W"]) == [0.0] * S
    assert sim["makespan"] > 0 and math.isfinite(sim["makespan"])
    # the same numbers through the cost model directly
    cm = cost_model(load(name, **dict(kv.split("=") for kv in params)), [doc])
    assert list(cm.F) == pytest.approx(doc["F"])


def test_profile_json_and_measured_tables(tmp_path, capsys, small_mlp):
    out = tmp_path / "costs.json"
    argv = ["profile", "zb-v", "-D", "p=2", "-D", "m=4", "--model", MODEL, "-o", str(out), "--reps", "1"]
    assert main([*argv, "--warmup", "0", "--no-comm", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    doc = json.loads(out.read_text())
    assert doc["format"] == "pipec-costs" and doc["schedule"] == "zb-v"
    stages = doc["measured"]["stages"]
    for key in ("forward", "full_backward", "input_backward", "weight_backward", "optimizer_step"):
        assert len(stages[key]) == 4
    assert stages["input_backward"] == doc["B"] and stages["weight_backward"] == doc["W"]
    assert doc["measured"]["run"]["threads"] >= 1
    assert printed["costs"]["F"] == doc["F"]
    read_cost_file(out)


def test_profile_api_and_the_link(small_mlp):
    model = load_model(MODEL)
    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    prof = profile(prog, model, reps=1, warmup=0, comm=False, threads=1)
    assert prof.latency is None and len(prof.forward) == 2
    assert prof.info["threads"] == 1 and prof.info["dtype"] == "float64"
    # the gloo ping-pong between two fresh processes: a positive one-way time; the runtime's own time per
    # send or receive instruction is positive, and far below a second
    latency, bandwidth, overhead = measure_link(4096, reps=3, gap=1e-4)
    assert latency is not None and 0 < latency < 1.0
    assert bandwidth is None or bandwidth > 0
    assert overhead is not None and 0 < overhead < 0.1


def test_profile_refuses_a_bad_model(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("def build_stage(stage):\n    pass\n")
    assert main(["profile", "1f1b", "-D", "p=2", "--model", str(bad), "--no-comm"]) == 1
    err = capsys.readouterr().err
    assert "pipec profile: error:" in err and "missing `loss_fn" in err
