"""examples/gpt.py, the small GPT: exact against the single-process reference over 2 gloo processes (one
split-backward schedule: attention, LayerNorm and embeddings go through the split autograd graph), and its
loss falls in --local mode. A smaller configuration than the documented one, to stay cheap."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from runtime_harness import ROOT, launch  # noqa: E402

from pipec.api import load  # noqa: E402
from pipec.passes.compiler import compile_schedule  # noqa: E402
from pipec.runtime import LocalPipeline, StageOptions, load_model  # noqa: E402

SMALL = {"GPT_LAYERS": "2", "GPT_WIDTH": "16", "GPT_HEADS": "2", "GPT_CONTEXT": "8", "GPT_BATCH": "8"}


@pytest.mark.slow  # the GPT in --local (test_runtime_slices), processes with the MLP (test_runtime_dist)
def test_gpt_dist_check_p2():
    argv = ["zb-h1", "-D", "p=2", "-D", "m=4", "--model", "examples/gpt.py", "--steps", "3", "--check"]
    results, _, _ = launch(2, "launch", argv, env=SMALL, timeout=120)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stdout}\n{r.stderr[-3000:]}"
    out = results[0].stdout
    assert re.search(r"OK: largest relative error \S+ \(tolerance 1e-10\)", out), out
    assert len(re.findall(r"^step \d/3: loss", out, re.M)) == 3


def test_gpt_loss_falls_local(monkeypatch):
    for k, v in {**SMALL, "GPT_WIDTH": "32", "GPT_LR": "1e-2"}.items():
        monkeypatch.setenv(k, v)
    model = load_model(str(ROOT / "examples" / "gpt.py"))
    program = compile_schedule(load("1f1b", p=2, m=2)).program
    pipe = LocalPipeline(
        program, model.build_stage, model.loss_fn, options=StageOptions(optimizer=model.optimizer, dtype=model.dtype)
    )
    losses = [pipe.step(*model.batch(step)).loss for step in range(12)]
    assert losses[0] > 3.0  # about ln(vocabulary) at the start
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
