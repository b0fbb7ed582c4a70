"""Memory in the runtime: the saved-tensor holders' byte counts (pipec.runtime.exec.saved), recompute and
offload as the executor runs them, the bytes `pipec profile` counts, and `pipec run --memory`'s predicted
against measured peaks. One two-process run (recompute and offload, against the reference); the rest in
one process."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from repo import ROOT

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from pipec.api import load  # noqa: E402
from pipec.driver import memory_overrides  # noqa: E402
from pipec.formats.program_file import to_json  # noqa: E402
from pipec.ir.schedule import MemOp, Schedule  # noqa: E402
from pipec.passes.compiler import compile_schedule  # noqa: E402
from pipec.runtime import LocalPipeline, PipelineError, Reference, StageOptions, load_model  # noqa: E402
from pipec.runtime.exec.saved import DEVICE, HOST, Pool, module_storages  # noqa: E402
from pipec.runtime.exec.stage import Stage  # noqa: E402
from pipec.runtime.profile.held import stage_bytes  # noqa: E402
from pipec.runtime.profile.stages import profile  # noqa: E402
from pipec.runtime.reference import compare  # noqa: E402
from pipec.sim.memory import program_memory  # noqa: E402

MLP = str(ROOT / "examples" / "mlp.py")
SMALL = {"MLP_DEPTH": "8", "MLP_BATCH": "16", "MLP_WIDTH": "32"}  # examples/mlp.py, smaller: 2 blocks a stage


@pytest.fixture
def small(monkeypatch):
    for k, v in SMALL.items():
        monkeypatch.setenv(k, v)
    return load_model(MLP)


def with_memops(sched: Schedule, recompute: set[int] = frozenset(), offload: set[int] = frozenset()) -> Schedule:
    """Every micro-batch of the stages in `recompute` recomputed just before its B; of those in `offload`
    offloaded just after its F and reloaded just before its B."""
    per_rank = []
    for ops in sched.ranks:
        kind, mb, st = ops.kind.tolist(), ops.mb.tolist(), ops.stage.tolist()
        mem = []
        for j, (k, i, s) in enumerate(zip(kind, mb, st)):
            if k == 0 and s in offload:
                mem.append(MemOp("OFFLOAD", i, s, j + 1))
            if k == 1 and s in offload:
                mem.append(MemOp("RELOAD", i, s, j))
            if k == 1 and s in recompute:
                mem.append(MemOp("RECOMPUTE", i, s, j))
        per_rank.append(tuple(sorted(mem, key=lambda m: m.before)))
    return dataclasses.replace(sched, memops=tuple(per_rank))


def block() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(8, 8).double(), torch.randn(4, 8, dtype=torch.float64)


def f(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = nn.functional.gelu(lin(x))
    return (y * y).sum()  # mul saves y twice: one storage


# ---- the holders -----------------------------------------------------------------------------------


def test_the_pool_counts_activations_once_each_and_not_parameters():
    lin, x = block()
    pool = Pool()
    xg = x.clone().requires_grad_()
    with pool.saving(0, 1, module_storages(lin)):
        loss = f(lin, xg)
    one = 4 * 8 * 8  # bytes of a 4 x 8 float64 activation
    # saved: x (the matmul's input), the matmul's output (GELU's input) and y (twice); not the weight
    assert pool.bytes[DEVICE] == pool.held(0, 1) == 3 * one
    loss.backward()
    pool.release(0, 1)
    assert pool.bytes[DEVICE] == 0 and pool.peaks().device == 3 * one and pool.peaks().host == 0
    got = (xg.grad.clone(), lin.weight.grad.clone())
    lin.zero_grad()
    xr = x.clone().requires_grad_()
    f(lin, xr).backward()  # no hooks: the same gradients
    assert torch.equal(got[0], xr.grad) and torch.equal(got[1], lin.weight.grad)


def test_offload_and_reload_move_the_bytes_between_pools_and_the_backward_waits_for_the_reload():
    lin, x = block()
    pool = Pool()
    with pool.saving(0, 0, module_storages(lin)):
        loss = f(lin, x.clone().requires_grad_())
    held = pool.bytes[DEVICE]
    pool.offload(0, 0)
    assert (pool.bytes[DEVICE], pool.bytes[HOST]) == (0, held)
    with pytest.raises(PipelineError, match="offloaded"):
        pool.ready(0, 0)
    with pytest.raises(PipelineError, match="OFFLOAD 0 0"):
        pool.offload(0, 0)
    pool.reload(0, 0)
    assert (pool.bytes[DEVICE], pool.bytes[HOST]) == (held, 0)
    pool.ready(0, 0)
    loss.backward()
    pool.release(0, 0)
    assert pool.bytes == {DEVICE: 0, HOST: 0} and pool.peaks() == type(pool.peaks())(held, held, None)
    with pytest.raises(PipelineError, match="nothing of it is offloaded"):
        pool.reload(0, 0)


def test_a_saved_tensor_used_after_release_is_an_error_not_a_wrong_gradient():
    lin, x = block()
    pool = Pool()
    with pool.saving(0, 0, module_storages(lin)):
        loss = f(lin, x.clone().requires_grad_())
    pool.release(0, 0)
    with pytest.raises(PipelineError, match="after its holder was released"):
        loss.backward()


# ---- recompute ------------------------------------------------------------------------------------


def _stage(index: int, num: int, split_backward: bool, pool: Pool | None) -> Stage:
    torch.manual_seed(1)
    mod = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 8)).double()
    loss = (lambda out, y: ((out - y) ** 2).mean()) if index == num - 1 else None
    st = Stage(index, num, mod, loss, 0.5, split_backward, None)
    st.pool = pool
    return st


@pytest.mark.parametrize("split_backward", [False, True])
@pytest.mark.parametrize("index", [1, 2])  # a middle stage (with input gradient) and the last (with the loss)
def test_recompute_gives_the_plain_forwards_gradients(split_backward, index):
    x = torch.randn(4, 8, dtype=torch.float64)
    y = torch.randn(4, 8, dtype=torch.float64)
    g = torch.randn(4, 8, dtype=torch.float64)
    results = []
    for recompute in (False, True):
        pool = Pool() if recompute else None
        st = _stage(index, 3, split_backward, pool)
        torch.manual_seed(7)  # the dropout mask's draw
        out = st.forward(0, (x.clone(),), y if index == 2 else None, keep_input_only=recompute)
        if recompute:
            assert pool.held(0, index) == 4 * 8 * 8  # only the input, until RECOMPUTE
            torch.manual_seed(99)  # other draws in between: the recompute replays the FWD's
            torch.rand(5)
            st.recompute(0)
            assert pool.held(0, index) > 4 * 8 * 8
        dx = st.backward(0, None if index == 2 else (g,))
        if split_backward:
            st.wgrad(0)
        assert st.check_done() == []
        grads = [p.grad.clone() for p in st.module.parameters()]
        results.append((out, dx, grads, st.loss))
    (o0, d0, g0, l0), (o1, d1, g1, l1) = results
    if index == 1:
        assert torch.equal(o0[0], o1[0])
    else:
        assert torch.equal(l0, l1)  # the loss is counted once, at the FWD
    assert torch.allclose(d0[0], d1[0], rtol=1e-10, atol=0)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=1e-10, atol=0)


# ---- the bytes pipec profile counts ---------------------------------------------------------------


def test_stage_bytes_of_the_mlp_are_its_saved_tensors(small):
    model = small
    mlp = sys.modules[model.build_stage.__module__]
    prog = compile_schedule(load("zb-v", p=2, m=4)).program  # 4 stages, split backward
    got = stage_bytes(prog, model)
    rows, w, blocks = mlp.BATCH // 4, mlp.WIDTH, mlp.DEPTH // 4
    act = rows * w * 8  # one float64 activation of a micro-batch
    # each block saves its input (the matmul's) and the matmul's output (GELU's); stage 0's first input is data
    assert got["saved_bytes"][0] == (2 * blocks - 1) * act
    assert got["saved_bytes"][1] == got["saved_bytes"][2] == 2 * blocks * act
    assert got["saved_bytes"][3] == 2 * blocks * act + act + rows * 8  # the head's input, the loss's input
    assert got["input_bytes"] == [0, act, act, act]
    assert got["wsaved_bytes"] == got["saved_bytes"]  # split backward keeps the graph whole until W
    n = blocks * (w * w + w) * 8
    # Adam: parameters, gradients, two moments, and a step counter (float32) per parameter tensor
    assert got["state_bytes"][0] == 4 * n + 2 * blocks * 4
    doc = profile(prog, model, reps=1, warmup=0, comm=False, concurrent=False, threads=1).cost_doc()
    for key in ("saved_bytes", "wsaved_bytes", "input_bytes", "state_bytes"):
        assert doc[key] == got[key]
    assert len(doc["offload"]) == 4 and all(t > 0 for t in doc["offload"])


# ---- predicted against measured -------------------------------------------------------------------


def test_measured_peaks_equal_the_model_and_recompute_lowers_them(small):
    model = small
    kw = dict(optimizer=model.optimizer, dtype=model.dtype)
    measured = {}
    for recompute in (frozenset(), frozenset({0, 1, 2, 3})):
        sched = with_memops(load("zb-v", p=2, m=4), recompute=recompute)
        prog = compile_schedule(sched).program
        pipe = LocalPipeline(prog, model.build_stage, model.loss_fn, options=StageOptions(**kw))
        assert all(r.executor.pool is None for r in pipe.runners)  # no hooks unless measuring or offloading
        for r in pipe.runners:
            r.executor.measure_memory()
        ref = Reference(model.build_stage, model.loss_fn, 4, 4, **kw)
        x, y = model.batch(0)
        pipe.step(x, y)
        ref.step(x, y)
        assert max(compare(pipe.named_gradients(), ref.named_gradients()).values()) <= 1e-10
        predicted = program_memory(prog, sched, memory_overrides([stage_bytes(prog, model)]))
        for rep, runner in zip(predicted, pipe.runners):
            assert abs(runner.executor.peaks.device - (rep.peak - rep.params)) <= 0.05 * (rep.peak - rep.params)
        measured[bool(recompute)] = [r.executor.peaks.device for r in pipe.runners]
    assert all(a < b for a, b in zip(measured[True], measured[False]))


@pytest.mark.slow  # the same in one process: test_recompute_gives_the_plain_forwards_gradients, the offload tests
def test_a_two_process_run_with_recompute_and_offload_equals_the_reference(tmp_path):
    sched = with_memops(load("zb-v", p=2, m=4), recompute={0, 3}, offload={1, 2})
    path = tmp_path / "prog.json"
    path.write_text(to_json(compile_schedule(sched).program))
    env = dict(os.environ, OMP_NUM_THREADS="1", **SMALL)
    cmd = [sys.executable, "-m", "pipec", "run", str(path), "--model", MLP, "--nproc", "2", "--steps", "2"]
    r = subprocess.run([*cmd, "--check", "--memory"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("OK: largest relative error") for line in lines), r.stdout
    at = next(i for i, line in enumerate(lines) if line.startswith("peak saved activations per rank"))
    assert lines[at + 1].split() == ["rank", "device", "predicted", "measured", "error", "host"] + [
        "predicted",
        "measured",
        "error",
    ]
    rows = [line.split() for line in lines[at + 2 : at + 4]]
    for row in rows:  # every pool with something predicted: measured as predicted, within 5%
        errs = [float(c.rstrip("%")) for c in row if c.endswith("%")]
        assert errs and all(abs(e) <= 5 for e in errs), row
    assert rows[1][-1].endswith("%") and rows[0][-1] == "-"  # rank 1 (stages 1, 2) offloads, rank 0 does not


def test_a_recomputed_forward_that_is_offloaded_moves_its_input_and_recomputes_from_the_reload(small):
    model = small
    kw = dict(optimizer=model.optimizer, dtype=model.dtype)
    sched = with_memops(load("1f1b", p=2, m=4), recompute={0, 1}, offload={0, 1})  # both, on every (mb, stage)
    prog = compile_schedule(sched).program
    pipe = LocalPipeline(prog, model.build_stage, model.loss_fn, options=StageOptions(**kw))
    for r in pipe.runners:
        r.executor.measure_memory()
    ref = Reference(model.build_stage, model.loss_fn, 2, 4, **kw)
    x, y = model.batch(0)
    pipe.step(x, y)
    ref.step(x, y)
    assert max(compare(pipe.named_gradients(), ref.named_gradients()).values()) <= 1e-10
    predicted = program_memory(prog, sched, memory_overrides([stage_bytes(prog, model)]))
    host = [r.executor.peaks.host for r in pipe.runners]
    assert host[1] > 0  # stage 1's kept input went to the host (stage 0's is the step's data: not counted)
    for rep, runner in zip(predicted, pipe.runners):
        assert runner.executor.peaks.device == rep.peak - rep.params
        assert runner.executor.peaks.host == rep.host_peak
