"""Runtime pieces in one process: the model contract, split backward, matching rules of --local mode,
shapes, the Python API's errors, and that `import pipec` stays free of torch."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
from repo import ROOT

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from pipec.api import load  # noqa: E402
from pipec.ir.program import Program, RankProgram  # noqa: E402
from pipec.passes.compiler import compile_schedule  # noqa: E402
from pipec.runtime import LocalPipeline, PipelineError, Reference, Runner, StageOptions, load_model  # noqa: E402
from pipec.runtime.errors import ModelError, ShapeError  # noqa: E402
from pipec.runtime.exec.microbatch import split  # noqa: E402
from pipec.runtime.exec.stage import Stage  # noqa: E402
from pipec.runtime.reference import compare, rel_err  # noqa: E402


def program(name: str, **params) -> Program:
    return compile_schedule(load(name, **params)).program


# ---- the model contract ------------------------------------------------------------------------------

GOOD = """
import torch
def build_stage(stage, num_stages):
    return torch.nn.Linear(4, 4)
def loss_fn(output, target):
    return ((output - target) ** 2).mean()
def batch(step):
    return torch.randn(8, 4), torch.randn(8, 4)
"""


def write(tmp_path, text: str, name: str = "model.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_load_model_good(tmp_path):
    m = load_model(write(tmp_path, GOOD + "dtype = 'float64'\ndef optimizer(params):\n    return None\n"))
    assert m.dtype is torch.float64 and m.optimizer is not None and isinstance(m.build_stage(0, 2), nn.Module)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("x = 1\n", ["missing `build_stage(stage, num_stages)`", "missing `loss_fn(output, target)`",
                     "missing `batch(step)`"]),
        (GOOD.replace("def batch(step)", "def batch()"), ["`batch` must take 1 argument(s) batch(step)"]),
        (GOOD.replace("def build_stage(stage, num_stages):", "build_stage = 3\ndef f(stage, num_stages):"),
         ["`build_stage` must be a function build_stage(stage, num_stages), not int"]),
        (GOOD + "dtype = 'float65'\n", ["`dtype` must be a torch dtype or its name"]),
        (GOOD + "def optimizer():\n    pass\n", ["`optimizer` must take 1 argument(s) optimizer(params)"]),
        ("def build_stage(:\n", ["importing the model file failed: SyntaxError"]),
        ("raise ValueError('no data here')\n", ["importing the model file failed: ValueError: no data here"]),
    ],
)  # fmt: skip
def test_load_model_errors_name_the_file_and_the_problem(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ModelError) as e:
        load_model(path)
    assert str(e.value).startswith(path + ":")
    for x in expected:
        assert x in str(e.value)


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelError, match=r"nope\.py: no such model file"):
        load_model(str(tmp_path / "nope.py"))


def test_build_stage_must_return_a_module(tmp_path):
    m = load_model(write(tmp_path, GOOD.replace("return torch.nn.Linear(4, 4)", "return 'a layer'")))
    with pytest.raises(ModelError, match=r"model\.py: build_stage\(0, 2\) returned str, not a torch.nn.Module"):
        LocalPipeline(
            program("1f1b", p=2, m=2), m.build_stage, m.loss_fn, options=StageOptions(where=f"{m.path}: build_stage")
        )


# ---- split backward ----------------------------------------------------------------------------------


class Tied(nn.Module):
    """One weight used twice, with a residual: two intermediates in one parameter group."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.norm(self.a(h) + x)


class TwoOutputs(nn.Module):
    """The second output does not depend on the input: no place to split (full backward at BWD)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Parameter(torch.randn(3, 6))

    def forward(self, x):
        return self.a(x), self.b * 2.0


MODULES = {
    "mlp": lambda: nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6)),
    "tied": Tied,
    "two_outputs": TwoOutputs,
    "conv": lambda: nn.Sequential(
        nn.Unflatten(1, (1, 6)), nn.Conv1d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(12, 6)
    ),
}  # fmt: skip


def _run_stage(module, split_backward: bool, x, grads):
    st = Stage(1, 3, module, None, 1.0, split_backward, None)
    st.forward(0, (x.clone(),))
    dx = st.backward(0, grads)
    after_bwd = {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}
    if split_backward:
        st.wgrad(0)
    return dx, after_bwd, {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_split_backward_equals_full_backward(kind):
    torch.manual_seed(0)
    module = MODULES[kind]().double()
    x = torch.randn(5, 6, dtype=torch.float64)
    with torch.no_grad():
        outs = module(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = tuple(torch.randn_like(o) for o in outs)
    dx_full, _, g_full = _run_stage(module, False, x, grads)
    module.zero_grad(set_to_none=True)
    dx_split, after_bwd, g_split = _run_stage(module, True, x, grads)
    assert rel_err(dx_split[0], dx_full[0]) <= 1e-14
    for n in g_full:
        assert rel_err(g_split[n], g_full[n]) <= 1e-14, n
    if kind != "two_outputs":
        assert all(g is None for g in after_bwd.values())  # BWD computed no weight gradient


def test_split_backward_does_no_extra_work():
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    module = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(32, 32), nn.GELU())]).double()
    x = torch.randn(16, 32, dtype=torch.float64)
    g = (torch.randn(16, 32, dtype=torch.float64),)

    def flops(split_backward: bool) -> tuple[int, int]:
        st = Stage(1, 3, module, None, 1.0, split_backward, None)
        st.forward(0, (x.clone(),))
        with FlopCounterMode(display=False) as bwd:
            st.backward(0, g)
        with FlopCounterMode(display=False) as w:
            if split_backward:
                st.wgrad(0)
        return bwd.get_total_flops(), w.get_total_flops()

    full, _ = flops(False)
    bwd, wgrad = flops(True)
    assert bwd > 0 and wgrad > 0 and bwd + wgrad == full


# ---- --local mode: matching rules, deadlock, tuples, shapes --------------------------------------------


def _mlp():
    def build_stage(stage, num_stages):
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    return build_stage, loss_fn


def _edit(prog: Program, rank: int, fn) -> Program:
    instrs = fn(prog.ranks[rank].instructions())
    ranks = list(prog.ranks)
    ranks[rank] = RankProgram.from_instructions(instrs)
    return dataclasses.replace(prog, ranks=tuple(ranks))


def test_every_opcode_has_one_executor_method():
    from pipec.ir.opcodes import OPCODES
    from pipec.runtime.exec.executor import Executor

    assert sorted(Executor.HANDLERS) == sorted(OPCODES)
    ex = Executor(program("1f1b", p=2, m=2), 0, {}, None)
    assert [h.__func__ for h in ex.handlers] == [Executor.HANDLERS[name] for name in OPCODES]


def test_local_mode_checks_the_channel_order():
    prog = program("1f1b", p=2, m=3)

    def swap_first_receives(instrs):
        i, j = [k for k, x in enumerate(instrs) if x.op == "RECV_ACT"][:2]
        instrs[i], instrs[j] = instrs[j], instrs[i]
        return instrs

    bad = _edit(prog, 1, swap_first_receives)
    pipe = LocalPipeline(bad, *_mlp(), options=StageOptions(dtype=torch.float64))
    with pytest.raises(PipelineError) as e:
        pipe.step(torch.randn(6, 4), torch.randn(6, 4))
    assert (
        "rank 1: receive #1 from rank 0 expects the activation of micro-batch 0 from stage 0, but message #1 on "
        "that channel is the activation of micro-batch 1 from stage 0" in str(e.value)
    )


DEADLOCK = """pipec-program 1
schedule "hand-made" {"p": 2, "m": 2}
stages 2 ranks 2 microbatches 2 split false
place 0 1
rank 0
FWD 0 0
SEND_ACT 0 0 1
RECV_GRAD 0 0 1
BWD 0 0
FWD 1 0
SEND_ACT 1 0 1
RECV_GRAD 1 0 1
BWD 1 0
REDUCE_GRAD 0
STEP 0
rank 1
RECV_ACT 0 1 0
RECV_ACT 1 1 0
FWD 0 1
FWD 1 1
BWD 0 1
SEND_GRAD 0 1 0
BWD 1 1
SEND_GRAD 1 1 0
REDUCE_GRAD 1
STEP 1
"""


def test_local_mode_reports_a_deadlock():
    from pipec.formats.program_file import from_text

    pipe = LocalPipeline(from_text(DEADLOCK), *_mlp(), options=StageOptions(dtype=torch.float64))
    with pytest.raises(PipelineError) as e:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4))
    assert str(e.value) == (
        "deadlock: every remaining rank waits for a message: rank 0 at step 1, instruction #3 `BWD 0 0`; "
        "rank 1 at step 1, instruction #3 `FWD 1 1`"
    )


class Split2(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, y):
        return torch.tanh(self.a(x)), torch.tanh(self.b(y) + x)


def test_tuples_between_stages_and_tuple_inputs():
    prog = program("zb-v", p=2, m=4)

    def build_stage(stage, n):
        return Split2(stage == 0)

    def loss_fn(out, target):
        return ((out[0] + out[1] - target) ** 2).mean()

    kw = dict(dtype=torch.float64)
    pipe = LocalPipeline(prog, build_stage, loss_fn, options=StageOptions(**kw))
    ref = Reference(build_stage, loss_fn, prog.num_stages, prog.num_microbatches, **kw)
    x, y, t = torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4)
    out = pipe.step((x, y), t)
    assert rel_err(out.loss, ref.step((x, y), t)) <= 1e-12
    assert max(compare(pipe.named_gradients(), ref.named_gradients()).values()) <= 1e-12


def test_shape_mismatch_names_both_stages_local():
    def build_stage(stage, n):
        return nn.Linear(4, 5) if stage == 0 else nn.Linear(4, 4)

    pipe = LocalPipeline(program("1f1b", p=2, m=2), build_stage, _mlp()[1], options=StageOptions(dtype=torch.float64))
    with pytest.raises(ShapeError) as e:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4))
    assert "stage 0 (rank 0) outputs float64 [2, 5] for micro-batch 0, which stage 1 (rank 1) cannot take" in str(
        e.value
    )


def test_shapes_are_fixed_at_the_first_step():
    pipe = LocalPipeline(program("1f1b", p=2, m=2), *_mlp(), options=StageOptions(dtype=torch.float64))
    pipe.step(torch.randn(4, 4), torch.randn(4, 4))
    with pytest.raises(ShapeError, match=r"micro-batch 0's input is float64 \[3, 4\] at step 2, but was float64 "
                                         r"\[2, 4\] at the first step"):  # fmt: skip
        pipe.step(torch.randn(6, 4), torch.randn(6, 4))


def test_a_batch_too_small_for_m():
    with pytest.raises(PipelineError, match="the inputs has 3 rows along dimension 0; it cannot split into m=4"):
        split(torch.randn(3, 2), 4, "inputs")


def test_runner_needs_torch_distributed():
    with pytest.raises(PipelineError, match="torch.distributed is not initialised"):
        Runner(program("1f1b", p=2, m=2), *_mlp())


def test_the_example_learns(monkeypatch):
    for k, v in {"MLP_WIDTH": "32", "MLP_DEPTH": "4", "MLP_BATCH": "32", "MLP_LR": "3e-3"}.items():
        monkeypatch.setenv(k, v)
    torch.set_num_threads(1)
    model = load_model(str(ROOT / "examples" / "mlp.py"))
    options = StageOptions(optimizer=model.optimizer, dtype=model.dtype)
    pipe = LocalPipeline(program("1f1b", p=2, m=2), model.build_stage, model.loss_fn, options=options)
    losses = [pipe.step(*model.batch(step)).loss for step in range(30)]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


DROPOUT = GOOD.replace(
    "return torch.nn.Linear(4, 4)", "return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))"
)


def test_pipec_run_local_check_fails_past_the_tolerance(tmp_path, capsys):
    from pipec.cli.app import main

    model = write(tmp_path, DROPOUT)  # dropout draws different masks in the pipeline and in the reference
    code = main(["run", "1f1b", "-D", "p=2", "-D", "m=2", "--model", model, "--local", "--check", "--steps", "1"])
    out = capsys.readouterr().out
    assert code == 1
    assert re.search(r"^FAILED: largest relative error \S+ \(tolerance 0.0001\)$", out, re.M), out


def test_pipec_run_local_check_passes(capsys):
    from pipec.cli.app import main

    code = main(
        [
            "run",
            "gpipe",
            "-D",
            "p=2",
            "-D",
            "m=2",
            "--model",
            str(ROOT / "tests" / "models" / "faulty.py"),
            "--local",
            "--check",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "step 3/3: loss" in out and "OK: largest relative error" in out and "(tolerance 1e-10)" in out


def test_import_pipec_does_not_import_torch():
    code = "import sys, pipec, pipec.cli.app, pipec.runtime, pipec.runtime.job.launch; pipec.cli.app.parser(); "
    code += "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_docs_python_api_example_runs(capsys):
    text = (ROOT / "docs" / "runtime.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    code = next(b for b in blocks if "LocalPipeline(program" in b)
    exec(compile(code, "docs/runtime.md", "exec"), {})
    assert capsys.readouterr().out.startswith("last loss ")
