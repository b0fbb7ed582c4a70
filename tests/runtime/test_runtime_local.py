"""--local mode (every rank in this process, in-memory messages): every library schedule, p=2 and p=4
(v=2 where it applies), float64, trains exactly like the single-process reference."""

from __future__ import annotations

import pytest
from library_cases import schedule_params
from repo import ROOT

torch = pytest.importorskip("torch")


from pipec.api import load  # noqa: E402
from pipec.frontend import library  # noqa: E402
from pipec.ir.program import RECV_ACT, RECV_GRAD, WGRAD  # noqa: E402
from pipec.passes.compiler import compile_schedule  # noqa: E402
from pipec.runtime import LocalPipeline, Reference, StageOptions, Transport, load_model  # noqa: E402
from pipec.runtime.reference import compare, rel_err  # noqa: E402

TOL = 1e-10


@pytest.fixture(scope="module")
def sliced_gpt():
    """Token slices need the key/value cache interface (pipec.runtime.exec.slices): examples/gpt.py, small."""
    mp = pytest.MonkeyPatch()
    for k, v in {"GPT_LAYERS": "4", "GPT_WIDTH": "16", "GPT_HEADS": "2", "GPT_CONTEXT": "8", "GPT_BATCH": "8"}.items():
        mp.setenv(k, v)
    model = load_model(str(ROOT / "examples" / "gpt.py"))
    mp.undo()
    return model


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    for k, v in {"MLP_WIDTH": "16", "MLP_DEPTH": "8", "MLP_BATCH": "16", "MLP_DTYPE": "float64"}.items():
        mp.setenv(k, v)
    model = load_model(str(ROOT / "examples" / "mlp.py"))
    mp.undo()
    return model


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", library.names())
def test_local_equals_reference(name, p, mlp, sliced_gpt):
    torch.set_num_threads(1)
    prog = compile_schedule(load(name, **schedule_params(name, p))).program
    if prog.slicing is not None and prog.slicing.slices > 1:
        mlp = sliced_gpt  # checked against the unsliced reference of its sequences
    kw = dict(optimizer=mlp.optimizer, dtype=mlp.dtype)
    pipe = LocalPipeline(prog, mlp.build_stage, mlp.loss_fn, options=StageOptions(**kw))
    ref = Reference(mlp.build_stage, mlp.loss_fn, prog.num_stages, prog.num_sequences, **kw)
    for step in range(3):
        x, y = mlp.batch(step)
        out = pipe.step(x, y)
        ref_loss = ref.step(x, y)
        if step == 0:
            assert rel_err(out.loss, ref_loss) <= TOL
            grads = compare(pipe.named_gradients(), ref.named_gradients())
            assert len(grads) == len(ref.named_gradients())
            assert all(g is not None for g in pipe.named_gradients().values())
            assert max(grads.values()) <= TOL, grads
    params = compare(pipe.named_parameters(), ref.named_parameters())
    assert max(params.values()) <= TOL, params


@pytest.mark.parametrize("ahead", [1, 3, 1000])
@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-v", "dualpipe-v"])
def test_receives_posted_ahead(name, ahead, mlp):
    """recv_ahead=N: when the loop reaches a compute op, exactly the receives the Program places before it
    plus the next N (in stream order) are posted, and training is unchanged (bit for bit: same ops, same
    order; only the posts move)."""
    torch.set_num_threads(1)
    prog = compile_schedule(load(name, **schedule_params(name, 4))).program
    kw = dict(optimizer=mlp.optimizer, dtype=mlp.dtype)
    x, y = mlp.batch(0)
    base = LocalPipeline(prog, mlp.build_stage, mlp.loss_fn, options=StageOptions(**kw))
    early = LocalPipeline(
        prog, mlp.build_stage, mlp.loss_fn, options=StageOptions(**kw), transport=Transport(recv_ahead=ahead)
    )
    assert early.step(x, y, record=True).loss == base.step(x, y).loss
    for (k, a), b in zip(early.named_gradients().items(), base.named_gradients().values()):
        assert torch.equal(a, b), k
    for rank, events in enumerate(early.events()):
        rp = prog.ranks[rank]
        is_recv = (rp.op == RECV_ACT) | (rp.op == RECV_GRAD)
        computes = [j for j, op in enumerate(rp.op.tolist()) if op <= WGRAD]
        total = int(is_recv.sum())
        posted = 0
        seen = []
        for e in events:
            if e[0] == "post":
                posted += 1
                seen.append(e[1:4])
            elif e[0] == "compute":
                j = computes.pop(0)
                assert posted == min(total, int(is_recv[:j].sum()) + ahead), (rank, j)
        program_order = [
            (0, mb, s - 1) if op == RECV_ACT else (1, mb, s + 1)
            for op, mb, s in zip(rp.op.tolist(), rp.mb.tolist(), rp.stage.tolist())
            if op in (RECV_ACT, RECV_GRAD)
        ]
        assert seen == program_order
