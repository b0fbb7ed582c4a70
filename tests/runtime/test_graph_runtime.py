"""Stage graphs on the runtime (issue 42): the two example models of examples/, a U-Net with long skips and
two encoders fanning into a decoder, train exactly like the single-process float64 reference (losses and
every parameter's gradient at each of 3 steps, parameters after them, to 1e-10): in --local mode over
several schedules and placements (remote and local skips, split backward) and through `pipec run --check`.
The grid of both models on 1F1B, interleaved 1F1B, ZB-H1 and ZB-V over 4 processes is test_graph_grid.py."""

from __future__ import annotations

import re

import pytest
from repo import ROOT

torch = pytest.importorskip("torch")

import pipec  # noqa: E402
from pipec.runtime import LocalPipeline, Reference, StageOptions, load_model  # noqa: E402
from pipec.runtime.reference import compare, rel_err  # noqa: E402

TOL = 1e-10
EXAMPLES = ROOT / "examples"


def model(name: str):
    return load_model(str(EXAMPLES / f"{name}.py"))


def run_checked(pipe, ref, m, steps: int = 3) -> dict:
    """The pipelined run's worst errors against the reference: loss and gradients each step, parameters at the end."""
    worst = {"loss": 0.0, "grad": 0.0}
    for step in range(steps):
        x, y = m.batch(step)
        loss = pipe.step(x, y).loss
        ref_loss = ref.step(x, y)
        if loss is not None:
            worst["loss"] = max(worst["loss"], rel_err(loss, ref_loss))
        grads = compare(pipe.named_gradients(), ref.named_gradients())
        worst["grad"] = max(worst["grad"], *grads.values())
    worst["param"] = max(compare(pipe.named_parameters(), ref.named_parameters()).values())
    worst["names"] = sorted(f"{s}:{n}" for s, n in pipe.named_parameters())
    return worst


def reference_of(prog, m) -> Reference:
    kw = dict(optimizer=m.optimizer, dtype=m.dtype)
    return Reference(m.build_stage, m.loss_fn, prog.num_stages, prog.num_microbatches, graph=prog.graph, **kw)


# ---- the reference itself: the graph's forward is the model a user would write whole --------------------------
def test_reference_is_the_whole_unet():
    """The U-Net's four stages called by hand as one network (the skip first, as graph.inputs orders them) give
    the reference's loss and gradients: the reference does not merely share the runtime's reading of the graph."""
    import copy

    m = model("unet")
    prog = pipec.compile(str(EXAMPLES / "unet.pipe"), p=4, m=2)
    assert prog.graph.inputs(3) == (0, 2) and prog.graph.outputs(0) == (1, 3)
    ref = reference_of(prog, m)
    e0, e1, d1, d0 = copy.deepcopy(ref.stages)  # before the reference's optimizer steps
    x, y = m.batch(0)
    ref_loss = ref.step(x, y)
    total = 0.0
    for xs, ys in zip(x.tensor_split(2), y.tensor_split(2)):
        skip = e0(xs)
        loss = m.loss_fn(d0(skip, d1(e1(skip))), ys) / 2
        loss.backward()
        total += float(loss.detach())
    assert rel_err(total, ref_loss) <= TOL
    mine = {(s, n): p.grad for s, mod in enumerate((e0, e1, d1, d0)) for n, p in mod.named_parameters()}
    errs = compare(mine, ref.named_gradients())
    assert len(errs) == len(ref.named_gradients()) == 12 and max(errs.values()) <= TOL, errs


# ---- --local: every rank in this process ------------------------------------------------------------------------
LOCAL_CASES = [  # other sizes than test_graph_grid.py's (every model x schedule at p=4, --local and 4 processes)
    ("unet", "unet.pipe", dict(p=6, m=5)),
    ("two_encoders", "two_encoders.pipe", dict(p=5, m=3)),
    ("unet", "unet-zb-v.pipe", dict(p=2, m=4)),  # V placement: every skip a hand-off on its rank
    ("unet", "unet-zb-v.pipe", dict(p=3, m=5)),
    ("unet", "unet-interleaved-1f1b.pipe", dict(p=2, v=2, m=4)),  # two stages a rank, placed s % p
    ("two_encoders", "two_encoders-zb-h1.pipe", dict(p=3, m=5)),
]


@pytest.mark.parametrize("name, schedule, params", LOCAL_CASES, ids=lambda c: str(c))
def test_local_graph_equals_reference(name, schedule, params):
    torch.set_num_threads(1)
    m = model(name)
    prog = pipec.compile(str(EXAMPLES / schedule), **params)
    assert prog.graph is not None and not prog.graph.is_chain
    pipe = LocalPipeline(prog, m.build_stage, m.loss_fn, options=StageOptions(optimizer=m.optimizer, dtype=m.dtype))
    worst = run_checked(pipe, reference_of(prog, m), m)
    assert worst["loss"] <= TOL and worst["grad"] <= TOL and worst["param"] <= TOL, worst
    assert len(worst["names"]) == sum(
        len(list(m.build_stage(s, prog.num_stages).parameters())) for s in range(prog.num_stages)
    )


def test_graph_shm_channels_name_edges():
    """The shared-memory transport's slots on a stage graph: per edge between the two ranks, activations one
    way and gradients the other, the same list on both ends."""
    from pipec.runtime.exec import shm
    from pipec.runtime.exec.comm import ACT, GRAD, key_str

    prog = pipec.compile(str(EXAMPLES / "unet.pipe"), p=4, m=2)
    place, g = prog.placement, prog.graph
    assert shm.channel_keys(place, 2, 0, 3, g) == [(ACT, 0, (0, 3)), (ACT, 1, (0, 3))]
    assert shm.channel_keys(place, 2, 3, 0, g) == [(GRAD, 0, (0, 3)), (GRAD, 1, (0, 3))]
    assert shm.channel_keys(place, 2, 0, 2, g) == []
    assert key_str((GRAD, 1, (0, 3))) == "the gradient of micro-batch 1 on edge 0 -> 3 (from stage 3 back to stage 0)"


# ---- `pipec run ... --check` ---------------------------------------------------------------------------------------
def _pipec_run(*argv: str) -> str:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pipec", "run", *argv, "--check"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^OK: largest relative error \S+ \(tolerance 1e-10\)$", r.stdout, re.M), r.stdout
    return r.stdout


def test_cli_local_unet_checks():
    """`pipec run examples/unet.pipe ... --local --check`: the Program file (version 2) carries the graph to the
    run and to its reference."""
    out = _pipec_run("examples/unet.pipe", "-D", "p=4", "-D", "m=4", "--model", "examples/unet.py", "--local")
    assert "stage 3   gradients  max rel err" in out


@pytest.mark.slow  # default twins: test_cli_local_unet_checks, test_graph_grid.py's 4-process cells
@pytest.mark.parametrize(
    "argv",
    [
        ["examples/unet.pipe", "-D", "p=4", "-D", "m=4", "--model", "examples/unet.py"],
        ["examples/two_encoders.pipe", "-D", "m=4", "--model", "examples/two_encoders.py"],
    ],
    ids=["unet", "two_encoders"],
)
def test_cli_four_processes_check(argv):
    _pipec_run(*argv, "--nproc", "4")


def test_cli_four_processes_trace_has_the_skip_messages(tmp_path):
    """`pipec run --trace` of a graph over 4 processes: the events come back from the other ranks with each
    message's edge as a list, and the timeline joins them by key (it once failed: unhashable list). The
    skip 0 -> 3 is there both ways: its activation into rank 3, its gradient back into rank 0."""
    import json
    import subprocess
    import sys

    out = tmp_path / "trace.json"
    argv = ["examples/unet.pipe", "-D", "p=4", "-D", "m=4", "--model", "examples/unet.py", "--nproc", "4"]
    r = subprocess.run(
        [sys.executable, "-m", "pipec", "run", *argv, "--steps", "2", "--trace", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    recvs = [e for e in doc["traceEvents"] if e.get("cat") == "recv"]
    into = {(e["pid"], e["args"]["from"], e["args"]["kind"]) for e in recvs}
    assert (3, 0, "act") in into and (0, 3, "grad") in into, sorted(into)
    assert sum(e.get("cat") == "FWD" for e in doc["traceEvents"]) == 16  # 4 micro-batches x 4 stages
