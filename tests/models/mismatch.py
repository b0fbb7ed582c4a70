"""A model file whose stage 1 expects 6 features while stage 0 outputs 8 (a shape-mismatch test)."""

import torch
from torch import nn

dtype = torch.float64


def build_stage(stage: int, num_stages: int) -> nn.Module:
    return nn.Linear(6 if stage == 1 else 8, 8)


def loss_fn(output, target):
    return ((output - target) ** 2).mean()


def batch(step: int):
    return torch.randn(12, 8, dtype=dtype), torch.randn(12, 8, dtype=dtype)
