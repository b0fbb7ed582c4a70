"""Profile a model layer by layer: the per-layer cost table `pipec partition` searches over.

    pipec partition 1f1b -D p=4 -D m=8 --model examples/uneven.py --save-layers layers.json -o part.json

The model file's `layers()` (pipec.runtime.model.contract) gives the named layers in order. Each layer is timed as
if it were a stage of its own, by the stage profiler of `pipec profile` (pipec.runtime.profile.stages's
`_measure`: the runtime's own `Stage` code on the micro-batches of `batch(0)`, forward with the loss on
the last layer, full backward, input-gradient then weight-gradient passes, medians of `reps` after
`warmup`), so a layer's times are what its share of a stage's would be. Memory per layer:

- `act_bytes`: the bytes autograd saves for the backward during its forward of one micro-batch
  (saved-tensor hooks), counting each storage once and leaving out parameters (held anyway);
- `out_bytes`: what it hands on (the message when a stage ends with it);
- `param_bytes`: its parameters (gradients as large); `state_bytes`: the optimizer's state for them after
  a step (SGD without momentum: none; Adam: two tensors per parameter).

A stage's times in a run are then about the sums of its layers': what a stage boundary adds (a message)
is the simulator's, and what fusing layers inside a stage saves is not modelled.
"""

from __future__ import annotations

import dataclasses
import os
import time
import types
from collections.abc import Callable

import torch

from pipec.formats.partition_files import LayerTable, make_table
from pipec.runtime.errors import ModelError
from pipec.runtime.exec.microbatch import as_args, split, to_device
from pipec.runtime.exec.saved import Pool, storages
from pipec.runtime.model.contract import Model, default_optimizer
from pipec.runtime.model.partitioned import layer_list, param_shapes
from pipec.runtime.profile.stages import _measure, default_threads


def profile_layers(
    model: Model,
    microbatches: int,
    *,
    reps: int = 10,
    warmup: int = 2,
    threads: int | None = None,
    ranks: int = 1,
    progress: Callable[[str], None] | None = None,
) -> LayerTable:
    """Time and size every layer of `model.layers()` on micro-batches of 1/`microbatches` of `batch(0)`,
    with the threads a rank of a `ranks`-process run gets (`threads` to choose)."""
    say = progress or (lambda _: None)
    layers = layer_list(model)
    L = len(layers)
    threads = threads or default_threads(ranks)  # a rank's share of the CPUs, as in a run of `ranks`
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        say(f"timing {L} layers one at a time, {warmup} + {reps} rounds")
        # Each layer as a stage of an L-stage pipeline, built as `layer_list` builds it (the same weights).
        modules = [mod for _, mod in layers]
        stage_model = dataclasses.replace(model, build_stage=lambda s, n: modules[s])
        shape = types.SimpleNamespace(
            num_stages=L,
            num_microbatches=microbatches,
            num_sequences=microbatches,
            name="layers",
            params=(),
            split_backward=True,
        )
        prof = _measure(shape, stage_model, reps, warmup, torch.device("cpu"), 0, None)
        say("sizing saved activations and optimizer state")
        act = _saved_bytes(model, modules, microbatches)
        state = [_state_bytes(model, mod) for mod in modules]
    finally:
        torch.set_num_threads(old)
    rows = []
    for i, (name, mod) in enumerate(layers):
        rows.append(
            {
                "name": name,
                "F": prof.forward[i],
                "B": prof.input_backward[i],
                "W": prof.weight_backward[i],
                "full_backward": prof.full_backward[i],
                "act_bytes": act[i],
                "out_bytes": prof.act_bytes[i],
                "param_bytes": prof.param_bytes[i],
                "state_bytes": state[i],
                "params": [[p, list(s)] for p, s in param_shapes(mod)],
            }
        )
    measured = {
        "by": "pipec.runtime.profile.layers",
        "reps": reps,
        "warmup": warmup,
        "threads": threads,
        "dtype": str(model.dtype).removeprefix("torch.") if model.dtype else None,
        "host": os.uname().nodename,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_1min": round(os.getloadavg()[0], 2),
    }
    return make_table(rows, microbatches=microbatches, path=model.path, measured=measured)


def _saved_bytes(model: Model, modules: list[torch.nn.Module], m: int) -> list[int]:
    """Bytes autograd saves in each layer's forward of micro-batch 0 (the last layer's loss included),
    counted by the runtime's saved-tensor holders (pipec.runtime.exec.saved; parameters left out)."""
    inputs, targets = model.batch(0)
    args = as_args(to_device(split(inputs, m, "inputs")[0], "cpu", model.dtype))
    target = split(targets, m, "targets")[0]
    out: list[int] = []
    for i, mod in enumerate(modules):
        pool = Pool()
        if i > 0:  # a stage's input requires grad (its gradient goes back)
            args = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in args)
        with pool.saving(0, i, storages(mod.parameters())):
            y = mod(*args)
            if i == len(modules) - 1:
                model.loss_fn(y, target)
        out.append(pool.held(0, i))
        args = tuple(t.detach() for t in (y if isinstance(y, tuple) else (y,)))
    return out


def _state_bytes(model: Model, mod: torch.nn.Module) -> int:
    """The optimizer's state for this layer's parameters after one step (on zero gradients, on a copy)."""
    import copy

    mod = copy.deepcopy(mod)
    params = [p for p in mod.parameters() if p.requires_grad]
    if not params:
        return 0
    opt = (model.optimizer or default_optimizer)(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += v.numel() * v.element_size()
    return int(total)


def require_layers(model: Model) -> None:
    if model.layers is None:
        raise ModelError(
            f"{model.path}: `pipec partition` needs `layers()` in the model file (pipec.runtime.model.contract)"
        )
