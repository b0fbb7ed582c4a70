"""The model contract: a Python file with `build_stage`, `loss_fn` and `batch`, loaded and checked.

A model file defines

    build_stage(stage: int, num_stages: int) -> torch.nn.Module
    loss_fn(output, target) -> Tensor          # on the last stage's output
    batch(step: int) -> (inputs, targets)      # the whole batch; split into m micro-batches on dim 0
                   or [(inputs, targets), ...]   # or its m micro-batches, each of its own shape

and optionally

    optimizer(params) -> torch.optim.Optimizer # default: SGD(lr=0.01)
    dtype = torch.float64                      # (or "float64") parameters and floating inputs
    layers() -> list[tuple[str, torch.nn.Module]]  # the whole model as named layers, in order

`layers()` lets `pipec partition` profile the model layer by layer and choose each stage's layers, and
`pipec run --partition` build stage s as an nn.Sequential of the layers the partition file gives it
(docs/partition.md): each layer takes the previous one's output, the first `batch`'s inputs, and
`loss_fn` takes the last one's. It is called with the generator seeded the same way every time, so a
layer's weights do not depend on the stage it lands in.

`batch` returning a list gives the micro-batches themselves (pipec.runtime.exec.microbatch.batch_of), one
(inputs, targets) pair each, as many as the schedule's m: they may differ in shape (packed batches of
different sequence lengths), and from step to step. The runtime exchanges the shapes between stages
again at a step whose micro-batch input shapes differ from the last exchange's, and only then (a
whole batch, instead, keeps the shapes of the first step: a later change is an error). examples/varlen.py
does it.

Token slices (a schedule with `slices n`): every micro-batch is cut along dim 1 of its inputs and
targets into the schedule's slices, so dim 1 must be the schedule's `seqlen`; every stage module has the
key/value cache interface (`module(*inputs, past_kv=past) -> (output, kv)`, pipec.runtime.exec.slices), and
`loss_fn` is a mean over the tokens (each slice's loss counts its share of the tokens).

A stage graph (a schedule with `edge` declarations, pipec.ir.graph): stage s's module takes its input stages'
outputs as positional arguments in the order of `graph.inputs(s)` (a stage without inputs takes the batch's
inputs) and returns one tensor (sent on every out-edge) or a tuple with one entry per out-edge in the order
of `graph.outputs(s)` (docs/runtime.md, "Stage graphs"; examples/unet.py, examples/two_encoders.py).

Every error names the file and what is missing or wrong.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipec.runtime.errors import ModelError
from pipec.runtime.exec.shapes import to_dtype

REQUIRED = {
    "build_stage": ("stage", "num_stages"),
    "loss_fn": ("output", "target"),
    "batch": ("step",),
}
OPTIONAL = {"optimizer": ("params",), "layers": ()}


@dataclass(frozen=True)
class Model:
    """A user's model file, loaded (`load_model(path)`): how to build stage s of S, the loss, the batches.

    The contract of docs/runtime.md: `build_stage(s, S)`, `loss_fn(output, target)`, `batch(step)`, and optionally
    `optimizer(params)` and `layers`; every rank and the reference build their stages from it, so same seeds give
    the same weights.
    """

    path: str
    build_stage: Callable[[int, int], torch.nn.Module]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batch: Callable[[int], tuple[Any, Any]]
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
    dtype: torch.dtype | None = None
    layers: Callable[[], list[tuple[str, torch.nn.Module]]] | None = None


def load_model(path: str) -> Model:
    """Import a model file and check the contract; raises ModelError naming the file."""
    if not os.path.isfile(path):
        raise ModelError(f"{path}: no such model file")
    name = "pipec_model_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelError(f"{path}: cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ModelError(f"{path}: importing the model file failed: {type(e).__name__}: {e}") from e
    problems = []
    for fn, args in REQUIRED.items():
        problems += _check_callable(module, fn, args, required=True)
    for fn, args in OPTIONAL.items():
        problems += _check_callable(module, fn, args, required=False)
    dtype = getattr(module, "dtype", None)
    if dtype is not None:
        try:
            dtype = to_dtype(dtype)
        except ValueError as e:
            problems.append(f"`dtype` {e}")
    if problems:
        raise ModelError(f"{path}: not a valid pipec model file:\n" + "\n".join(f"  - {p}" for p in problems))
    return Model(
        path=path,
        build_stage=module.build_stage,
        loss_fn=module.loss_fn,
        batch=module.batch,
        optimizer=getattr(module, "optimizer", None),
        dtype=dtype,
        layers=getattr(module, "layers", None),
    )


def _check_callable(module: object, fn: str, args: tuple[str, ...], required: bool) -> list[str]:
    sig = f"{fn}({', '.join(args)})"
    if not hasattr(module, fn):
        return [f"missing `{sig}`"] if required else []
    f = getattr(module, fn)
    if not callable(f):
        return [f"`{fn}` must be a function {sig}, not {type(f).__name__}"]
    try:
        inspect.signature(f).bind(*args)
    except TypeError:
        return [f"`{fn}` must take {len(args)} argument(s) {sig}; it is defined as {fn}{inspect.signature(f)}"]
    except ValueError:  # builtins without a signature: accept
        pass
    return []


def build_stage_module(
    build_stage: Callable[[int, int], torch.nn.Module],
    stage: int,
    num_stages: int,
    *,
    seed: int | None = 0,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    where: str = "build_stage",
) -> torch.nn.Module:
    """Build one stage's module with the generator seeded by (seed, stage), so every process
    (and the single-process reference) gets the same weights; the caller's RNG state is kept."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed * 1_000_003 + stage)
        module = build_stage(stage, num_stages)
    if not isinstance(module, torch.nn.Module):
        raise ModelError(f"{where}({stage}, {num_stages}) returned {type(module).__name__}, not a torch.nn.Module")
    if dtype is not None:
        module = module.to(dtype)
    return module.to(device)


def default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)
