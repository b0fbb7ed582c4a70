"""Compiled stages (issue 43, part 3): each stage's forward through torch.compile, its backward AOTAutograd's,
split backward included (B the input gradient, W the weight gradient), gradients equal to the single-process
float64 reference. Compiling costs tens of seconds a stage on these cores: one --local case by default (ZB-H1:
split backward on both stages, the first stage deferring its whole backward to W, the second computing both at
B); `pipec run ... --nproc 2 --compile --check` and PipelineSchedule(compile=True) behind `-m slow`. The
--cuda-graphs refusal on the CPU needs no compile and runs by default."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from repo import ROOT  # noqa: E402

from pipec.api import load  # noqa: E402
from pipec.passes.compiler import compile_schedule  # noqa: E402
from pipec.runtime import LocalPipeline, Reference, StageOptions, load_model  # noqa: E402
from pipec.runtime.reference import compare, rel_err  # noqa: E402

TOL = 1e-10
SMALL = {"MLP_WIDTH": "16", "MLP_DEPTH": "4", "MLP_BATCH": "8", "MLP_DTYPE": "float64"}


@pytest.fixture(scope="module")
def mlp():
    mp = pytest.MonkeyPatch()
    for k, v in SMALL.items():
        mp.setenv(k, v)
    model = load_model(str(ROOT / "examples" / "mlp.py"))
    mp.undo()
    return model


def test_compiled_split_backward_equals_reference(mlp):
    torch.set_num_threads(1)
    prog = compile_schedule(load("zb-h1", p=2, m=4)).program
    assert prog.split_backward
    kw = dict(optimizer=mlp.optimizer, dtype=mlp.dtype)
    pipe = LocalPipeline(prog, mlp.build_stage, mlp.loss_fn, options=StageOptions(**kw, compile=True))
    ref = Reference(mlp.build_stage, mlp.loss_fn, prog.num_stages, prog.num_sequences, **kw)
    for step in range(3):
        x, y = mlp.batch(step)
        out = pipe.step(x, y)
        ref_loss = ref.step(x, y)
        assert rel_err(out.loss, ref_loss) <= TOL
        grads = compare(pipe.named_gradients(), ref.named_gradients())
        assert grads and max(grads.values()) <= TOL, grads
    params = compare(pipe.named_parameters(), ref.named_parameters())
    assert max(params.values()) <= TOL, params
    stages = [st for r in pipe.runners for st in r.stages.values()]
    assert stages and all(st.compiled and st.module._pipec_compiled for st in stages)
    # the compiled backward is one autograd node (which is why B computes both gradients: split_backward's whole)
    second = next(st for st in stages if st.index == 1)
    x = torch.zeros(8 // 4, 16, dtype=torch.float64, requires_grad=True)
    assert "CompiledFunction" in type(second.module(x).grad_fn).__name__


def test_cuda_graphs_on_the_cpu_is_refused_clearly():
    r = subprocess.run(
        [sys.executable, "-m", "pipec", "run", "1f1b", "-D", "p=2", "-D", "m=4", "--model", "examples/mlp.py",
         "--nproc", "2", "--cuda-graphs"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "needs CUDA" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_pipec_run_compile_check_over_two_processes():
    """The default case's twin over gloo: the issue's command."""
    cmd = ["run", "zb-h1", "-D", "p=2", "-D", "m=4", "--model", "examples/mlp.py", "--nproc", "2", "--compile"]
    r = subprocess.run(
        [sys.executable, "-m", "pipec", *cmd, "--check"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stages through torch.compile" in r.stdout and "OK: largest relative error" in r.stdout, r.stdout
    assert "steps 2-3: 0" in r.stdout, r.stdout  # receive buffers: none after the first step
