"""Stage graphs on the runtime (issue 42): the two example models of examples/, a U-Net with long skips and
two encoders fanning into a decoder, train exactly like the single-process float64 reference (losses and
every parameter's gradient at each of 3 steps, parameters after them, to 1e-10): in --local mode over
several schedules and placements (remote and local skips, split backward), and over 4 gloo processes."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
from repo import ROOT

torch = pytest.importorskip("torch")

import pipec  # noqa: E402
from pipec.runtime import LocalPipeline, Reference, StageOptions, Transport, load_model  # noqa: E402
from pipec.runtime.errors import ShapeError  # noqa: E402
from pipec.runtime.reference import compare, rel_err  # noqa: E402

TOL = 1e-10
EXAMPLES = ROOT / "examples"
# U-Net edges for a library schedule of S stages: the chain and the skips s -> S-1-s
UNET_EDGES = (
    "    edge s -> if s < {S} - 1 then s + 1 else -1\n    edge s -> if s < {S} / 2 - 1 then {S} - 1 - s else -1\n"
)


def with_edges(name: str, stages: str, out: Path) -> str:
    """Library schedule `name` with the U-Net's edges over its `stages` (an expression of its parameters)
    declared after its placement: the same rank programs, run on the graph."""
    text = (ROOT / "schedules" / f"{name}.pipe").read_text()
    text = re.sub(r'^schedule "([^"]+)"', r'schedule "unet-\1"', text, count=1, flags=re.M)
    text = re.sub(
        r"^(    place .*\n)", lambda m: m.group(1) + UNET_EDGES.format(S=f"({stages})"), text, count=1, flags=re.M
    )
    path = out / f"unet-{name}.pipe"
    path.write_text(text)
    return str(path)


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
LOCAL_CASES = [
    ("unet", "unet.pipe", dict(p=4, m=4)),
    ("unet", "unet.pipe", dict(p=6, m=5)),
    ("two_encoders", "two_encoders.pipe", dict(m=4)),
    ("two_encoders", "two_encoders.pipe", dict(p=5, m=3)),
    ("unet", ("zb-h1", "p"), dict(p=4, m=4)),  # split backward, remote skip
    ("unet", ("zb-v", "2 * p"), dict(p=2, m=4)),  # V placement: every skip a hand-off on its rank
    ("unet", ("zb-v", "2 * p"), dict(p=3, m=5)),
    ("unet", ("interleaved-1f1b", "p * v"), dict(p=2, v=2, m=4)),  # two stages a rank, placed s % p
]


@pytest.mark.parametrize("name, schedule, params", LOCAL_CASES, ids=lambda c: str(c))
def test_local_graph_equals_reference(name, schedule, params, tmp_path):
    torch.set_num_threads(1)
    m = model(name)
    path = str(EXAMPLES / schedule) if isinstance(schedule, str) else with_edges(*schedule, tmp_path)
    prog = pipec.compile(path, **params)
    assert prog.graph is not None and not prog.graph.is_chain
    pipe = LocalPipeline(prog, m.build_stage, m.loss_fn, options=StageOptions(optimizer=m.optimizer, dtype=m.dtype))
    worst = run_checked(pipe, reference_of(prog, m), m)
    assert worst["loss"] <= TOL and worst["grad"] <= TOL and worst["param"] <= TOL, worst
    assert len(worst["names"]) == sum(
        len(list(m.build_stage(s, prog.num_stages).parameters())) for s in range(prog.num_stages)
    )


def test_fan_out_returning_the_wrong_count_is_named(tmp_path):
    """A stage with two out-edges that returns a tuple of three: a ShapeError at the shape exchange naming the
    stage and the stages it feeds, before any step."""
    m = model("unet")
    prog = pipec.compile(str(EXAMPLES / "unet.pipe"), p=4, m=2)

    def build(s: int, S: int) -> torch.nn.Module:
        mod = m.build_stage(s, S)
        if s == 0:

            class Three(torch.nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.inner = mod

                def forward(self, x):
                    y = self.inner(x)
                    return y, y, y

            return Three()
        return mod

    pipe = LocalPipeline(prog, build, m.loss_fn, options=StageOptions(dtype=m.dtype))
    x, y = m.batch(0)
    with pytest.raises(ShapeError, match=r"stage 0 returned 3 outputs, but it feeds 2 stages \(1, 3\)"):
        pipe.step(x, y)


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


# ---- over 4 gloo processes ----------------------------------------------------------------------------------------
def _rank(case: tuple, rank: int, out: str) -> None:
    """One rank of a gloo job: the case's schedule and model through Runner, checked against the reference."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    name, path, params, p2p = case
    m = model(name)
    prog = pipec.compile(path, **params)
    dist.init_process_group("gloo")
    runner = pipec.runtime.Runner(
        prog,
        m.build_stage,
        m.loss_fn,
        options=StageOptions(optimizer=m.optimizer, dtype=m.dtype),
        transport=Transport(timeout=60, p2p=p2p),
    )
    worst = run_checked(runner, reference_of(prog, m), m)
    worst["stages"] = sorted(runner.stages)
    worst["transport"] = type(runner.executor.comm).__name__
    worst["last"] = runner.has_last
    Path(out).write_text(json.dumps(worst))
    dist.destroy_process_group()


def _dist(case: tuple, tmp_path: Path) -> list[dict]:
    from runtime_harness import json_ranks

    res = json_ranks(functools.partial(_rank, case), 4, tmp_path, timeout=180.0)
    assert sorted(s for r in res for s in r["stages"]) == list(range(len(res)))
    for r in res:
        assert r["grad"] <= TOL and r["param"] <= TOL, r
    (last,) = [r for r in res if r["last"]]
    assert last["loss"] <= TOL
    return res


def test_dist_unet_1f1b_p4(tmp_path):
    """The U-Net on 1F1B over 4 processes, the skip 0 -> 3 a message between ranks 0 and 3 (the default
    transport: shared memory between the ranks of one host)."""
    res = _dist(("unet", str(EXAMPLES / "unet.pipe"), dict(p=4, m=4), "auto"), tmp_path)
    assert {r["transport"] for r in res} == {"ShmComm"}


def test_dist_two_encoders_gloo(tmp_path):
    """Two encoders on ranks 0 and 1 fanning into stage 2, over gloo's point-to-point."""
    res = _dist(("two_encoders", str(EXAMPLES / "two_encoders.pipe"), dict(m=4), "gloo"), tmp_path)
    assert {r["transport"] for r in res} == {"DistComm"}


@pytest.mark.slow  # default twins: test_dist_unet_1f1b_p4 (shm), test_local_graph_equals_reference's ZB-H1
def test_dist_unet_zb_h1_gloo(tmp_path):
    _dist(("unet", with_edges("zb-h1", "p", tmp_path), dict(p=4, m=4), "gloo"), tmp_path)


@pytest.mark.slow  # default twin: test_dist_two_encoders_gloo (gloo)
def test_dist_two_encoders_shm(tmp_path):
    _dist(("two_encoders", str(EXAMPLES / "two_encoders.pipe"), dict(m=4), "auto"), tmp_path)


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


@pytest.mark.slow  # default twins: test_cli_local_unet_checks, test_dist_unet_1f1b_p4
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
