"""A tiny model file whose stages record the CPUs every thread of their process may run on, for the CPU
binding tests: build_stage writes `{"rank": LOCAL_RANK, "threads": [sorted CPUs per thread]}` to
$PIPEC_AFFINITY_DIR/rank<LOCAL_RANK>.json (build_stage runs after the process group, so gloo's threads
exist by then)."""

import json
import os

import torch
from torch import nn

dtype = torch.float64


def build_stage(stage: int, num_stages: int) -> nn.Module:
    rank = int(os.environ["LOCAL_RANK"])
    threads = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")]
    with open(os.path.join(os.environ["PIPEC_AFFINITY_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "threads": threads}, f)
    return nn.Linear(4, 4)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g, dtype=dtype), torch.randn(8, 4, generator=g, dtype=dtype)
