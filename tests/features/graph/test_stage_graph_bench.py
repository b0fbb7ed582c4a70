"""benchmarks/stage_graph.py --smoke (issue 42): each stage-graph example against the chain a user writes today
(examples/unet_chain.py, examples/two_encoders_chain.py on 1F1B), profiled, simulated and run on 4 processes
at the model files' small sizes, one round. Its JSON lines are well-formed, every figure the summary reads is
there, the chain and the graph send what their edges carry (the simulator's bytes equal the Program's
transfers times the tensors' sizes), and the chain and graph models' losses agree exactly (the same maths).
No timing asserts: the timings are the benchmark's to report. Slow (about 3 minutes: two `pipec profile` and
four `pipec run` of 4 gloo processes), so behind `-m slow`.

    python -m pytest -q -p no:cacheprovider -m slow tests/features/graph/test_stage_graph_bench.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from repo import ROOT

SHARED = ("benchmark", "load_avg_start", "load_avg_end", "record_wall_s", "record_cpu_s")


@pytest.mark.slow
def test_smoke_lines_are_well_formed_and_losses_agree():
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "stage_graph.py"), "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    cases = {rec["case"]: rec for rec in lines if "case" in rec}
    assert set(cases) == {"unet", "two_encoders"} and lines[-1]["benchmark"] == "stage_graph.summary"
    for rec in lines:
        assert all(k in rec for k in SHARED), rec
    for name, rec in cases.items():
        assert rec["rounds"] == 1 and rec["ratio_of"] == "chain / graph"
        for key in ("measured_step_s", "simulated_step_s", "bytes_per_step", "peak_bytes", "peak_input_bytes"):
            assert set(rec[key]) >= {"chain", "graph"}, (name, key)
        assert all(v > 0 for k in ("measured_step_s", "simulated_step_s") for v in rec[k].values())
        assert all(len(rec[k]["graph"]) == 4 for k in ("peak_bytes", "simulated_peak_bytes", "peak_input_bytes"))
        # the simulator charges what the Program sends: its bytes equal the transfers times the tensors' sizes
        assert rec["simulated_bytes_per_step"] == {s: float(b) for s, b in rec["bytes_per_step"].items()}
        # equal maths: the chain's losses are the graph's, step for step, and in the one-process step
        assert rec["losses_equal"] and rec["losses"]["chain"] == rec["losses"]["graph"]
        assert len(rec["losses"]["graph"]) == 3
    # the skips and the tokens are carried along the chain: it sends more than the graph
    assert cases["unet"]["bytes_ratio"] < 1 and cases["two_encoders"]["bytes_ratio"] < 1
    summary = lines[-1]
    assert summary["losses_equal"] is True
    for key in ("simulated_step_gain_core_per_rank", "measured_step_gain", "gain_error_points"):
        assert isinstance(summary["two_encoders"][key], float)
    for key in ("bytes_ratio", "peak_ratio", "measured_step_gain", "gain_error_points", "peak_lower_on_ranks"):
        assert key in summary["unet"]
