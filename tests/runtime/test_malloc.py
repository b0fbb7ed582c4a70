"""Freed memory kept (pipec.runtime.host.malloc): a step's large tensors reuse their pages instead of faulting
in fresh ones, and the opt-outs. Each case in a child process: the setting is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipec.runtime.host import malloc

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")

CHILD = """
import resource
from pipec.runtime.host.malloc import keep_freed_memory
print(keep_freed_memory())
def churn(n):  # what a step does: allocate its tensors (4 of 8 MiB, every page written), free them
    for _ in range(n):
        b = [bytearray(b"x") * (8 << 20) for _ in range(4)]
        del b
churn(3)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn(10)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(env_extra: dict) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "PIPEC_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", CHILD], env={**env, **env_extra}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    how, count = out.stdout.split("\n")[:2]
    return how, int(count)


@glibc
def test_kept_memory_faults_no_pages_in_again_and_the_default_does():
    how, kept = faults({})
    assert how.startswith("freed memory kept")
    sys_how, default = faults({"PIPEC_MALLOC": "system"})
    assert sys_how.startswith("glibc's defaults")
    # 10 rounds of 32 MiB are 81,920 pages: glibc's default trims the freed top and faults them in anew
    assert default > 20_000, default
    assert kept < 500, kept


def test_the_environment_and_the_opt_out_win(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000")
    assert malloc._apply() == "the environment's MALLOC_*_THRESHOLD_"
    monkeypatch.setenv("PIPEC_MALLOC", "system")
    assert malloc._apply().startswith("glibc's defaults")
