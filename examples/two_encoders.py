"""Two encoders fanning into a decoder, as a pipec model file for a stage graph: an image encoder and a text
encoder, each a stage of its own that reads the micro-batch, both feeding the decoder's first stage.

Run it on examples/two_encoders.pipe (each encoder on its own rank, the two running at once) over 4 CPU
processes, checked against a single-process run:

    pipec run examples/two_encoders.pipe -D m=4 --model examples/two_encoders.py --nproc 4 --check

The batch's inputs are (images, tokens). Stage 0 and stage 1 are sources (stages without inputs): each is
called with the micro-batch's inputs, as a chain's stage 0 is, and uses its own. Stage 2 takes the two
encoders' outputs in the order of the graph's `inputs(2)`, (stage 0's, stage 1's): `forward(image, text)`.
Stages 3 .. S-1 are the rest of the decoder, one residual block each, the last with the head.

    stage 0  image encoder: conv 3x3 -> GELU -> mean over the pixels -> Linear      -> (B, DIM)
    stage 1  text encoder:  embedding -> mean over the tokens -> Linear -> GELU     -> (B, DIM)
    stage 2  fusion:        Linear(cat(image, text)) -> GELU                         -> (B, DIM)
    stage s  decoder block: x + GELU(Linear(x)), TWO_LAYERS times; the last stage then Linear -> (B, 1)

It learns a fixed random function of both inputs. Environment knobs: TWO_DIM (16), TWO_BATCH (8),
TWO_SIZE (image side, 8), TWO_TOKENS (tokens per text, 6), TWO_VOCAB (32), TWO_LAYERS (residual layers per
decoder block, 1; at 2 a block costs what the fusion stage costs, balanced stages for benchmarks/stage_graph.py),
TWO_DTYPE (float64), TWO_LR (0.05).
"""

import os

import torch
from torch import nn

DIM = int(os.environ.get("TWO_DIM", "16"))
BATCH = int(os.environ.get("TWO_BATCH", "8"))
SIZE = int(os.environ.get("TWO_SIZE", "8"))
TOKENS = int(os.environ.get("TWO_TOKENS", "6"))
VOCAB = int(os.environ.get("TWO_VOCAB", "32"))
LAYERS = int(os.environ.get("TWO_LAYERS", "1"))
LR = float(os.environ.get("TWO_LR", "0.05"))
dtype = getattr(torch, os.environ.get("TWO_DTYPE", "float64"))


class ImageEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, DIM, 3, padding=1)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(nn.functional.gelu(self.conv(images)).mean(dim=(2, 3)))


class TextEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.proj(self.embed(tokens).mean(dim=1)))


class Fusion(nn.Module):
    def __init__(self, last: bool) -> None:
        super().__init__()
        self.mix = nn.Linear(2 * DIM, DIM)
        self.head = nn.Linear(DIM, 1) if last else None

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.mix(torch.cat([image, text], dim=1)))
        return self.head(h) if self.head is not None else h


class Block(nn.Module):
    def __init__(self, last: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.more = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS - 1))  # empty by default
        self.head = nn.Linear(DIM, 1) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + nn.functional.gelu(self.linear(x))
        for layer in self.more:
            h = h + nn.functional.gelu(layer(h))
        return self.head(h) if self.head is not None else h


def build_stage(stage: int, num_stages: int) -> nn.Module:
    if num_stages < 3:
        raise ValueError(f"two encoders and a decoder need at least 3 stages, not {num_stages}")
    last = stage == num_stages - 1
    return [ImageEncoder, TextEncoder][stage]() if stage < 2 else Fusion(last) if stage == 2 else Block(last)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def batch(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((images, tokens), targets), the same in every process (seeded by step); the target is a fixed
    function of the image's mean brightness and the text's token sum."""
    g = torch.Generator().manual_seed(2000 + step)
    images = torch.randn(BATCH, 1, SIZE, SIZE, generator=g, dtype=dtype)
    tokens = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g)
    target = torch.tanh(images.mean(dim=(1, 2, 3)) * 4 + (tokens.sum(dim=1) % 7 - 3).to(dtype) / 3)
    return (images, tokens), target.unsqueeze(1)


def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)
