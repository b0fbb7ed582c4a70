"""A small GPT-style transformer as a pipec model file: a character-level language model.

Train it on a library schedule over 2 CPU processes (the loss falls from about 3.5 to about 2.0 in 20 steps):

    pipec run 1f1b -D p=2 -D m=4 --model examples/gpt.py --nproc 2 --steps 20

and check it against a single-process run (float64 by default, so the tolerance is 1e-10):

    pipec run zb-h1 -D p=2 -D m=4 --model examples/gpt.py --nproc 2 --steps 3 --check

The model: token and position embeddings, GPT_LAYERS pre-norm transformer blocks (causal multi-head
self-attention, then a 4x MLP with GELU, each in a residual branch), a final LayerNorm and a linear head
to the vocabulary. The first stage holds the embeddings, the last the final norm and the head, and the
blocks are split evenly over the stages (each stage gets at least one). The head is untied from the token
embedding: tying them would share one weight between the first and the last stage, whose gradients a
pipeline would have to add up across ranks. The loss is the cross-entropy of the next character.

Token slices (TeraPipe, docs/terapipe.md): every stage has the key/value cache interface of
pipec.runtime.exec.slices, `stage(x, past_kv=past) -> (y, kv)` with kv each block's keys and values
(batch, heads, tokens, head dim), so a sliced schedule runs it; its `seqlen` must be GPT_CONTEXT:

    pipec run terapipe -D p=2 -D m=2 -D n=4 -D L=32 --model examples/gpt.py --nproc 2 --check

Called without `past_kv` a stage computes exactly what it did before slices existed.

The text is generated (no download, no data file): sentences about pipelines from a small grammar,
deterministic, about 60 KB; GPT_TEXT=path trains on any UTF-8 text file instead. Each step samples
GPT_BATCH windows of GPT_CONTEXT + 1 characters (seeded by the step, so every process draws the same
batch). Environment knobs: GPT_LAYERS (4), GPT_WIDTH (64), GPT_HEADS (4), GPT_CONTEXT (32), GPT_BATCH
(32 sequences per step), GPT_LR (Adam, 3e-3), GPT_DTYPE (float64; float32 for speed), GPT_TEXT.
"""

import math
import os
import random

import torch
from torch import nn
from torch.nn import functional as F

LAYERS = int(os.environ.get("GPT_LAYERS", "4"))
WIDTH = int(os.environ.get("GPT_WIDTH", "64"))
HEADS = int(os.environ.get("GPT_HEADS", "4"))
CONTEXT = int(os.environ.get("GPT_CONTEXT", "32"))
BATCH = int(os.environ.get("GPT_BATCH", "32"))
LR = float(os.environ.get("GPT_LR", "3e-3"))
dtype = getattr(torch, os.environ.get("GPT_DTYPE", "float64"))


# ---- the text ---------------------------------------------------------------------------------------


def generated_text(sentences: int = 1200, seed: int = 0) -> str:
    """Sentences from a small grammar: enough structure (words, agreement, punctuation) to learn from."""
    rng = random.Random(seed)
    subjects = ["the pipeline", "a stage", "the first rank", "the last stage", "every worker", "the scheduler"]
    plural = ["the ranks", "two stages", "the micro-batches", "all workers", "the gradients"]
    verbs = ["sends", "receives", "computes", "holds", "waits for", "frees", "passes on"]
    plural_verbs = ["send", "receive", "compute", "hold", "wait for", "free", "pass on"]
    objects = ["an activation", "the gradient", "the weights", "a small message", "the loss", "the next batch"]
    adverbs = ["", "", " early", " later", " at once", " without a copy", " over the wire"]
    tails = [".", ".", ".", ", then it sleeps.", " and the bubble shrinks.", ", so nobody waits."]
    out = []
    for _ in range(sentences):
        if rng.random() < 0.6:
            s, v = rng.choice(subjects), rng.choice(verbs)
        else:
            s, v = rng.choice(plural), rng.choice(plural_verbs)
        out.append(f"{s} {v} {rng.choice(objects)}{rng.choice(adverbs)}{rng.choice(tails)}")
    return " ".join(x[0].upper() + x[1:] for x in out) + "\n"


def _load_text() -> str:
    path = os.environ.get("GPT_TEXT")
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read()
    return generated_text()


TEXT = _load_text()
VOCAB = sorted(set(TEXT))
DATA = torch.tensor([VOCAB.index(c) for c in TEXT], dtype=torch.long)
if len(DATA) <= CONTEXT + 1:
    raise ValueError(f"the text has {len(DATA)} characters; GPT_CONTEXT={CONTEXT} needs more")


# ---- the model --------------------------------------------------------------------------------------


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(len(VOCAB), WIDTH)
        self.pos = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)

    def forward(self, idx: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """`offset`: the position of idx's first token (a token slice after `offset` earlier tokens)."""
        return self.tok(idx) + self.pos[offset : offset + idx.shape[1]]


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        if WIDTH % HEADS:
            raise ValueError(f"GPT_WIDTH={WIDTH} is not a multiple of GPT_HEADS={HEADS}")
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, past: tuple[torch.Tensor, ...] | None = None):
        """Causal attention over x's tokens; with `past` (the earlier tokens' keys and values, or `()` for
        none), over those too, and returns (output, (k, v)) with x's own keys and values."""
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, HEADS, d // HEADS).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        if past is None:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // HEADS)
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
            return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        keys, values = (torch.cat([past[0], k], dim=-2), torch.cat([past[1], v], dim=-2)) if past else (k, v)
        c = keys.shape[-2] - t  # earlier tokens: query a (position c + a) sees keys 0 .. c + a
        att = (q @ keys.transpose(-2, -1)) / math.sqrt(d // HEADS)
        future = torch.ones(t, c + t, dtype=torch.bool, device=x.device).triu(c + 1)
        att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.proj((att @ values).transpose(1, 2).reshape(b, t, d)), (k, v)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = SelfAttention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, past: tuple[torch.Tensor, ...] | None = None):
        """The block; with `past` (see SelfAttention), returns (output, (k, v)) too."""
        if past is None:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        a, kv = self.attn(self.ln1(x), past)
        x = x + a
        return x + self.mlp(self.ln2(x)), kv


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, len(VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def blocks_of(stage: int, num_stages: int) -> range:
    """The blocks stage `stage` holds: an even split of max(LAYERS, num_stages) blocks."""
    layers = max(LAYERS, num_stages)
    return range(stage * layers // num_stages, (stage + 1) * layers // num_stages)


class Stage(nn.Sequential):
    """A stage's layers in order (an nn.Sequential: the same parameter names as always), with the
    key/value cache interface of pipec.runtime.exec.slices."""

    def forward(self, x: torch.Tensor, past_kv: tuple[torch.Tensor, ...] | None = None):
        """Unsliced: the layers in turn. With `past_kv` (a token slice; `()` for the first one): per block,
        its earlier slices' keys and values (two tensors, tokens on dim -2); returns (output, kv), kv this
        slice's keys and values, two per block in block order."""
        if past_kv is None:
            return super().forward(x)
        blocks = [part for part in self if isinstance(part, Block)]
        if past_kv and len(past_kv) != 2 * len(blocks):
            raise ValueError(f"past_kv holds {len(past_kv)} tensors; this stage's {len(blocks)} blocks take two each")
        kv: list[torch.Tensor] = []
        for part in self:
            if isinstance(part, Embed):
                x = part(x, offset=past_kv[0].shape[-2] if past_kv else 0)
            elif isinstance(part, Block):
                k = len(kv)
                x, own = part(x, tuple(past_kv[k : k + 2]))
                kv += own
            else:
                x = part(x)
        return x, tuple(kv)


def build_stage(stage: int, num_stages: int) -> nn.Module:
    parts: list[nn.Module] = [Embed()] if stage == 0 else []
    parts += [Block() for _ in blocks_of(stage, num_stages)]
    if stage == num_stages - 1:
        parts.append(Head())
    return Stage(*parts)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT_BATCH windows of the text: characters as inputs, the next characters as targets."""
    g = torch.Generator().manual_seed(20_000 + step)
    start = torch.randint(0, len(DATA) - CONTEXT - 1, (BATCH,), generator=g)
    windows = torch.stack([DATA[s : s + CONTEXT + 1] for s in start.tolist()])
    return windows[:, :-1], windows[:, 1:]


def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)
