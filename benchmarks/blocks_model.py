"""The benchmarks' model as a pipec model file: BLOCKS blocks of Linear(WIDTH, WIDTH) + GELU in float64.

    pipec run 1f1b -D p=2 -D m=8 --model benchmarks/blocks_model.py --nproc 2 --steps 10
    pipec profile 1f1b -D p=2 -D m=8 --model benchmarks/blocks_model.py -o blocks.toml

The blocks are split evenly over the stages (the stage count must divide BLOCKS); the loss is the MSE
against a fixed random target; a step's batch is ROWS_PER_MB * BLOCKS_M rows (m micro-batches of
ROWS_PER_MB rows when BLOCKS_M is the schedule's m). The same data every step, SGD. Environment knobs:
BLOCKS (16), BLOCKS_WIDTH (256), BLOCKS_ROWS (32 rows per micro-batch), BLOCKS_M (8).
"""

import os

import torch
from torch import nn

BLOCKS = int(os.environ.get("BLOCKS", "16"))
WIDTH = int(os.environ.get("BLOCKS_WIDTH", "256"))
ROWS = int(os.environ.get("BLOCKS_ROWS", "32"))
M = int(os.environ.get("BLOCKS_M", "8"))
dtype = torch.float64


def build_stage(stage: int, num_stages: int) -> nn.Module:
    if BLOCKS % num_stages:
        raise ValueError(f"{num_stages} stages do not divide {BLOCKS} blocks evenly")
    n = BLOCKS // num_stages
    return nn.Sequential(*[mod for _ in range(n) for mod in (nn.Linear(WIDTH, WIDTH), nn.GELU())])


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS * M, WIDTH, generator=g, dtype=dtype)
    return x, torch.randn(ROWS * M, WIDTH, generator=g, dtype=dtype)


def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)
