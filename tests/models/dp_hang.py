"""A small MLP model file for the PP x DP fault test: one process (PIPEC_HANG_RANK, a job rank) hangs
in its stage's forward at step 2, so its data-parallel peers wait on a collective (REDUCE_GRAD's
all-reduce) that never completes and must give up after the run's timeout, naming rank and instruction.
"""

import os
import time

import torch
from torch import nn

WIDTH = 8
HANG_RANK = int(os.environ.get("PIPEC_HANG_RANK", "-1"))
dtype = torch.float64


class Hang(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta" and torch.is_grad_enabled():
            if int(os.environ.get("RANK", "-1")) == HANG_RANK and self.calls == 2:
                time.sleep(3600)
            self.calls += 1
        return torch.tanh(self.layer(x))


def build_stage(stage: int, num_stages: int) -> nn.Module:
    return nn.Sequential(Hang(), *([nn.Linear(WIDTH, 1)] if stage == num_stages - 1 else []))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, WIDTH, generator=g, dtype=dtype), torch.randn(8, 1, generator=g, dtype=dtype)
