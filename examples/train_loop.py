"""A training loop of your own over a pipec schedule: a GPT-2 from `transformers.GPT2Config` (random init;
the examples' GPT of examples/gpt.py is not used), split by module names, the user's AdamW, a warm-up and
cosine LR schedule and global-norm clipping, byte-level tokens of examples/data/stdlib_docstrings.txt.

    python -m torch.distributed.run --nproc-per-node 4 examples/train_loop.py      # or: torchrun ...

TRAIN_SCHEDULE (interleaved-1f1b), TRAIN_M (micro-batches, 8), TRAIN_STEPS (50), TRAIN_DTYPE (float32;
float64 for the gradient check of tests/runtime/test_schedule_api.py), TRAIN_LAYERS (8), TRAIN_WIDTH (64),
TRAIN_CONTEXT (64 bytes), TRAIN_BATCH (16 sequences). Dropout is off, so a pipelined step equals
the whole model's step exactly. The loop itself is `train` below: about 40 lines.
"""

import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import GPT2Config, GPT2LMHeadModel

import pipec
from pipec.runtime import PipelineSchedule, clip_grad_norm_, propose_split, split_model, stage_indices

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "stdlib_docstrings.txt")


def knob(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


SCHEDULE, M, STEPS = os.environ.get("TRAIN_SCHEDULE", "interleaved-1f1b"), knob("TRAIN_M", 8), knob("TRAIN_STEPS", 50)
LAYERS, WIDTH, CONTEXT, BATCH = (
    knob("TRAIN_LAYERS", 8),
    knob("TRAIN_WIDTH", 64),
    knob("TRAIN_CONTEXT", 64),
    knob("TRAIN_BATCH", 16),
)
DTYPE = getattr(torch, os.environ.get("TRAIN_DTYPE", "float32"))


def build_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # the same weights on every rank (the tied embedding and head start equal)
    cfg = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=WIDTH, n_layer=LAYERS, n_head=4, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg).to(DTYPE)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.frombuffer(bytearray(open(CORPUS, "rb").read()), dtype=torch.uint8).long()
    start = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=torch.Generator().manual_seed(step))
    windows = torch.stack([data[s : s + CONTEXT + 1] for s in start.tolist()])
    return windows[:, :-1], windows[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def lr_at(step: int, steps: int, warmup: int = 5) -> float:  # a multiplier of the base LR
    return (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / steps))


def train(steps: int = STEPS, schedule_name: str = SCHEDULE, m: int = M, log=print):
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    params = {"p": world, "m": m, **({"v": 2} if schedule_name == "interleaved-1f1b" else {})}
    program = pipec.compile(schedule_name, **params)  # the stage count and placement come from the schedule
    model = build_model()
    fqns = propose_split(model, program.num_stages)  # embeddings first, blocks balanced, ln_f + lm_head last
    stages = split_model(model, fqns, only=stage_indices(program, rank))  # this rank's chunks
    schedule = PipelineSchedule(program, stages, loss_fn, mesh=mesh)
    opt = torch.optim.AdamW(schedule.parameters(), lr=3e-3, weight_decay=0.01)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps))
    history = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        losses = []
        schedule.step(x, target=y, losses=losses)  # used on the first stage's rank / the last's, ignored elsewhere
        norm = clip_grad_norm_(schedule.parameters(), max_norm=1.0, mesh=mesh)
        opt.step()
        lr.step()
        if losses:
            history.append(float(torch.stack(losses).mean()))
            log(f"step {step:3d}  loss {history[-1]:.4f}  grad norm {float(norm):.3f}  lr {lr.get_last_lr()[0]:.2e}")
    return schedule, history


if __name__ == "__main__":
    dist.init_process_group("gloo")
    train()
    dist.destroy_process_group()
