"""Splitting a whole batch into micro-batches along dimension 0, and moving it to the stage's device.

A batch already given as its micro-batches (`MicroBatches`, what `batch_of` makes of a model file's list of
(inputs, targets) pairs) is taken as it is: its micro-batches may differ in shape (variable lengths)."""

from __future__ import annotations

from typing import Any

import torch

from pipec.runtime.errors import PipelineError


class MicroBatches(tuple):
    """A batch given as its m micro-batches, each a tensor or a tuple/list/dict of tensors, in order."""


def batch_of(value: Any, where: str = "batch(step)") -> tuple[Any, Any]:
    """(inputs, targets) from what a model file's `batch(step)` returned: an (inputs, targets) pair, the
    whole batch; or a list of (inputs, targets) pairs, one per micro-batch, as two `MicroBatches`."""
    if isinstance(value, list):
        if not value or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in value):
            raise PipelineError(
                f"{where} returned a list: it must hold one (inputs, targets) pair per micro-batch "
                "(or return one (inputs, targets) tuple for the whole batch)"
            )
        return MicroBatches(p[0] for p in value), MicroBatches(p[1] for p in value)
    if isinstance(value, tuple) and len(value) == 2:
        return value
    raise PipelineError(f"{where} must return (inputs, targets) or a list of such pairs, not {type(value).__name__}")


def split(batch: Any, m: int, what: str = "batch") -> list[Any]:
    """m micro-batches of a tensor, or of a tuple/list/dict of tensors, along dimension 0.

    Uneven sizes are allowed (torch.tensor_split), empty micro-batches are not. `MicroBatches` are taken as
    they are (there must be m).
    """
    if isinstance(batch, MicroBatches):
        if len(batch) != m:
            raise PipelineError(f"the {what} come as {len(batch)} micro-batches, but the Program has m={m}")
        return list(batch)
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] < m:
            rows = batch.shape[0] if batch.dim() else "a 0-d tensor"
            raise PipelineError(
                f"the {what} has {rows} rows along dimension 0; it cannot split into m={m} micro-batches"
            )
        return list(torch.tensor_split(batch, m, dim=0))
    if isinstance(batch, (tuple, list)):
        parts = [split(x, m, what) for x in batch]
        return [type(batch)(p[i] for p in parts) for i in range(m)]
    if isinstance(batch, dict):
        parts = {k: split(v, m, what) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(m)]
    raise PipelineError(f"the {what} must be a tensor, or a tuple, list or dict of tensors, not {type(batch).__name__}")


def to_device(x: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """Move tensors to the device; cast floating ones to dtype when given. A tensor already there (with that
    dtype) is returned as it is, what `Tensor.to` returns too, without its argument parsing (a call per
    micro-batch and step)."""
    if isinstance(x, torch.Tensor):
        if (x.dtype is dtype or dtype is None or not x.is_floating_point()) and x.device == device:
            return x
        if dtype is not None and x.is_floating_point():
            return x.to(device=device, dtype=dtype)
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device, dtype) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device, dtype) for k, v in x.items()}
    return x


def as_args(x: Any) -> tuple:
    """The first stage's positional arguments: a tuple/list is spread, anything else is one argument."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)
