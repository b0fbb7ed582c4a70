"""Declared edges that disagree with the model's tensors (issue 42, "Bad input"): a stage whose forward takes
another number of inputs than its in-edges bring, a stage returning another number of outputs than it has
out-edges, shapes that do not match across an edge. Each is a ShapeError naming the stage, its rank, the
edge(s) and what the schedule declares, raised at the shape exchange: before any instruction of the first
step runs (no forward computed, no message sent). Over 4 processes (`pipec run`) the job ends with that
error instead of hanging."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from repo import ROOT

torch = pytest.importorskip("torch")

from test_graph_runtime import model  # noqa: E402

import pipec  # noqa: E402
from pipec.runtime import LocalPipeline, StageOptions  # noqa: E402
from pipec.runtime.errors import ShapeError  # noqa: E402

EXAMPLES = ROOT / "examples"

UNET_EDGES = """schedule "unet-edges" (p: int = 4, m: int = 2) {{
    stages p
    place s -> s
    edge s -> if s < p - 1 then s + 1 else -1
{edges}
    ops F, B
    rank r {{
        let warm = min(p - 1 - r, m)
        for i in 0 .. warm      {{ F(i) }}
        for i in 0 .. m - warm  {{ F(i + warm)  B(i) }}
        for i in m - warm .. m  {{ B(i) }}
    }}
}}
"""


def unet_with(edges: str, tmp_path, **params):
    path = tmp_path / "unet-edges.pipe"
    path.write_text(UNET_EDGES.format(edges=textwrap.indent(edges, "    ")))
    return pipec.compile(str(path), **params)


def first_step(prog, name: str, build=None):
    """The first step in --local mode, counting the FWDs that ran (none may, before the error)."""
    m = model(name)
    pipe = LocalPipeline(prog, build or m.build_stage, m.loss_fn, options=StageOptions(dtype=m.dtype))
    ran = []
    for st in [st for runner in pipe.runners for st in runner.stages.values()]:
        real = st.forward
        st.forward = lambda *a, _real=real, **k: (ran.append(a[0]), _real(*a, **k))[1]
    x, y = m.batch(0)
    with pytest.raises(ShapeError) as info:
        pipe.step(x, y)
    assert ran == [], f"forwards ran before the error: {ran}"
    return str(info.value)


def test_a_stage_given_more_inputs_than_its_forward_takes(tmp_path):
    """An extra edge 0 -> 2 into the U-Net's innermost decoder (forward(x)): named with both in-edges."""
    prog = unet_with("edge s -> if s == 0 then 2 else -1", tmp_path)
    assert prog.graph.inputs(2) == (0, 1)
    msg = first_step(prog, "unet")
    assert re.search(
        r"stage 2 \(rank 2\): the schedule declares 2 in-edge\(s\) into stage 2, 0 -> 2 from rank 0 \(float64 "
        r"\[4, 4, 16, 16\]\), 1 -> 2 from rank 1 \(float64 \[4, 8, 8, 8\]\), spread in that order as 2 input\(s\), "
        r"but its forward takes 1 positional input\(s\): Innermost\.forward\(x: torch\.Tensor\)",
        msg,
    ), msg


def test_a_stage_given_fewer_inputs_than_its_forward_takes(tmp_path):
    """p=6 with the skip 1 -> 4 left out: decoder level 1 (stage 4, forward(skip, x)) gets one input."""
    prog = unet_with("edge s -> if s == 0 then 5 else -1", tmp_path, p=6)
    assert prog.graph.inputs(4) == (3,) and prog.graph.inputs(5) == (0, 4)
    msg = first_step(prog, "unet")
    assert "stage 4 (rank 4): the schedule declares 1 in-edge(s) into stage 4, 3 -> 4 from rank 3" in msg, msg
    assert "but its forward takes 2 positional input(s): Decoder.forward(skip: torch.Tensor, x: torch.Tensor)" in msg


def test_a_source_whose_forward_takes_other_inputs(tmp_path):
    """A stage the schedule declares a source (no in-edge) whose forward wants another count than the
    micro-batch's inputs: the two-encoders schedule on a model whose stage 1 takes only the tokens."""
    m = model("two_encoders")

    class TokensOnly(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, tokens):
            return self.inner(None, tokens)

    def build(s, S):
        mod = m.build_stage(s, S)
        return TokensOnly(mod) if s == 1 else mod

    prog = pipec.compile(str(EXAMPLES / "two_encoders.pipe"), m=2)
    msg = first_step(prog, "two_encoders", build)
    assert (
        "stage 1 (rank 1): the schedule declares no in-edge into stage 1 (a source), so it is called with the "
        "micro-batch's 2 input(s)" in msg
    ), msg
    assert "but its forward takes 1 positional input(s): TokensOnly.forward(tokens)" in msg, msg


def test_a_fan_out_returning_another_count_than_its_edges(tmp_path):
    """Stage 0 of the U-Net has two out-edges (0 -> 1, 0 -> 3) and returns three tensors."""
    m = model("unet")

    class Three(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            y = self.inner(x)
            return y, y, y

    prog = pipec.compile(str(EXAMPLES / "unet.pipe"), p=4, m=2)
    msg = first_step(prog, "unet", lambda s, S: Three(m.build_stage(s, S)) if s == 0 else m.build_stage(s, S))
    assert (
        "stage 0 returned 3 outputs, but it feeds 2 stages (1, 3): the schedule declares its out-edges 0 -> 1, 0 -> 3"
        in msg
    )


def test_a_tuple_on_one_edge_meant_for_two(tmp_path):
    """A model whose stage 0 returns (x, skip) for two consumers, on a schedule that declares only the chain
    edge out of it (the skip edge forgotten) but a skip elsewhere: its consumer is named, with the tuple."""
    m = model("two_encoders")

    class Pair(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, images, tokens):
            y = self.inner(images, tokens)
            return y, y

    prog = pipec.compile(str(EXAMPLES / "two_encoders.pipe"), m=2)
    msg = first_step(prog, "two_encoders", lambda s, S: Pair(m.build_stage(s, S)) if s == 0 else m.build_stage(s, S))
    assert (
        "stage 2 (rank 2): the schedule declares 2 in-edge(s) into stage 2, 0 -> 2 from rank 0 ((float64 [4, 16], "
        in msg
    )
    assert "spread in that order as 3 input(s) (edge 0 -> 2 carries a tuple), but its forward takes 2" in msg, msg


def test_shapes_that_do_not_match_across_an_edge():
    """The image encoder one feature too wide: the fusion stage names both in-edges, their ranks and shapes."""
    m = model("two_encoders")

    def build(s, S):
        mod = m.build_stage(s, S)
        if s == 0:
            mod.proj = torch.nn.Linear(mod.proj.in_features, mod.proj.out_features + 1)
        return mod

    prog = pipec.compile(str(EXAMPLES / "two_encoders.pipe"), m=2)
    msg = first_step(prog, "two_encoders", build)
    assert msg.startswith(
        "stage 2 (rank 2) takes its in-edges 0 -> 2 (stage 0 on rank 0: float64 [4, 17]), 1 -> 2 (stage 1 on "
        "rank 1: float64 [4, 16]) for micro-batch 0, in that order as the schedule declares them, and cannot: "
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    ), msg


BAD_MODEL = """\
import sys
sys.path.insert(0, {examples!r})
import torch
import two_encoders as base
from two_encoders import batch, dtype, loss_fn, optimizer  # noqa: F401


def build_stage(stage, num_stages):
    mod = base.build_stage(stage, num_stages)
    if stage == 0:  # one feature too wide for the fusion stage's Linear
        mod.proj = torch.nn.Linear(base.DIM, base.DIM + 1)
    return mod
"""


def test_four_processes_end_with_the_error_not_a_hang(tmp_path):
    """`pipec run` over 4 processes with that model: the job fails within its timeout (here far under the
    transport's --timeout of 120 s: the failing rank's abort reaches the others), naming the stage and edges."""
    bad = tmp_path / "bad_two_encoders.py"
    bad.write_text(BAD_MODEL.format(examples=str(EXAMPLES)))
    cmd = [sys.executable, "-m", "pipec", "run", str(EXAMPLES / "two_encoders.pipe"), "-D", "m=2", "--model"]
    cmd += [str(bad), "--nproc", "4", "--steps", "1", "--timeout", "120"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "stage 2 (rank 2) takes its in-edges 0 -> 2 (stage 0 on rank 0: float64 [4, 17]), 1 -> 2" in out, out
    # Which rank is blamed first is a race: rank 2 finds the mismatch, and a rank that reads its report in the
    # exchange's agreement may exit first with rank 2's words. Either way the job ends, every rank says why.
    blamed = re.search(r"rank (\d) failed at step 1, the shape handshake", out)
    assert blamed and f"because rank {blamed.group(1)} failed" in out and "stopped because of it" in out, out
    assert "rank 2, the shape exchange: stage 2 (rank 2)" in out or blamed.group(1) == "2", out
