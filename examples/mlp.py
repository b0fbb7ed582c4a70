"""A deep MLP as a pipec model file: regression of a fixed random teacher network.

Run it on a library schedule over 4 CPU processes, checked against a single-process run:

    pipec run 1f1b -D p=4 -D m=8 --model examples/mlp.py --nproc 4 --check

The model is `MLP_DEPTH` residual blocks x + GELU(Linear(MLP_WIDTH, MLP_WIDTH)(x)) / sqrt(depth), split
evenly over the stages (a stage gets at least one block), then a Linear to one output on the last stage;
it learns a fixed random teacher network from fresh random inputs each step (the loss falls: about
0.66 at step 1, under 0.05 by step 50 with 1f1b p=4 m=8). Environment knobs: MLP_WIDTH (64),
MLP_DEPTH (16), MLP_BATCH rows per step (64), MLP_DTYPE (float64, so --check can ask for 1e-10;
float32 for speed), MLP_LR (Adam's learning rate, 1e-3).
"""

import os

import torch
from torch import nn

WIDTH = int(os.environ.get("MLP_WIDTH", "64"))
DEPTH = int(os.environ.get("MLP_DEPTH", "16"))
BATCH = int(os.environ.get("MLP_BATCH", "64"))
LR = float(os.environ.get("MLP_LR", "1e-3"))
dtype = getattr(torch, os.environ.get("MLP_DTYPE", "float64"))


def blocks_of(stage: int, num_stages: int) -> range:
    """The blocks stage `stage` holds: an even split of max(DEPTH, num_stages) blocks."""
    depth = max(DEPTH, num_stages)
    return range(stage * depth // num_stages, (stage + 1) * depth // num_stages)


class Block(nn.Module):
    """x + GELU(Linear(x)) / sqrt(depth): the scaled residual keeps a deep stack trainable."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.scale = depth**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * nn.functional.gelu(self.linear(x))


def build_stage(stage: int, num_stages: int) -> nn.Module:
    layers: list[nn.Module] = [Block(max(DEPTH, num_stages)) for _ in blocks_of(stage, num_stages)]
    if stage == num_stages - 1:
        layers.append(nn.Linear(WIDTH, 1))
    return nn.Sequential(*layers)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


_teacher = None


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH rows of inputs and the teacher's outputs; the same for every process (seeded by step)."""
    global _teacher
    if _teacher is None:
        g = torch.Generator().manual_seed(1234)
        a = torch.randn(WIDTH, 8, generator=g, dtype=dtype) / WIDTH**0.5
        _teacher = (a, torch.randn(8, 1, generator=g, dtype=dtype) / 8**0.5)
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=dtype)
    y = torch.tanh(x @ _teacher[0]) @ _teacher[1]
    return x, y


def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)
