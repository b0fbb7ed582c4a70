"""PipelineSchedule's inputs that used to be refused or dropped (issue 41): dp_kind="fsdp" without data
parallelism (accepted, with a warning), and a Program compiled with experts= (its expert parallelism
honoured, not silently dropped), with `clip_grad_norm_` over the mix of FSDP DTensors and expert shards
that follows, compared with a single-process float64 reference."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import threading
import warnings
from pathlib import Path

import pytest
from repo import ROOT

torch = pytest.importorskip("torch")

import pipec  # noqa: E402
from pipec.runtime.errors import PipelineError  # noqa: E402
from pipec.runtime.pipeline_schedule import compile_for  # noqa: E402

NO_DP = r"means nothing without data parallelism \(dp=1\)"


# ---- dp_kind without data parallelism: accepted, and said ----------------------------------------------
def test_fsdp_at_dp_1_is_accepted_with_a_warning_for_a_program_and_for_a_schedule_name():
    program = pipec.compile("1f1b", p=2, m=2)
    with pytest.warns(UserWarning, match=r"dp_kind='fsdp' means nothing without data parallelism \(dp=1\)"):
        assert compile_for(program, None, num_ranks=2, num_stages=None, n_microbatches=None, dp_kind="fsdp") is program
    with pytest.warns(UserWarning, match=NO_DP) as seen:
        named = compile_for("1f1b", {"m": 2}, num_ranks=2, num_stages=None, n_microbatches=None, dp_kind="fsdp")
    assert (named.dp, named.dp_kind) == (1, "ddp") and len(seen) == 1
    assert "every parameter stays whole on its rank" in str(seen[0].message)


def test_no_warning_where_the_kind_is_the_programs_or_not_given():
    program = pipec.compile("1f1b", p=2, m=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compile_for(program, None, num_ranks=2, num_stages=None, n_microbatches=None) is program
        assert compile_for(program, None, num_ranks=2, num_stages=None, n_microbatches=None, dp_kind="ddp") is program


def test_a_kind_that_is_no_kind_is_refused_naming_the_kinds():
    program = pipec.compile("1f1b", p=2, m=2)
    with pytest.raises(PipelineError, match=r"dp_kind must be one of 'ddp', 'fsdp' .*got 'zero3'"):
        compile_for(program, None, num_ranks=2, num_stages=None, n_microbatches=None, dp_kind="zero3")


def test_a_pipeline_schedule_with_fsdp_at_dp_1_runs_and_equals_the_unsplit_model_float64():
    """Two ranks in one process (in-memory transport): the warning, then a step whose gradients are the
    whole model's."""
    from pipec.runtime.local import LocalComm, LocalHub, LocalKV
    from pipec.runtime.pipeline_schedule import PipelineSchedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4, dtype=torch.float64) for _ in range(2)])
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    program = pipec.compile("1f1b", p=2, m=2)
    hub, kv = LocalHub(), LocalKV()
    with pytest.warns(UserWarning, match=NO_DP):
        scheds = [
            PipelineSchedule(program, {r: model[r]}, loss_fn, rank=r, comm=LocalComm(hub, r), kv=kv, dp_kind="fsdp")
            for r in range(2)
        ]
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            scheds[r].step(x if r == 0 else None, target=y if r == 1 else None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        (loss_fn(ref(xs), ys) / 2).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert float((p.grad - q.grad).abs().max() / q.grad.abs().max()) <= 1e-10


# ---- a Program with experts: sharded as asked, and clip_grad_norm_ over the mix ---------------------------
MOE_ENV = dict(MOE_BLOCKS="1", MOE_EXPERTS="4", MOE_WIDTH="8", MOE_HIDDEN="8", MOE_CONTEXT="4", MOE_BATCH="8")


def _moe_rank(rank: int, out: str, kind: str = "fsdp") -> None:
    """One of 2 gloo processes: 1 pipeline rank x 2 `kind` replicas, experts over a group of both. The user's
    own MoE model (examples/moe.py's one stage) under PipelineSchedule, a step, then clip_grad_norm_ with
    the mesh; each compared with the same model trained in this process alone in float64."""
    os.environ.update(MOE_ENV)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from pipec.runtime import clip_grad_norm_
    from pipec.runtime.pipeline_schedule import PipelineSchedule

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("moe_example", ROOT / "examples" / "moe.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    program = pipec.compile(
        "1f1b", p=1, m=2, data_parallel=pipec.DataParallel(size=2, kind=kind), experts=pipec.Experts(2, 4)
    )
    torch.manual_seed(0)
    stage = ex.Stage(0, 1).double()
    ref = copy.deepcopy(stage)  # the single-process reference, every expert whole
    sched = PipelineSchedule(program, {0: stage}, ex.loss_fn, mesh=mesh)
    x, y = ex.batch(0)
    sched.step(x, target=y)
    chunks = list(zip(x.tensor_split(4), y.tensor_split(4)))  # 2 replicas x 2 micro-batches, in order
    for xs, ys in chunks:
        (ex.loss_fn(ref(xs), ys) / len(chunks)).backward()

    experts = sched.stages[0].blocks[0].moe.experts
    lo = rank * 2  # this member's experts: 2 of the 4
    worst = 0.0
    kinds = set()
    mine = dict(sched.stages[0].named_parameters())
    for n, q in ref.named_parameters():
        p = mine[n]
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = q.grad[lo : lo + 2] if n.startswith("blocks.0.moe.experts.") else q.grad
        kinds.add("DTensor" if isinstance(p.grad, DTensor) else "expert shard")
        worst = max(worst, float((grad - want).abs().max() / want.abs().max()))
    ref_grads = [q.grad for q in ref.parameters()]
    ref_inf = float(torch.nn.utils.get_total_norm(ref_grads, float("inf")))
    ref_two = float(torch.nn.utils.get_total_norm(ref_grads, 2.0))
    inf = float(clip_grad_norm_(sched.parameters(), 1e9, mesh=mesh, norm_type=float("inf")))  # no clipping
    max_norm = ref_two / 4
    two = clip_grad_norm_(sched.parameters(), max_norm, mesh=mesh)
    coef = max_norm / (ref_two + 1e-6)  # torch's clip_grads_with_norm_
    clipped = 0.0
    for n, q in ref.named_parameters():
        p = mine[n]
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = (q.grad[lo : lo + 2] if n.startswith("blocks.0.moe.experts.") else q.grad) * coef
        clipped = max(clipped, float((grad - want).abs().max() / want.abs().max()))
    result = {
        "experts_held": [experts.w1.shape[0], ref.blocks[0].moe.experts.w1.shape[0]],
        "kinds": sorted(kinds),
        "grad": worst,
        "inf": abs(inf - ref_inf) / ref_inf,
        "two": abs(float(two) - ref_two) / ref_two,
        "dtype": str(two.dtype),
        "clipped": clipped,
    }
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def test_a_program_with_experts_shards_them_and_clip_grad_norm_spans_dtensors_and_expert_shards(tmp_path):
    check_moe_job(_moe_rank, tmp_path)


@pytest.mark.slow  # the default twin: test_a_program_with_experts_shards_them_and_clip_grad_norm_spans_...
def test_ddp_replicas_with_experts_clip_over_replicated_dtensors_and_expert_shards(tmp_path):
    """Under ddp (torch's replicate: DTensors with a Replicate placement) the dense part is counted once."""
    check_moe_job(functools.partial(_moe_rank, kind="ddp"), tmp_path)


def check_moe_job(target, tmp_path: Path) -> None:
    from runtime_harness import json_ranks

    res = json_ranks(target, 2, tmp_path, timeout=120.0)
    for r in res:
        assert r["experts_held"] == [2, 4], r  # each member holds 2 of the 4 experts, as the Program asks
        assert r["kinds"] == ["DTensor", "expert shard"], r  # the mix that torch's own norm refuses
        assert r["grad"] <= 1e-10, r
        assert r["inf"] <= 1e-12 and r["two"] <= 1e-12 and r["dtype"] == "torch.float64", r
        assert r["clipped"] <= 1e-10, r
