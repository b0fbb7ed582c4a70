"""Splitting a whole batch into micro-batches along dimension 0, and moving it to the stage's device."""

from __future__ import annotations

from typing import Any

import torch

from pipec.runtime.errors import PipelineError


def split(batch: Any, m: int, what: str = "batch") -> list[Any]:
    """m micro-batches of a tensor, or of a tuple/list/dict of tensors, along dimension 0.

    Uneven sizes are allowed (torch.tensor_split), empty micro-batches are not.
    """
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
    """Move tensors to the device; cast floating ones to dtype when given."""
    if isinstance(x, torch.Tensor):
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
