"""A model file's layers as a partition file splits them: what `pipec run --partition` runs.

`layer_list` calls the model file's `layers()` with the generator seeded the same way each time, so a
layer's weights do not depend on which stage it lands in; stage s is then an `nn.Sequential` of the layers
the partition file names for it. `model_fingerprint` is the SHA-256 of the layers' names and parameter
shapes (pipec.formats.partition_files.fingerprint), checked against the file's before any process starts.

The runtime's workers read a model file by path, so `partitioned_file` writes a small model file that
imports this module and defines `build_stage` from the partition (and the user's `loss_fn`, `batch`,
`optimizer`, `dtype` as they are).
"""

from __future__ import annotations

import json
import os

import torch

from pipec.formats.partition_files import PartitionFile, fingerprint, read_partition
from pipec.runtime.errors import ModelError
from pipec.runtime.model.contract import Model, load_model

LAYER_SEED = 0  # the generator's seed when `layers()` builds the model


def layer_list(model: Model) -> list[tuple[str, torch.nn.Module]]:
    """`model.layers()`, checked: a non-empty list of (unique name, nn.Module), built under LAYER_SEED."""
    if model.layers is None:
        raise ModelError(f"{model.path}: the model file defines no `layers()` (pipec.runtime.model.contract)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(LAYER_SEED)
        got = model.layers()
    try:
        items = [(str(n), m) for n, m in got]
    except (TypeError, ValueError):
        raise ModelError(f"{model.path}: `layers()` must return a list of (name, torch.nn.Module) pairs") from None
    if not items:
        raise ModelError(f"{model.path}: `layers()` returned no layers")
    names = [n for n, _ in items]
    for n, m in items:
        if not isinstance(m, torch.nn.Module):
            raise ModelError(f"{model.path}: layer `{n}` is a {type(m).__name__}, not a torch.nn.Module")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ModelError(f"{model.path}: `layers()` names `{dup[0]}` twice")
    if model.dtype is not None:
        items = [(n, m.to(model.dtype)) for n, m in items]
    return items


def param_shapes(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in module.named_parameters()]


def model_fingerprint(layers: list[tuple[str, torch.nn.Module]]) -> str:
    return fingerprint([(n, param_shapes(m)) for n, m in layers])


def check_partition(model: Model, path: str, num_stages: int, schedule: str) -> PartitionFile:
    """The partition file, checked against the model (E804; E810 for layers that do not cover the model's
    once, in order, which is said before the file's own fingerprint is checked, to name the layer) and the
    schedule's stage count (E805)."""
    part = read_partition(path, verify=False)
    layers = layer_list(model)
    part.check_model(model_fingerprint(layers), [n for n, _ in layers], model.path)
    part.check_fingerprint()
    part.check_stages(num_stages, schedule)
    return part


def build_stages(model: Model, part: PartitionFile):
    """A `build_stage(stage, num_stages)` making stage s from the file's layers for it."""

    def build_stage(stage: int, num_stages: int) -> torch.nn.Module:
        layers = dict(layer_list(model))
        return torch.nn.Sequential(*(layers[n] for n in part.stages[stage]))

    return build_stage


def namespace(model_path: str, partition_path: str) -> dict:
    """What the written model file defines: the user's model with `build_stage` from the partition."""
    model = load_model(model_path)
    part = read_partition(partition_path)
    ns = {"build_stage": build_stages(model, part), "loss_fn": model.loss_fn, "batch": model.batch}
    if model.optimizer is not None:
        ns["optimizer"] = model.optimizer
    if model.dtype is not None:
        ns["dtype"] = model.dtype
    return ns


def partitioned_file(model_path: str, partition_path: str, folder: str) -> str:
    """Write the model file the workers load (see the module docstring); returns its path."""
    path = os.path.join(folder, "partitioned_model.py")
    args = json.dumps(os.path.abspath(model_path)), json.dumps(os.path.abspath(partition_path))
    with open(path, "w") as f:
        f.write(
            '"""Written by pipec run --partition: the model file\'s layers as the partition file splits them."""\n'
            "from pipec.runtime.model.partitioned import namespace as _namespace\n\n"
            f"globals().update(_namespace({args[0]}, {args[1]}))\n"
        )
    return path


def use_partition(model: Model, partition: str, num_stages: int, schedule: str, folder: str) -> Model:
    """`pipec run --partition`: check the file against the model and schedule, write the model file the
    workers load into `folder` (the caller's temporary folder, which it removes when the run ends) and load
    it (its `path` is the file the workers are to load)."""
    check_partition(model, partition, num_stages, schedule)
    return load_model(partitioned_file(model.path, partition, folder))
