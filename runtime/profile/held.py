"""What each stage holds, in bytes, measured through the runtime's own `Stage` and saved-tensor holders:
the `saved_bytes`, `wsaved_bytes`, `input_bytes` and `state_bytes` of a cost file (docs/memory.md), and the
seconds an OFFLOAD or RELOAD of its saved tensors takes. `pipec profile` writes them beside the times
(pipec.runtime.profile.stages); `pipec run` merges them into the memory the simulator predicts.
"""

from __future__ import annotations

import statistics
import time

import torch

from pipec.ir.program import Program
from pipec.runtime.exec.microbatch import as_args, batch_of, split, to_device
from pipec.runtime.exec.saved import Pool, state_bytes, tensor_bytes
from pipec.runtime.exec.stage import Stage
from pipec.runtime.model.contract import Model, default_optimizer
from pipec.runtime.profile.common import Wiring, stage_modules


def stage_bytes(
    program: Program,
    model: Model,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    loss_scale: float | None = None,
    dp: int = 1,
    reps: int = 5,
) -> dict[str, list]:
    """Per stage, in bytes, through the runtime's own `Stage` and saved-tensor holders (pipec.runtime.exec.saved)
    on micro-batch 0 of `batch(0)`: `saved_bytes`, what its FWD keeps for its BWD; `wsaved_bytes`, what its
    BWD keeps for its WGRAD (split backward: the graph stays whole until WGRAD, so about all of it);
    `input_bytes`, what a recomputed FWD keeps (its input; the first stage's is the step's data, held
    anyway: 0); `state_bytes`, its parameters, their gradients and the optimizer's state after a step of
    the model file's optimizer. And `offload`: the seconds of one OFFLOAD or RELOAD of its saved tensors as
    the runtime runs them (median of `reps`; on a CPU device nothing is copied, so microseconds)."""
    device = torch.device(device)
    S, m = program.num_stages, program.num_sequences  # with token slices, each a whole sequence
    scale = 1.0 / m if loss_scale is None else loss_scale
    modules = stage_modules(model, S, seed, device)
    make_opt = model.optimizer or default_optimizer
    inputs, targets = batch_of(model.batch(0), f"{model.path}: batch(0)")
    if dp > 1:
        from pipec.runtime.exec.replicas import slice_replica

        inputs, targets = slice_replica(inputs, dp, 0, "inputs"), slice_replica(targets, dp, 0, "targets")
    x = as_args(to_device(split(inputs, m, "inputs")[0], device, model.dtype))
    y = to_device(split(targets, m, "targets")[0], device)
    out: dict[str, list] = {k: [0] * S for k in ("saved_bytes", "wsaved_bytes", "input_bytes", "state_bytes")}
    out["offload"] = [0.0] * S
    for split_backward in (False, True) if program.split_backward else (False,):
        pool = Pool()
        wiring = Wiring(getattr(program, "graph", None), S)  # the chain, or the stage graph's edges
        stages = []
        for s, mod in enumerate(modules):
            loss_fn = model.loss_fn if s == S - 1 else None
            st = Stage(s, S, mod, loss_fn, scale, split_backward, None, **wiring.stage_options(s))
            st.pool = pool
            stages.append(st)
        for s, st in enumerate(stages):
            args = wiring.inputs(s, x)
            if args is not x:
                out["input_bytes"][s] = tensor_bytes(args)
            wiring.passed(s, st.forward(0, args, y if s == S - 1 else None))
            out["saved_bytes"][s] = pool.held(0, s)
        for s in reversed(range(S)):
            if not split_backward:
                seconds = []
                for _ in range(reps):  # as the runtime runs them: on CPU, the accounting only
                    t0 = time.perf_counter()
                    pool.offload(0, s)
                    pool.reload(0, s)
                    pool.ready(0, s)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    seconds.append((time.perf_counter() - t0) / 2)
                out["offload"][s] = statistics.median(seconds)
            wiring.input_grads(s, stages[s].backward(0, wiring.out_grads(s)))
            if split_backward:
                out["wsaved_bytes"][s] = pool.held(0, s)
        for s in reversed(range(S)) if split_backward else ():
            stages[s].wgrad(0)
        if not split_backward:
            for s, (st, mod) in enumerate(zip(stages, modules)):
                params = [p for p in mod.parameters() if p.requires_grad]
                opt = make_opt(params) if params else None
                if opt is not None:
                    opt.step()
                out["state_bytes"][s] = state_bytes(mod, opt)
                st.zero_grad()
    return out
