"""One rank of a torch.distributed.pipelining job over schedule CSVs, for tests/unit/formats/test_torch_interop.py.

    RANK=r WORLD_SIZE=n python tests/support/torch_pipelining_worker.py OUTDIR CSV:FORMAT [CSV:FORMAT ...]

or `launch(OUTDIR, ["CSV:FORMAT", ...], n, timeout)` for all n ranks at once. Each rank joins a gloo
group (a file store in OUTDIR), then for each CSV builds its stages of a small float64 model, loads the
CSV into torch's `_PipelineScheduleRuntime` (`_load_csv`, FORMAT `compute_only` or `compute_comms`),
runs one step and saves its gradients to OUTDIR/case{k}.rank{r}.pt. `reference_grads` is the
single-process reference for the same model.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

WIDTH = 8
BATCH = 16


def make_stages(num_stages: int) -> list[nn.Module]:
    """The same modules in every process: seeded, float64."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).double() for _ in range(num_stages)]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def reference_grads(num_stages: int, microbatches: int) -> dict[str, torch.Tensor]:
    """Gradients of the whole model on the whole batch. torch's schedules average the micro-batches'
    losses (`scale_grads`), which for equal micro-batches is the loss of the whole batch."""
    assert BATCH % microbatches == 0
    stages = make_stages(num_stages)
    x, y = batch()
    loss_fn(nn.Sequential(*stages)(x), y).backward()
    return {f"{s}.{n}": p.grad for s, mod in enumerate(stages) for n, p in mod.named_parameters()}


def run(out: str, cases: list[str], rank: int, world: int) -> None:
    """This rank's part of the job (see the module's docstring)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import PipelineStage

    from pipec.errors import Source
    from pipec.formats.torch_csv_reader import analyse

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    try:
        for k, arg in enumerate(cases):
            path, fmt = arg.rsplit(":", 1)
            with open(path) as f:
                doc = analyse(Source(path, f.read()))
            S, m = doc.num_stages, doc.num_microbatches
            modules = make_stages(S)
            mine = [s for s in range(S) if doc.placement[s] == rank]
            stages = [PipelineStage(modules[s], s, S, torch.device("cpu")) for s in mine]
            sched = schedules._PipelineScheduleRuntime(stages, m, loss_fn=loss_fn)
            sched._load_csv(path, format=fmt)
            x, y = batch()
            kwargs: dict = {"target": y, "losses": []} if S - 1 in mine else {}
            sched.step(*((x,) if 0 in mine else ()), **kwargs)
            grads = {f"{s}.{n}": p.grad for s in mine for n, p in modules[s].named_parameters()}
            torch.save(grads, os.path.join(out, f"case{k}.rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(out: str, cases: list[str], world: int, timeout: float) -> list[int]:
    """Run `run` as ranks 0..world-1, forked from a fork server that imported torch once (a fresh
    interpreter per rank would import torch.distributed.pipelining `world` times). Returns the exit
    codes; a rank still running after `timeout` seconds is killed (exit code None -> -9)."""
    import multiprocessing as mp
    import time

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.pipelining", "pipec.formats.torch_csv_reader", __name__])
    procs = [ctx.Process(target=run, args=(out, cases, r, world)) for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def main() -> None:
    run(sys.argv[1], sys.argv[2:], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()
