"""Token slices (TeraPipe) in the runtime: a sliced run of examples/gpt.py trains exactly like the UNSLICED
single-process reference (float64, 1e-10) for 2 and 4 slices (and an uneven cut) at p=2 and p=4, in GPipe's
and 1F1B's order over (sequence, slice) units, with split backward (F, B, W) too; one case over two gloo
processes; and a model without the key/value cache interface is refused before anything runs."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from runtime_harness import ROOT, launch  # noqa: E402

from pipec.api import load  # noqa: E402
from pipec.passes.compiler import compile_schedule  # noqa: E402
from pipec.runtime import LocalPipeline, Reference, StageOptions, load_model  # noqa: E402
from pipec.runtime.errors import ModelError  # noqa: E402
from pipec.runtime.reference import compare, rel_err  # noqa: E402

TOL = 1e-10
SMALL = {"GPT_LAYERS": "4", "GPT_WIDTH": "16", "GPT_HEADS": "2", "GPT_CONTEXT": "8", "GPT_BATCH": "4"}

# GPipe's order over units: every forward, then every backward, each sequence's slices last to first.
GPIPE = """
schedule "tp-gpipe" (p: int = 2, m: int = 2, n: int = 2, L: int = 8) {
    stages p
    slices n
    seqlen L
    ops F, B
    rank r {
        for i in 0 .. m { for j in 0 .. n { F(i, slice: j) } }
        for i in 0 .. m { for j in 0 .. n { B(i, slice: n - 1 - j) } }
    }
}
"""

# 1F1B's order over units: n - 1 more warm-up forwards than the unsliced 1F1B (the last stage needs a
# sequence's last slice before that sequence's first backward); with `W`, each backward split.
F1B1 = """
schedule "tp-1f1b" (p: int = 2, m: int = 2, n: int = 2, L: int = 8) {
    stages p
    slices n
    seqlen L
    ops F, B{W}
    rank r {
        let units = m * n
        let warm = min(p - r + n - 2, units)
        for k in 0 .. warm { F(k // n, slice: k % n) }
        for k in 0 .. units - warm {
            F((k + warm) // n, slice: (k + warm) % n)
            B(k // n, slice: n - 1 - k % n){W}
        }
        for k in units - warm .. units { B(k // n, slice: n - 1 - k % n){W} }
    }
}
"""


def schedule_text(order: str, split: bool) -> str:
    if order == "gpipe":
        return GPIPE
    w = "  W(k // n, slice: n - 1 - k % n)" if split else ""
    return F1B1.replace("ops F, B{W}", "ops F, B, W" if split else "ops F, B").replace("{W}", w)


def program(tmp_path, order: str, split: bool, **params):
    path = tmp_path / f"{order}{'-w' if split else ''}.pipe"
    path.write_text(schedule_text(order, split))
    return compile_schedule(load(str(path), **params)).program


@pytest.fixture(scope="module")
def gpt():
    mp = pytest.MonkeyPatch()
    for k, v in SMALL.items():
        mp.setenv(k, v)
    model = load_model(str(ROOT / "examples" / "gpt.py"))
    mp.undo()
    return model


CASES = [
    ("gpipe", False, 2, 2),
    ("gpipe", False, 4, 4),
    ("gpipe", False, 2, 3),  # 8 tokens in slices of 3, 3, 2
    ("1f1b", False, 2, 4),
    ("1f1b", False, 4, 2),
    ("1f1b", True, 2, 2),
    ("1f1b", True, 4, 4),
]


@pytest.mark.parametrize("order,split,p,n", CASES)
def test_sliced_equals_unsliced_reference(order, split, p, n, gpt, tmp_path):
    torch.set_num_threads(1)
    prog = program(tmp_path, order, split, p=p, m=2, n=n, L=8)
    assert prog.slicing.slices == n and prog.split_backward == split
    assert sum(prog.slicing.tokens) == 8 and prog.num_microbatches == 2 * n
    kw = dict(optimizer=gpt.optimizer, dtype=gpt.dtype)
    pipe = LocalPipeline(prog, gpt.build_stage, gpt.loss_fn, options=StageOptions(**kw))
    ref = Reference(gpt.build_stage, gpt.loss_fn, prog.num_stages, prog.num_sequences, **kw)  # unsliced
    for step in range(2):
        x, y = gpt.batch(step)
        out = pipe.step(x, y)
        ref_loss = ref.step(x, y)
        assert rel_err(out.loss, ref_loss) <= TOL, (out.loss, ref_loss)
        if step == 0:
            grads = compare(pipe.named_gradients(), ref.named_gradients())
            assert len(grads) == len(ref.named_gradients())
            assert all(g is not None for g in pipe.named_gradients().values())
            assert max(grads.values()) <= TOL, grads
    params = compare(pipe.named_parameters(), ref.named_parameters())
    assert max(params.values()) <= TOL, params
    for runner in pipe.runners:  # every slice's cache entry went with its backward
        for st in runner.stages.values():
            assert st.kv is not None and not st.kv.buffers and not st.kv.kept and not st.kv.units


def test_slices_change_the_computation(gpt, tmp_path):
    """The check above is not vacuous: a cache that hides the earlier slices (each slice attending to
    itself only) gives other gradients."""
    torch.set_num_threads(1)
    prog = program(tmp_path, "gpipe", False, p=2, m=2, n=2, L=8)
    kw = dict(optimizer=gpt.optimizer, dtype=gpt.dtype)
    pipe = LocalPipeline(prog, gpt.build_stage, gpt.loss_fn, options=StageOptions(**kw))
    for runner in pipe.runners:
        for st in runner.stages.values():
            st.kv.past = lambda unit: ((), ())
    ref = Reference(gpt.build_stage, gpt.loss_fn, prog.num_stages, prog.num_sequences, **kw)
    x, y = gpt.batch(0)
    pipe.step(x, y)
    ref.step(x, y)
    assert max(compare(pipe.named_gradients(), ref.named_gradients()).values()) > 1e-3


def test_model_without_cache_interface(tmp_path, monkeypatch):
    monkeypatch.setenv("MLP_DTYPE", "float64")
    mlp = load_model(str(ROOT / "examples" / "mlp.py"))
    prog = program(tmp_path, "gpipe", False, p=2, m=2, n=2, L=8)
    with pytest.raises(ModelError) as e:
        LocalPipeline(prog, mlp.build_stage, mlp.loss_fn, options=StageOptions(dtype=mlp.dtype))
    msg = str(e.value)
    assert msg.startswith("stage 0's module (Sequential, from build_stage) has no key/value cache interface")
    assert "keyword argument `past_kv`" in msg and "module(*inputs, past_kv=past) -> (output, kv)" in msg


def test_sequence_length_must_match_seqlen(gpt, tmp_path):
    prog = program(tmp_path, "gpipe", False, p=2, m=2, n=2, L=6)
    pipe = LocalPipeline(prog, gpt.build_stage, gpt.loss_fn, options=StageOptions(dtype=gpt.dtype))
    with pytest.raises(Exception, match=r"slices of 3, 3 tokens \(6 in all, along dim 1\).*shape \[2, 8\]"):
        pipe.step(*gpt.batch(0))


def test_sliced_gloo_two_processes(tmp_path):
    path = tmp_path / "tp.pipe"
    path.write_text(schedule_text("1f1b", True))
    argv = [str(path), "-D", "p=2", "-D", "m=2", "-D", "n=2", "-D", "L=8", "--model", "examples/gpt.py"]
    results, _, _ = launch(2, "launch", [*argv, "--steps", "2", "--check"], env=SMALL, timeout=120)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stdout}\n{r.stderr[-3000:]}"
    out = results[0].stdout
    assert re.search(r"OK: largest relative error \S+ \(tolerance 1e-10\)", out), out
    assert len(re.findall(r"^step \d/2: loss", out, re.M)) == 2
