"""Every benchmark's smallest configuration runs, and prints its lines in the shared format (issue 31, item 4).

A benchmark that nothing runs rots silently: a renamed field or a changed `--json` shape breaks it, and the
next reader finds a KeyError instead of a figure. Here each `benchmarks/*.py` that is a benchmark runs with
`--smoke` (one round, the smallest sizes, seconds) as a subprocess, and every line it prints must be a JSON
object carrying the fields `benchmarks/sidebyside.emit` adds (the benchmark's name, the load average at the
record's start and end, its wall and CPU time) and, for a side-by-side record, the ratio with its spread over
the rounds. One test per script, so pytest-xdist spreads them.

Not run here (`EXCLUDED`, each with its reason): the helpers, which are modules other benchmarks import, and
torchtitan_train.py, which needs an environment of its own. Run only with `-m slow` (`SLOW`): the benchmarks
whose smallest meaningful case starts several torch processes (gloo jobs, `pipec profile`, `pipec run`) and so
takes 10 to 130 s even at one round of one step; the default run keeps to the single-process ones, about a
minute of CPU together. `SLOW` holds each one's smoke wall time, measured on the 2-core development machine
at load 3 to 5 (`pytest -n 0 -m '' --durations=0` on this file, 2026-12-03).

    python -m pytest -q -p no:cacheprovider -n 0 tests/features/test_benchmarks_smoke.py           # default
    python -m pytest -q -p no:cacheprovider -m slow tests/features/test_benchmarks_smoke.py        # the rest
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from repo import ROOT

BENCH = ROOT / "benchmarks"
EXCLUDED = {
    "sidebyside.py": "the shared helper (timing, ABBA rounds, the JSON line), not a benchmark",
    "blocks_model.py": "a model file that benchmarks load, not a benchmark",
    "torchtitan_train.py": "needs its own environment with torchtitan 0.2.2 (--setup installs it from the network)",
}
SLOW = {  # script: its --smoke's wall seconds as measured (see the module docstring); the processes it starts
    "fidelity.py": (127, "pipec profile, profile --in-situ and run, 2 gloo processes each"),
    "gpu_check.py": (92, "--device cpu dry run: a torchrun job and pipec profile of the GPT example"),
    "pp_dp_sim_vs_measured.py": (91, "profile --in-situ --dp 2 and pipec run on 4 gloo processes"),
    "cpu_bind.py": (79, "two gloo sessions and two pipec runs on 2 processes"),
    "partition_gain.py": (65, "pipec partition's layer timing and two pipec runs on 4 processes"),
    "memory_measured.py": (47, "pipec profile and a torchrun job on 4 processes"),
    "moe_overlap.py": (62, "pipec profile and two pipec runs on 4 gloo processes (2 ranks x 2 replicas, experts)"),
    "faults.py": (32, "a pipec run on 3 processes that fails"),
    "api_vs_torch.py": (32, "2 gloo processes, three systems, transformers"),
    "pp_dp_vs_torch.py": (30, "4 gloo processes (the 2 x 2 mesh)"),
    "emulated_links.py": (26, "pipec profile and pipec run on 2 processes"),
    "runtime_vs_torch.py": (25, "2 gloo processes"),
    "op_order.py": (16, "a traced pipec run on 2 processes"),
    "gloo_exchange.py": (14, "two gloo sessions on 2 processes"),
    "compile_stages.py": (14, "torch.compile (aot_eager) of a tiny GPT's two stages, eager beside them"),
    "transfer_calls.py": (14, "2 gloo processes"),
    "dynamic_order.py": (60, "pipec run on 4 processes, dynamic and --static (seconds estimated, not measured)"),
    "stage_graph.py": (180, "pipec profile of two chain models and 4-process gloo runs of four models (at load ~15)"),
}
SCRIPTS = [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
    for name in sorted(p.name for p in BENCH.glob("*.py") if p.name not in EXCLUDED)
]
SHARED = ("benchmark", "load_avg_start", "load_avg_end", "record_wall_s", "record_cpu_s")
TIMEOUT_S = 240  # generous: the machine is shared; a smoke run takes seconds when it is quiet


def test_every_script_is_run_or_excluded():
    """A new benchmark is smoked unless it is added to EXCLUDED with a reason; excluded and slow names exist."""
    names = {p.name for p in BENCH.glob("*.py")}
    assert set(EXCLUDED) <= names and set(SLOW) <= names and not set(SLOW) & set(EXCLUDED)
    assert len(SCRIPTS) + len(EXCLUDED) == len(names)


def test_alternate_runs_abba_and_summarize_reports_the_spread(monkeypatch):
    """Each system goes first equally often (A B B A A B B A), and a side-by-side record carries the median
    ratio with its spread over the paired rounds, for wall and for CPU time."""
    monkeypatch.syspath_prepend(str(BENCH))
    import sidebyside

    order: list[str] = []
    walls = {"a": iter([2.0, 4.0, 2.0, 2.0]), "b": iter([1.0, 1.0, 2.0, 1.0])}

    def system(name: str):
        return lambda: order.append(name) or sidebyside.Timing(next(walls[name]), 1.0, 0.5)

    runs = sidebyside.alternate({"a": system("a"), "b": system("b")}, rounds=4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    rec = sidebyside.summarize("t", runs, ("a", "b"))
    assert rec["rounds"] == 4 and rec["ratio"] == 2.0  # median 2.0 over median 1.0
    assert rec["ratio_rounds"] == [2.0, 4.0, 1.0, 2.0] and rec["ratio_range"] == [1.0, 4.0]
    assert rec["ratio_iqr"] == [1.75, 2.5]
    assert rec["ratio_cpu"] == 1.0 and rec["median_main_cpu_s"] == {"a": 0.5, "b": 0.5}


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke(script: str, tmp_path):
    env = {**os.environ, "PIPEC_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{script} --smoke exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"{script} --smoke printed nothing"
    for line in lines:
        rec = json.loads(line)
        assert isinstance(rec, dict), line
        missing = [k for k in SHARED if k not in rec]
        assert not missing, f"{script}: {missing} missing in {line[:300]}"
        assert rec["benchmark"], line
        assert len(rec["load_avg_start"]) == len(rec["load_avg_end"]) == 3, line
        if "ratio_of" in rec:  # a side-by-side record: the median ratio and its spread over the rounds
            lo, hi = rec["ratio_range"]
            assert lo <= hi and rec["ratio"] > 0, line
            assert len(rec["ratio_iqr"]) == 2, line
