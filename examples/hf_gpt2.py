"""Hugging Face GPT-2 as a pipec model file: `transformers.GPT2LMHeadModel`, from a config, random init, on
byte-level tokens of real prose (the CPython standard library's docstrings, examples/data/).

Check it against a single-process run (float64 by default, so the tolerance is 1e-10):

    pipec run 1f1b -D p=4 -D m=8 --model examples/hf_gpt2.py --nproc 4 --steps 2 --check

and train it (docs/transformer.md has the loss curve of this command):

    pipec run 1f1b -D p=4 -D m=8 --model examples/hf_gpt2.py --nproc 4 --steps 50

The model is transformers' own: `GPT2Config(...)` and `GPT2LMHeadModel(config)`, seeded with HF_SEED, so
every process (and the reference) builds the same weights; nothing is downloaded (`HF_HUB_OFFLINE=1` is
set before transformers is imported, and no tokenizer or checkpoint is asked for). Dropout is off (a
pipeline and its reference must compute the same function), and sdpa attention is transformers' default.

Split by module names, as torchtitan splits a model, with pipec's splitter (`pipec.runtime.model.split`):
`propose_split` puts `transformer.wte`, `transformer.wpe` (and the dropout) on the first stage with its
blocks, `transformer.ln_f` and `lm_head` on the last, and spreads the blocks `transformer.h.N` evenly;
`split_model` keeps each stage's modules under their names in the whole model (`transformer.h.3.attn...`)
and runs GPT2Model's forward over them: token plus position embeddings, each block under a causal mask,
the final norm and the head (`tests/runtime/test_hf_transformer.py` checks the stages in sequence against
`GPT2LMHeadModel` itself).

GPT-2 ties `lm_head.weight` to `transformer.wte.weight`; here `tie_word_embeddings=False`. A tied weight
lives on the first and on the last stage, so a pipeline must add up its two gradients across ranks, as
Megatron does. The splitter records the tie and pipec's schedule API (`PipelineSchedule`) sums it, but
`pipec run` builds each stage of a model file on its own, in its own process, and would train two copies
that drift apart; untied, each weight lives on one stage and `pipec run --check` holds.

Tokens are bytes (vocabulary 256). Each step samples HF_BATCH windows of HF_CONTEXT + 1 bytes of the
corpus, seeded by the step, so every process draws the same batch. Environment knobs: HF_LAYERS (8),
HF_WIDTH (64), HF_HEADS (4), HF_CONTEXT (64), HF_BATCH (16 sequences per step), HF_LR (AdamW, 1e-3),
HF_DTYPE (float64; float32 for speed), HF_SEED (0), HF_TEXT (another UTF-8 text file), HF_VOCAB (256; 50257
is GPT-2's vocabulary, for its real embedding and head sizes: `pipec plan`'s figures, docs/plan.md).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # config + random init only: never reach for the hub

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from pipec.runtime import propose_split, split_model  # noqa: E402

LAYERS = int(os.environ.get("HF_LAYERS", "8"))
WIDTH = int(os.environ.get("HF_WIDTH", "64"))
HEADS = int(os.environ.get("HF_HEADS", "4"))
CONTEXT = int(os.environ.get("HF_CONTEXT", "64"))
BATCH = int(os.environ.get("HF_BATCH", "16"))
LR = float(os.environ.get("HF_LR", "1e-3"))
SEED = int(os.environ.get("HF_SEED", "0"))
dtype = getattr(torch, os.environ.get("HF_DTYPE", "float64"))

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "stdlib_docstrings.txt")
# The vocabulary: bytes (256) unless HF_VOCAB asks for more, e.g. GPT-2's real 50257, whose embedding and head
# outweigh narrow blocks many times over (the tokens stay bytes; the rest of the rows are never indexed).
VOCAB = max(256, int(os.environ.get("HF_VOCAB", "256")))


# ---- the text ---------------------------------------------------------------------------------------


def _load_bytes() -> torch.Tensor:
    with open(os.environ.get("HF_TEXT") or CORPUS, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    if len(data) <= CONTEXT + 1:
        raise ValueError(f"the text has {len(data)} bytes; HF_CONTEXT={CONTEXT} needs more")
    return data


DATA = _load_bytes()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF_BATCH windows of the corpus: bytes as inputs, the next bytes as targets."""
    g = torch.Generator().manual_seed(20_000 + step)
    start = torch.randint(0, len(DATA) - CONTEXT - 1, (BATCH,), generator=g)
    windows = torch.stack([DATA[s : s + CONTEXT + 1] for s in start.tolist()])
    return windows[:, :-1], windows[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


# ---- the model --------------------------------------------------------------------------------------


def config() -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=WIDTH,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,  # see the docstring: a tie spans the first and the last stage
        bos_token_id=None,  # GPT-2's 50256 is outside a byte vocabulary
        eos_token_id=None,
    )


def whole_model() -> GPT2LMHeadModel:
    """The whole model, the same in every process: built under its own seed, the caller's RNG kept."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return GPT2LMHeadModel(config()).eval()  # eval: no dropout anywhere (they are 0.0 anyway)


def stage_fqns(num_stages: int) -> list[list[str]]:
    """The module names of each stage (torchtitan's `module_fqns_per_model_part` shape), as pipec's
    `propose_split` chooses them: the embeddings first, the final norm and head last, the blocks balanced."""
    if not 1 <= num_stages <= LAYERS:
        raise ValueError(f"{num_stages} stages need at least as many blocks: set HF_LAYERS >= {num_stages}")
    return propose_split(whole_model(), num_stages)


def build_stage(stage: int, num_stages: int) -> nn.Module:
    model = whole_model()
    return split_model(model, stage_fqns(num_stages), only=[stage])[stage]


def layers() -> list[tuple[str, nn.Module]]:
    """The model as a sequence of layers, for `pipec partition` to profile: the embeddings, each block,
    the final norm with the head; each maps the previous one's output to its input."""
    model = whole_model()
    names = [["transformer.wte", "transformer.wpe", "transformer.drop"]]
    names += [[f"transformer.h.{i}"] for i in range(model.config.n_layer)]
    names += [["transformer.ln_f", "lm_head"]]
    return [("+".join(n), s) for n, s in zip(names, split_model(model, names), strict=True)]
