"""Every benchmark's smallest configuration runs, and prints its lines in the shared format (issue 31, item 4).

A benchmark that nothing runs rots silently: a renamed field or a changed `--json` shape breaks it, and the
next reader finds a KeyError instead of a figure. Here each `benchmarks/*.py` that is a benchmark runs with
`--smoke` (one round, the smallest sizes, seconds) as a subprocess, and every line it prints must be a JSON
object carrying the fields `benchmarks/sidebyside.emit` adds (the benchmark's name, the load average at the
record's start and end, its wall and CPU time) and, for a side-by-side record, the ratio with its spread over
the rounds. One test per script, so pytest-xdist spreads them.

Not run here (`EXCLUDED`, each with its reason): the helpers, which are modules other benchmarks import, and
the GPU check, which needs a CUDA device and is run by hand on one.
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
    "gpu_check.py": "needs a CUDA GPU; run by hand on one (docs/runtime.md)",
    "torchtitan_train.py": "needs its own environment with torchtitan 0.2.2 (--setup installs it from the network)",
}
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in EXCLUDED)
SHARED = ("benchmark", "load_avg_start", "load_avg_end", "record_wall_s", "record_cpu_s")
TIMEOUT_S = 240  # generous: the machine is shared; a smoke run takes seconds when it is quiet


def test_every_script_is_run_or_excluded():
    """A new benchmark is smoked unless it is added to EXCLUDED with a reason; excluded names exist."""
    names = {p.name for p in BENCH.glob("*.py")}
    assert set(EXCLUDED) <= names
    assert len(SCRIPTS) + len(EXCLUDED) == len(names)


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
