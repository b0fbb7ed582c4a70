"""The U-Net of examples/unet.py written for a chain, as a user must without stage graphs: every skip is
carried through the stages between its encoder and its decoder, passed along with each stage's output.

Run it on the library's 1F1B (a chain) over 4 CPU processes, checked against a single-process run:

    pipec run 1f1b -D p=4 -D m=4 --model examples/unet_chain.py --nproc 4 --check

The same maths as examples/unet.py, module for module (each stage builds examples/unet.py's Encoder or
Decoder and nothing else, so weights seeded by (seed, stage) are equal and so are the losses); only what
travels differs. With S stages (k = S / 2 levels) and e_i the output of encoder level i:

    encoder i < k-1: (e_0 .. e_{i-1}) -> (e_0 .. e_i)          (stage 0 takes the images)
    encoder k-1:     (e_0 .. e_{k-2}) -> (e_0 .. e_{k-2}, e_{k-1})
    decoder k-1:     (e_0 .. e_{k-2}, e_{k-1}) -> (e_0 .. e_{k-2}, d)
    decoder l < k-1: (e_0 .. e_l, x) -> (e_0 .. e_{l-1}, d)     (level 0: d alone, the network's output)

so the message between stages i and i+1 holds every skip still to be used, where the graph (examples/unet.pipe)
sends each skip once, from its encoder straight to its decoder. benchmarks/stage_graph.py compares the two.
The environment knobs are examples/unet.py's.
"""

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import unet  # noqa: E402  (examples/unet.py: the modules, the loss, the batch, the optimizer)

loss_fn, batch, optimizer, dtype = unet.loss_fn, unet.batch, unet.optimizer, unet.dtype


class CarryEncoder(nn.Module):
    """Encoder level i on the chain: e_i from e_{i-1} (the images at level 0), the skips received passed on."""

    def __init__(self, inner: nn.Module, first: bool) -> None:
        super().__init__()
        self.inner, self.first = inner, first

    def forward(self, *xs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return self.inner(*xs) if self.first else (*xs, self.inner(xs[-1]))


class CarryDecoder(nn.Module):
    """Decoder level l on the chain: its skip e_l (the last one carried) and x, e_0 .. e_{l-1} passed on; the
    innermost level takes e_{k-1} alone."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *xs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.inner.innermost:
            rest, d = xs[:-1], self.inner(xs[-1])
        else:
            rest, d = xs[:-2], self.inner(xs[-2], xs[-1])
        return (*rest, d) if rest else d


def build_stage(stage: int, num_stages: int) -> nn.Module:
    inner = unet.build_stage(stage, num_stages)  # its checks, and the very module the graph's stage builds
    return CarryEncoder(inner, stage == 0) if stage < num_stages // 2 else CarryDecoder(inner)
