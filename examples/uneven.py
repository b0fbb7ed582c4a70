"""A model with uneven layers, for `pipec partition` (docs/partition.md): a cheap first layer, residual
blocks of growing width, and a heavy last layer, like an embedding, a transformer's blocks and an LM head.

    pipec partition 1f1b -D p=4 -D m=8 --model examples/uneven.py -o part.json
    pipec run 1f1b -D p=4 -D m=8 --model examples/uneven.py --partition part.json --check

`layers()` gives the named layers in order (pipec.runtime.model.contract); without --partition, `build_stage`
splits them evenly (stage s takes layers L*s//S to L*(s+1)//S - 1, the uniform split `pipec partition`
compares with), with the same weights. The task: regress a fixed random teacher from fresh inputs.
Environment knobs: UNEVEN_WIDTH (64), UNEVEN_BATCH rows per step (256), UNEVEN_HEAD hidden width of the
last layer (4096), UNEVEN_DTYPE (float64).
"""

import os

import torch
from torch import nn

WIDTH = int(os.environ.get("UNEVEN_WIDTH", "64"))
BATCH = int(os.environ.get("UNEVEN_BATCH", "256"))
HEAD = int(os.environ.get("UNEVEN_HEAD", "4096"))
HIDDEN = (64, 64, 128, 128, 256, 256, 512, 512, 1024, 1024)  # the blocks' inner widths
dtype = getattr(torch, os.environ.get("UNEVEN_DTYPE", "float64"))


class Block(nn.Module):
    """x + Linear(GELU(Linear(x))) / sqrt(blocks): its cost grows with its inner width."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, hidden)
        self.down = nn.Linear(hidden, WIDTH)
        self.scale = len(HIDDEN) ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.down(nn.functional.gelu(self.up(x)))


def layers() -> list[tuple[str, nn.Module]]:
    torch.manual_seed(0)  # the same weights however the layers are split
    out: list[tuple[str, nn.Module]] = [("embed", nn.Linear(WIDTH, WIDTH))]
    out += [(f"block{i}", Block(h)) for i, h in enumerate(HIDDEN)]
    out.append(("head", nn.Sequential(nn.Linear(WIDTH, HEAD), nn.GELU(), nn.Linear(HEAD, 1))))
    return out


def build_stage(stage: int, num_stages: int) -> nn.Module:
    every = layers()
    n = len(every)
    return nn.Sequential(*(m for _, m in every[n * stage // num_stages : n * (stage + 1) // num_stages]))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH rows of inputs and a fixed teacher's outputs, the same in every process (seeded by step)."""
    g = torch.Generator().manual_seed(1234)
    a = torch.randn(WIDTH, 1, generator=g, dtype=dtype) / WIDTH**0.5
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=dtype)
    return x, torch.tanh(x @ a)
