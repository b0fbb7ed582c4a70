"""Variable-length micro-batches (examples/varlen.py): micro-batches of different lengths in one step and
lengths that change between steps train exactly like the single-process reference on the same
micro-batches (float64, 1e-10), and the shapes are exchanged again only at a step whose lengths changed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_harness import ROOT  # noqa: E402

from pipec.api import load  # noqa: E402
from pipec.passes.compiler import compile_schedule  # noqa: E402
from pipec.runtime import LocalPipeline, Reference, StageOptions, load_model  # noqa: E402
from pipec.runtime.errors import PipelineError, ShapeError  # noqa: E402
from pipec.runtime.exec.microbatch import MicroBatches, batch_of  # noqa: E402
from pipec.runtime.reference import compare, rel_err  # noqa: E402

TOL = 1e-10
SMALL = {"GPT_LAYERS": "2", "GPT_WIDTH": "16", "GPT_HEADS": "2", "GPT_CONTEXT": "8", "VARLEN_ROWS": "2"}


@pytest.fixture(scope="module")
def varlen():
    mp = pytest.MonkeyPatch()
    for k, v in SMALL.items():
        mp.setenv(k, v)
    model = load_model(str(ROOT / "examples" / "varlen.py"))
    lengths = model.batch.__globals__["lengths"]
    mp.undo()
    return model, lengths


SCHEDULES = [("1f1b", {"p": 2, "m": 4}), ("zb-h1", {"p": 2, "m": 4}), ("interleaved-1f1b", {"p": 2, "v": 2, "m": 4})]


@pytest.mark.parametrize("name,params", SCHEDULES)
def test_varlen_equals_reference_and_exchanges_on_change(name, params, varlen):
    torch.set_num_threads(1)
    model, lengths = varlen
    prog = compile_schedule(load(name, **params)).program
    kw = dict(optimizer=model.optimizer, dtype=model.dtype)
    pipe = LocalPipeline(prog, model.build_stage, model.loss_fn, options=StageOptions(**kw))
    ref = Reference(model.build_stage, model.loss_fn, prog.num_stages, prog.num_sequences, **kw)
    steps = 5
    seen = [lengths(step) for step in range(steps)]
    assert any(len(set(ls)) > 1 for ls in seen)  # micro-batches of one step differ in length
    changes = 1 + sum(seen[k] != seen[k - 1] for k in range(1, steps))
    assert 1 < changes < steps  # some steps change the lengths, some keep them
    for step in range(steps):
        x, y = batch_of(model.batch(step))
        assert isinstance(x, MicroBatches) and [t.shape[1] for t in x] == seen[step]
        out = pipe.step(x, y)
        ref_loss = ref.step(x, y)
        assert rel_err(out.loss, ref_loss) <= TOL, (step, out.loss, ref_loss)
        grads = compare(pipe.named_gradients(), ref.named_gradients())
        assert len(grads) == len(ref.named_gradients()) and max(grads.values()) <= TOL, (step, grads)
        assert all(r.exchanges == 1 + sum(seen[k] != seen[k - 1] for k in range(1, step + 1)) for r in pipe.runners)
    assert all(r.exchanges == changes and r.varying for r in pipe.runners)
    params_err = compare(pipe.named_parameters(), ref.named_parameters())
    assert max(params_err.values()) <= TOL, params_err


def test_fixed_batches_still_fixed(varlen):
    """A whole batch (not micro-batches) keeps today's contract: shapes fixed at the first step, said so."""
    model, _ = varlen
    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    pipe = LocalPipeline(prog, model.build_stage, model.loss_fn, options=StageOptions(dtype=model.dtype))
    x, y = model.batch(0)[0]
    pipe.step(x, y)
    assert [r.exchanges for r in pipe.runners] == [1, 1] and not any(r.varying for r in pipe.runners)
    with pytest.raises(ShapeError, match="shapes are fixed at the first step unless the batch comes as micro-batches"):
        pipe.step(x[:, :-1], y[:, :-1])


def test_batch_list_must_hold_pairs():
    with pytest.raises(PipelineError, match=r"returned a list: it must hold one \(inputs, targets\) pair"):
        batch_of([torch.zeros(2), torch.zeros(2)])
    with pytest.raises(PipelineError, match="come as 3 micro-batches, but the Program has m=2"):
        from pipec.runtime.exec.microbatch import split

        split(MicroBatches([torch.zeros(1)] * 3), 2, "inputs")


DECLARED = """schedule "v" (p: int = 2, m: int = 4) {
    stages p
    length i -> 2 * i + 2
    ops F, B
    rank r {
        for i in 0 .. m { F(i) }
        for i in 0 .. m { B(i) }
    }
}
"""


def test_lengths_the_schedule_declares_are_checked_against_the_data(varlen):
    """The schedule's `length i -> ...` is what the simulator and the memory check priced: micro-batches of
    those lengths run quietly, others run (the gradients do not depend on it) with a warning naming the
    first micro-batch that differs."""
    import warnings

    from pipec.driver import build
    from pipec.errors import Source
    from pipec.runtime.exec.slices import LengthWarning

    model, _ = varlen
    prog = compile_schedule(build(Source("v.pipe", DECLARED))).program
    assert prog.slicing is not None and prog.slicing.lengths == (2, 4, 6, 8)
    pipe = LocalPipeline(prog, model.build_stage, model.loss_fn, options=StageOptions(dtype=model.dtype))
    text = torch.arange(64) % 7

    def pairs(lengths):
        rows = [text[: n + 1].repeat(2, 1) for n in lengths]
        return batch_of([(r[:, :-1], r[:, 1:]) for r in rows])

    with warnings.catch_warnings():
        warnings.simplefilter("error", LengthWarning)
        pipe.step(*pairs([2, 4, 6, 8]))
    with pytest.warns(
        LengthWarning, match=r"micro-batch 2 holds 7 tokens along dim 1, where the schedule's `length` declares 6"
    ):
        pipe.step(*pairs([2, 4, 7, 8]))
    with warnings.catch_warnings():  # said once a run, not at every step of the same data
        warnings.simplefilter("error", LengthWarning)
        pipe.step(*pairs([2, 4, 7, 8]))
