"""A multi-process worker for tests/runtime/test_runtime_dist.py: runs several schedules in one process group
through the Python API (Runner) and writes, per schedule, its errors against the single-process
reference: loss and gradients after the first step, parameters after the last. Every other schedule
posts its receives where the Program places them (recv_ahead=0), the rest as gloo runs do by default.
With PIPEC_TEST_SUBGROUP set, the Programs run on ranks 1.. as a process subgroup, through the transport
NCCL takes (torch.distributed.P2POp, which names peers by global rank); rank 0 only joins the group.

    python tests/support/runtime_worker.py OUT_DIR STEPS NAME:k=v,k=v ...   (or main([...]) in a forked rank)
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

from repo import ROOT


def digest(tensors: dict) -> str:
    """A hash of every tensor's bytes, by name: equal digests are bitwise-equal values."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors, key=str):
        t = tensors[name]
        h.update(repr(name).encode())
        h.update(b"none" if t is None else t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out_dir, steps, configs = argv[0], int(argv[1]), argv[2:]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from pipec.api import load
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime import Reference, Runner, StageOptions, Transport, load_model
    from pipec.runtime.reference import compare, rel_err

    model = load_model(str(ROOT / "examples" / "mlp.py"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    results = {}
    sub = None
    if os.environ.get("PIPEC_TEST_SUBGROUP"):
        sub = dist.new_group(list(range(1, dist.get_world_size())))  # every rank must call new_group
        if rank == 0:
            dist.destroy_process_group()
            return
    for i, spec in enumerate(configs):
        name, _, kv = spec.partition(":")
        params = {k: int(v) for k, v in (item.split("=") for item in kv.split(","))}
        prog = compile_schedule(load(name, **params)).program
        kw = dict(optimizer=model.optimizer, dtype=model.dtype)
        ahead = 0 if i % 2 or sub is not None else None
        p2p = os.environ.get("PIPEC_TEST_TRANSPORT", "gloo" if sub is not None else "auto")  # subgroup: P2POp
        transport = Transport(timeout=30, recv_ahead=ahead, group=sub, p2p=p2p)
        runner = Runner(prog, model.build_stage, model.loss_fn, options=StageOptions(**kw), transport=transport)
        if sub is not None:
            runner.executor.comm.pg = None  # P2POp, as on NCCL
        ref = Reference(model.build_stage, model.loss_fn, prog.num_stages, prog.num_microbatches, **kw)
        res: dict[str, object] = {"stages": sorted(runner.stages)}
        for step in range(steps):
            x, y = model.batch(step)
            out = runner.step(x, y)
            ref_loss = ref.step(x, y)
            if step == 0:
                res["loss"] = out.loss
                res["loss_err"] = rel_err(out.loss, ref_loss) if out.loss is not None else None
                grads = compare(runner.named_gradients(), ref.named_gradients())
                res["grad_err"] = max(grads.values())
                res["grads"] = len(grads)
                res["missing_grads"] = [f"{s}:{n}" for (s, n), g in runner.named_gradients().items() if g is None]
                res["grad_digest"] = digest(runner.named_gradients())  # two transports compare bitwise
                res["transport"] = type(runner.executor.comm).__name__
        slots = runner.executor.slots  # receive buffers made per step (pipec.runtime.exec.buffers)
        res["buffers_made"] = runner.executor.made
        res["buffers"] = None if slots is None else slots.describe()
        res["param_err"] = max(compare(runner.named_parameters(), ref.named_parameters()).values())
        res["param_digest"] = digest(runner.named_parameters())
        results[spec] = res
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
