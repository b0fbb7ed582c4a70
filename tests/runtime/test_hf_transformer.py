"""examples/hf_gpt2.py, Hugging Face's GPT2LMHeadModel split by module names: its stages in sequence (and its
`layers()`) compute what the unsplit transformers model computes, each parameter on exactly one stage; and
ZB-V over 4 gloo processes (8 stages in a V, split backward through transformers' attention) equals the
single-process reference in float64. A smaller configuration than the documented one, to stay cheap; the
other schedules and the 50-step loss curve are in docs/transformer.md."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]' or '.[test]')")

from runtime_harness import ROOT, launch  # noqa: E402

from pipec.runtime import load_model  # noqa: E402

SMALL = {"HF_LAYERS": "8", "HF_WIDTH": "16", "HF_HEADS": "2", "HF_CONTEXT": "8", "HF_BATCH": "8"}
MODEL = str(ROOT / "examples" / "hf_gpt2.py")


@pytest.fixture
def hf(monkeypatch):
    for k, v in SMALL.items():
        monkeypatch.setenv(k, v)
    model = load_model(MODEL)
    return model, model.build_stage.__globals__  # the model file's module namespace


def test_stages_compute_the_transformers_model(hf):
    model, ns = hf
    x, _ = model.batch(0)
    whole = ns["whole_model"]().double()
    expect = whole(x).logits
    names = {n for n, _ in whole.named_parameters()}
    for S in (1, 3, 8):
        h, seen = x, []
        for s in range(S):
            stage = model.build_stage(s, S).double()
            seen += [n for n, _ in stage.named_parameters()]
            h = stage(h)
        assert sorted(seen) == sorted(names)  # the whole model's names, each on exactly one stage
        assert (h - expect).abs().max().item() <= 1e-12 * expect.abs().max().item(), S
    h = x
    for _, layer in ns["layers"]():
        h = layer.double()(h)
    assert (h - expect).abs().max().item() <= 1e-12 * expect.abs().max().item()
    with pytest.raises(ValueError, match="HF_LAYERS >= 9"):
        ns["stage_fqns"](9)


@pytest.mark.slow  # GPT-2 through the split in float64: test_split_semantics; over gloo: test_schedule_api's two ranks
def test_hf_gpt2_zbv_p4_check():
    argv = ["zb-v", "-D", "p=4", "-D", "m=8", "--model", "examples/hf_gpt2.py", "--steps", "1", "--check"]
    results, _, _ = launch(4, "launch", argv, env=SMALL, timeout=400)  # a hang guard: seconds when the machine is idle
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stdout}\n{r.stderr[-3000:]}"
    out = results[0].stdout
    assert re.search(r"OK: largest relative error \S+ \(tolerance 1e-10\)", out), out
    assert "8 stages on 4 ranks" in out and "4 processes" in out, out
    assert len(re.findall(r"^step 1/1: loss", out, re.M)) == 1
