"""Stage graphs through the torch-shaped `PipelineSchedule` (pipec.runtime.pipeline_schedule): the user's own
stage modules and their own optimizer (one torch.optim.Adam over `schedule.parameters()` per rank, zero_grad
and step by the caller), every rank of the pipeline a thread of this process (LocalComm, LocalKV). After each of
3 steps the losses and gradients, and the parameters after the caller's optimizer step, equal the
single-process float64 reference running the same graph with Adam (1e-10); `eval` on the graph equals the
reference's forward."""

from __future__ import annotations

import functools
import threading

import pytest
from repo import ROOT

torch = pytest.importorskip("torch")

from test_graph_runtime import TOL, model  # noqa: E402

import pipec  # noqa: E402
from pipec.runtime import Reference  # noqa: E402
from pipec.runtime.local import LocalComm, LocalHub, LocalKV  # noqa: E402
from pipec.runtime.model.contract import build_stage_module  # noqa: E402
from pipec.runtime.pipeline_schedule import PipelineSchedule, stage_indices  # noqa: E402
from pipec.runtime.reference import compare, rel_err  # noqa: E402

LR = 1e-2
CASES = [
    ("unet", "unet-interleaved-1f1b.pipe", dict(p=2, v=2, m=4)),  # the skip 0 -> 3 between the ranks
    ("two_encoders", "two_encoders-zb-v.pipe", dict(p=2, m=4)),  # sources on both ranks, split backward
    ("two_encoders", "two_encoders.pipe", dict(p=4, m=4)),  # the two encoders on ranks of their own
]


def on_all_ranks(scheds: list, fn) -> dict[int, object]:
    """fn(schedule) on every rank at once, one thread each; their results by rank."""
    out: dict[int, object] = {}
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = fn(scheds[r])
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(scheds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    assert sorted(out) == list(range(len(scheds))), "a rank did not finish"
    return out


def train(sc: PipelineSchedule, opt_of: dict, args: tuple, y: torch.Tensor):
    """The user's step on one rank: zero_grad, the schedule's step (losses per micro-batch)."""
    opt_of[id(sc)].zero_grad()
    losses: list = []
    out = sc.step(*args, target=y, losses=losses)
    return out, losses


@pytest.mark.parametrize("name, path, params", CASES, ids=lambda c: str(c))
def test_pipeline_schedule_on_a_graph(name, path, params):
    torch.set_num_threads(1)
    m = model(name)
    prog = pipec.compile(str(ROOT / "examples" / path), **params)
    S, R = prog.num_stages, prog.num_ranks
    assert not prog.graph.is_chain
    # the user's modules: each rank builds its own stages (the same seeds as the reference's)
    make = lambda s: build_stage_module(m.build_stage, s, S, seed=0, dtype=m.dtype, device="cpu")  # noqa: E731
    hub, kv = LocalHub(), LocalKV()
    scheds = [
        PipelineSchedule(
            prog, {s: make(s) for s in stage_indices(prog, r)}, m.loss_fn, rank=r, comm=LocalComm(hub, r), kv=kv
        )
        for r in range(R)
    ]
    opts = [torch.optim.Adam(list(sc.parameters()), lr=LR) for sc in scheds]
    ref = Reference(
        m.build_stage,
        m.loss_fn,
        S,
        prog.num_microbatches,
        graph=prog.graph,
        dtype=m.dtype,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=LR),
    )
    last = next(r for r, sc in enumerate(scheds) if sc.has_last)
    worst = {"loss": 0.0, "grad": 0.0}

    def mine(what: str) -> dict:
        return {
            (s, n): (p.grad if what == "grad" else p)
            for sc in scheds
            for s, mod in sc.stages.items()
            for n, p in mod.named_parameters()
        }

    for step in range(3):
        x, y = m.batch(step)
        args = x if isinstance(x, tuple) else (x,)

        got = on_all_ranks(scheds, functools.partial(train, opt_of=dict(zip(map(id, scheds), opts)), args=args, y=y))
        out, losses = got[last]
        ref_loss = ref.step(x, y)
        assert len(losses) == prog.num_microbatches and out is not None and out.shape[0] == y.shape[0]
        worst["loss"] = max(worst["loss"], rel_err(float(sum(losses)) / len(losses), ref_loss))
        grads = compare(mine("grad"), ref.named_gradients())
        assert len(grads) == len(ref.named_gradients())
        worst["grad"] = max(worst["grad"], *grads.values())
        for opt in opts:  # the caller's optimizer steps, after the gradients are compared
            opt.step()
    worst["param"] = max(compare(mine("param"), ref.named_parameters()).values())
    print(f"{path}: max rel err {worst}")
    assert worst["loss"] <= TOL and worst["grad"] <= TOL and worst["param"] <= TOL, worst

    # eval on the graph: the forward-only Program, its own shape exchange, equal to the reference's forward
    x, y = m.batch(7)
    args = x if isinstance(x, tuple) else (x,)
    evals = on_all_ranks(scheds, lambda sc: sc.eval(*args))
    with torch.no_grad():
        want = reference_forward(ref, prog.graph, args)
    got = evals[last]
    assert float((got - want).abs().max() / want.abs().max()) <= TOL


def reference_forward(ref: Reference, graph, args: tuple) -> torch.Tensor:
    """The whole batch through the reference's stages in stage order, each on its in-edges' outputs in the
    order of graph.inputs(s) (a source on the inputs): the network a user would call whole."""
    outs: dict[int, torch.Tensor] = {}
    for s, st in enumerate(ref.stages):
        srcs = graph.inputs(s)
        outs[s] = st(*(args if not srcs else tuple(outs[u] for u in srcs)))
    return outs[len(ref.stages) - 1]
