"""The two-encoder model of examples/two_encoders.py written for a chain, as a user must without stage graphs:
the image encoder, then the text encoder, then the decoder, one after the other, each stage passing on what
a later one needs.

Run it on the library's 1F1B (a chain) over 4 CPU processes, checked against a single-process run:

    pipec run 1f1b -D p=4 -D m=4 --model examples/two_encoders_chain.py --nproc 4 --check

The same maths as examples/two_encoders.py, module for module (each stage builds that file's module for
the same stage and nothing else, so weights seeded by (seed, stage) are equal and so are the losses):

    stage 0  image encoder: (images, tokens) -> (image, tokens as floats)
    stage 1  text encoder:  (image, tokens)  -> (image, text)
    stage 2  fusion:        (image, text)    -> x
    stage s  decoder block: x -> x; the last stage with the head

Tensors between stages must be floating point (they carry gradients back), so the tokens travel to the text
encoder as floats and are turned back into indices there (exact: token ids are small integers); their
gradient is zeros. The image encoder goes first because what it passes on (DIM + TOKENS numbers per sample)
is smaller than the images the text encoder would have to pass on (SIZE^2). On the graph
(examples/two_encoders.pipe) both encoders read the micro-batch and run at once on their own ranks; here the
text encoder waits for the image encoder, one more stage deep. benchmarks/stage_graph.py compares the two.
The environment knobs are examples/two_encoders.py's.
"""

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import two_encoders  # noqa: E402  (examples/two_encoders.py: the modules, the loss, the batch, the optimizer)

loss_fn, batch, optimizer, dtype = two_encoders.loss_fn, two_encoders.batch, two_encoders.optimizer, two_encoders.dtype


class ImageFirst(nn.Module):
    """Stage 0: the image encoder; the tokens pass on, as floats."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner(images, tokens), tokens.to(images.dtype)


class TextSecond(nn.Module):
    """Stage 1: the text encoder on the tokens stage 0 passed on; the image's encoding passes on."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return image, self.inner(None, tokens.detach().round().long())


def build_stage(stage: int, num_stages: int) -> nn.Module:
    inner = two_encoders.build_stage(stage, num_stages)  # its checks, and the very module the graph's stage builds
    return ImageFirst(inner) if stage == 0 else TextSecond(inner) if stage == 1 else inner
