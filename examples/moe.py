"""A small mixture-of-experts transformer as a pipec model file: its MLPs are routed experts.

Train it with its experts sharded over expert groups of 2 ranks (expert parallelism, folded into the
data-parallel replicas: docs/runtime.md, "Mixture of experts"), checked against a single-process run:

    pipec run 1f1b -D p=2 -D m=4 --model examples/moe.py --nproc 4 --dp 2 --ep 2 --experts 4 --check
    pipec run dualpipe-v -D p=2 -D m=4 --model examples/moe.py --nproc 4 --dp 2 --ep 2 --experts 4 --check

The model: a token embedding, then MOE_BLOCKS pre-norm blocks per stage (causal self-attention, then an MLP,
each in a residual branch), a final LayerNorm and a linear head. The MLP of a block is a routed MoE layer
(`MoE`: a linear router, the top MOE_TOPK of MOE_EXPERTS experts per token with their softmax weights
renormalised, dropless) in MOE_LAYERS blocks of the whole model, spread over the stages as evenly as
possible (stage s gets MOE_LAYERS // S, one more for the first MOE_LAYERS % S stages; an odd count leaves
stages with different counts, whose overlapped pairs then issue different numbers of all-to-alls); the
other blocks have a dense MLP.

What the runtime needs of an MoE layer (docs/runtime.md): its experts are one module (`GroupedExperts`)
with an integer `num_experts`, every parameter of which has the experts along dim 0, called as
`experts(tokens, counts)` with the tokens grouped by expert in expert order and `counts` the tokens of each
(a list of ints, as long as the experts the module holds). With `--ep N` the runtime keeps 1/N of the
experts on each rank of a group and sends the tokens to their experts and back (all-to-all); this file
does not change.

Routing is deterministic (top-k of float64 logits; ties sorted stably), so the gradients compare with the
single-process reference at 1e-10. The load-balancing loss (Switch Transformer's E * sum_e f_e P_e per MoE
layer, f_e the share of assignments to expert e and P_e its mean router probability) is carried from stage
to stage as a second output (a 1-element tensor) and added to the cross-entropy by `loss_fn` with weight
MOE_AUX: it is then scaled with the micro-batch loss like everything else, on every schedule.

Environment knobs: MOE_LAYERS (default: one per stage), MOE_BLOCKS (2 blocks per stage), MOE_EXPERTS (4),
MOE_TOPK (2), MOE_WIDTH (16), MOE_HIDDEN (32, each expert's), MOE_HEADS (2), MOE_CONTEXT (8 tokens),
MOE_BATCH (16 sequences per step), MOE_VOCAB (64), MOE_AUX (0.01), MOE_LR (SGD, 0.05), MOE_DTYPE (float64).
"""

import math
import os

import torch
from torch import nn
from torch.nn import functional as F

BLOCKS = int(os.environ.get("MOE_BLOCKS", "2"))
EXPERTS = int(os.environ.get("MOE_EXPERTS", "4"))
TOPK = int(os.environ.get("MOE_TOPK", "2"))
WIDTH = int(os.environ.get("MOE_WIDTH", "16"))
HIDDEN = int(os.environ.get("MOE_HIDDEN", "32"))
HEADS = int(os.environ.get("MOE_HEADS", "2"))
CONTEXT = int(os.environ.get("MOE_CONTEXT", "8"))
BATCH = int(os.environ.get("MOE_BATCH", "16"))
VOCAB = int(os.environ.get("MOE_VOCAB", "64"))
AUX = float(os.environ.get("MOE_AUX", "0.01"))
LR = float(os.environ.get("MOE_LR", "0.05"))
dtype = getattr(torch, os.environ.get("MOE_DTYPE", "float64"))


def moe_layers(stage: int, num_stages: int) -> int:
    """MoE layers of one stage: MOE_LAYERS (default one per stage) spread as evenly as possible."""
    total = int(os.environ.get("MOE_LAYERS", str(num_stages)))
    return min(BLOCKS, total // num_stages + (1 if stage < total % num_stages else 0))


class GroupedExperts(nn.Module):
    """`num_experts` SiLU MLPs, their weights stacked along dim 0; `forward(tokens, counts)` runs expert e on
    the counts[e] tokens of its group (tokens grouped in expert order)."""

    def __init__(self, num_experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, width, hidden) / math.sqrt(width))
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, width) / math.sqrt(hidden))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out = []
        for e, x in enumerate(torch.split(tokens, list(counts))):
            out.append(F.silu(x @ self.w1[e]) @ self.w2[e])
        return torch.cat(out) if out else tokens[:0]


class MoE(nn.Module):
    """Top-k routing over grouped experts; returns the output and this layer's load-balancing loss."""

    def __init__(self, width: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(width, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, width, hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        E = self.experts.num_experts
        probs = F.softmax(self.router(x), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=E)
        token = order // self.top_k
        out_sorted = self.experts(x[token], counts.tolist())
        out = torch.zeros_like(x).index_add(0, token, out_sorted * weights.reshape(-1)[order].unsqueeze(-1))
        share = counts.to(x.dtype) / flat.numel()
        aux = E * (share * probs.mean(dim=0)).sum()
        return out.reshape(shape), aux


class Block(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.moe = MoE(WIDTH, HIDDEN, EXPERTS, TOPK) if moe else None
        self.mlp = None if moe else nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, WIDTH))

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = x.shape[1]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        h = self.ln2(x)
        if self.moe is None:
            return x + self.mlp(h), aux
        y, layer_aux = self.moe(h)
        return x + y, aux + layer_aux


class Stage(nn.Module):
    def __init__(self, stage: int, num_stages: int) -> None:
        super().__init__()
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.embed = nn.Embedding(VOCAB, WIDTH) if self.first else None
        k = moe_layers(stage, num_stages)
        self.blocks = nn.ModuleList(Block(moe=i < k) for i in range(BLOCKS))
        self.ln = nn.LayerNorm(WIDTH) if self.last else None
        self.head = nn.Linear(WIDTH, VOCAB) if self.last else None

    def forward(self, x: torch.Tensor, aux: torch.Tensor | None = None):
        if self.first:
            x = self.embed(x)
            aux = torch.zeros(1, dtype=x.dtype, device=x.device)
        for block in self.blocks:
            x, aux = block(x, aux)
        if self.last:
            x = self.head(self.ln(x))
        return x, aux


def build_stage(stage: int, num_stages: int) -> nn.Module:
    return Stage(stage, num_stages)


def loss_fn(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    logits, aux = output
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1)) + AUX * aux.sum()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH sequences of CONTEXT + 1 tokens, drawn with the step as seed; predict each next token."""
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)
