"""A small U-Net as a pipec model file for a stage graph: encoder levels feed the decoder levels on the way
up through long skip connections, the way a U-Net is drawn, one level per stage.

Run it on examples/unet.pipe (1F1B over the graph) over 4 CPU processes, checked against a single-process
run:

    pipec run examples/unet.pipe -D p=4 -D m=4 --model examples/unet.py --nproc 4 --check

With S stages (S even, k = S / 2 levels) stage i < k is encoder level i and stage S-1-i decoder level i.
The schedule's edges are s -> s + 1 and the skips i -> S-1-i for i < k-1 (the innermost encoder feeds the
innermost decoder directly: that edge is the chain's). Each stage's forward takes its inputs in the order
of the graph's `inputs(s)`, the stages ascending: a decoder level with a skip is `forward(skip, x)`.

    encoder i:   x -> [avg-pool 2 if i > 0] -> conv 3x3 -> GELU           (channels C_i = WIDTH * (i + 1))
    decoder i:   cat(skip_i, x) -> conv 3x3 -> GELU -> [up 2 -> conv 3x3 -> GELU] or, at level 0, conv 1x1
                 (the innermost decoder, level k-1, takes x alone)

It learns to smooth noisy images (a fixed target: the input averaged with its four neighbours). Environment
knobs: UNET_WIDTH (channels of level 0, 4), UNET_SIZE (image side, 16; divisible by 2^(k-1)), UNET_BATCH
(images per step, 8), UNET_DTYPE (float64, so --check can ask for 1e-10), UNET_LR (SGD's, 0.05).
"""

import os

import torch
from torch import nn

WIDTH = int(os.environ.get("UNET_WIDTH", "4"))
SIZE = int(os.environ.get("UNET_SIZE", "16"))
BATCH = int(os.environ.get("UNET_BATCH", "8"))
LR = float(os.environ.get("UNET_LR", "0.05"))
dtype = getattr(torch, os.environ.get("UNET_DTYPE", "float64"))


def channels(level: int) -> int:
    return WIDTH * (level + 1)


def conv(c_in: int, c_out: int, k: int = 3) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, k, padding=k // 2)


class Encoder(nn.Module):
    """Encoder level i: half the resolution of level i-1 (none at level 0), C_i channels."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.pool = nn.AvgPool2d(2) if level > 0 else nn.Identity()
        self.conv = conv(channels(level - 1) if level > 0 else 1, channels(level))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.conv(self.pool(x)))


class Decoder(nn.Module):
    """Decoder level i: the skip from encoder level i and the level below's output (the innermost level takes
    the encoder's output alone), then up to level i-1, or at level 0 the network's output."""

    def __init__(self, level: int, innermost: bool) -> None:
        super().__init__()
        c = channels(level)
        self.innermost = innermost
        self.merge = conv(c if innermost else 2 * c, c)
        if level > 0:
            self.up = nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), conv(c, channels(level - 1)))
            self.head = None
        else:
            self.up = None
            self.head = conv(c, 1, k=1)

    def forward(self, skip: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.merge(torch.cat([skip, x], dim=1))))

    def out(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.up(h)) if self.up is not None else self.head(h)


class Innermost(Decoder):
    """The innermost decoder level: the innermost encoder's output alone (the chain's edge, no skip)."""

    def __init__(self, level: int) -> None:
        super().__init__(level, innermost=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.merge(x)))


def build_stage(stage: int, num_stages: int) -> nn.Module:
    if num_stages % 2:
        raise ValueError(f"the U-Net has an encoder and a decoder level per pair of stages: S = {num_stages} is odd")
    k = num_stages // 2
    if SIZE % 2 ** (k - 1):
        raise ValueError(f"UNET_SIZE={SIZE} must be divisible by 2^{k - 1} for {k} levels")
    if stage < k:
        return Encoder(stage)
    level = num_stages - 1 - stage
    return Innermost(level) if level == k - 1 else Decoder(level, innermost=False)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH noisy images and their smoothed versions; the same in every process (seeded by step)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 1, SIZE, SIZE, generator=g, dtype=dtype)
    near = x.roll(1, 2) + x.roll(-1, 2) + x.roll(1, 3) + x.roll(-1, 3)
    return x, (x + near) / 5


def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)
