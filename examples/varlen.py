"""Variable-length micro-batches: the small GPT of examples/gpt.py on micro-batches whose sequence length
differs from one micro-batch to the next and from step to step.

    pipec run 1f1b -D p=2 -D m=4 --model examples/varlen.py --nproc 2 --steps 3 --check

`batch(step)` returns a list of (inputs, targets) pairs, one per micro-batch (the model contract of
pipec.runtime.model.contract): VARLEN_MICROBATCHES of them (4, the schedule's m), each VARLEN_ROWS windows of the
text (8) of one length. The lengths follow the step pair by pair (steps 0 and 1 share theirs, steps 2 and 3
theirs, ...), so a run shows the shapes exchanged again only at a step whose lengths changed: the
runtime redoes the exchange at such a step and only there. Lengths are between 2 and GPT_CONTEXT (32).

The model, its loss (the mean cross-entropy of each micro-batch's tokens) and its optimizer are
examples/gpt.py's, imported from the file next to this one, with its GPT_* knobs.
"""

import importlib.util
import os

import torch

_spec = importlib.util.spec_from_file_location("pipec_example_gpt", os.path.join(os.path.dirname(__file__), "gpt.py"))
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)

MICROBATCHES = int(os.environ.get("VARLEN_MICROBATCHES", "4"))
ROWS = int(os.environ.get("VARLEN_ROWS", "8"))

build_stage = gpt.build_stage
loss_fn = gpt.loss_fn
optimizer = gpt.optimizer
dtype = gpt.dtype


def lengths(step: int) -> list[int]:
    """Each micro-batch's sequence length at this step: the same for steps 2k and 2k + 1."""
    g = torch.Generator().manual_seed(30_000 + step // 2)
    return torch.randint(2, gpt.CONTEXT + 1, (MICROBATCHES,), generator=g).tolist()


def batch(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (inputs, targets) pair per micro-batch: ROWS windows of the text, of that micro-batch's length."""
    g = torch.Generator().manual_seed(40_000 + step)
    out = []
    for n in lengths(step):
        start = torch.randint(0, len(gpt.DATA) - n - 1, (ROWS,), generator=g)
        windows = torch.stack([gpt.DATA[s : s + n + 1] for s in start.tolist()])
        out.append((windows[:, :-1], windows[:, 1:]))
    return out
