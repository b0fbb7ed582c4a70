"""What every profiler of `pipec profile` shares: the stage modules as a run builds them, and how measured
numbers are written (six significant digits, enough for any timer and short in a cost file)."""

from __future__ import annotations

import torch

from pipec.runtime.model.contract import Model, build_stage_module


def rounded(xs: list[float]) -> list[float]:
    """Each number to six significant digits."""
    return [float(f"{x:.6g}") for x in xs]


def stage_modules(model: Model, S: int, seed: int, device: torch.device) -> list[torch.nn.Module]:
    """Every stage's module as a run builds it (seeded by (seed, stage))."""
    return [
        build_stage_module(model.build_stage, s, S, seed=seed, dtype=model.dtype, device=device, where="build_stage")
        for s in range(S)
    ]
