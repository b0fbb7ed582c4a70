"""Split backward costs no recomputation: time of BWD (input gradient) + WGRAD (weight gradients)
against one full backward, per stage of the example MLP. One JSON line per stage.

    .venv/bin/python benchmarks/split_backward.py [--width 256] [--blocks 4] [--rows 32] [--reps 30]

Target (issue 4): ratio (bwd + wgrad) / full <= 1.2. A middle stage is measured (its input needs a
gradient); the first stage's split is trivially 1.0 (its BWD does nothing, its WGRAD is the full backward).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from pipec.runtime.stage import Stage


def block_stack(width: int, blocks: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(width, width), nn.GELU())])


def measure(split: bool, module: nn.Module, x: torch.Tensor, g: torch.Tensor, reps: int) -> dict[str, float]:
    st = Stage(1, 3, module, None, 1.0, split, None)
    times: dict[str, list[float]] = {"bwd": [], "wgrad": []}
    for i in range(reps + 3):
        st.forward(0, (x.clone(),))
        t0 = time.perf_counter()
        st.backward(0, (g,))
        t1 = time.perf_counter()
        if split:
            st.wgrad(0)
        t2 = time.perf_counter()
        st.zero_grad()
        if i >= 3:
            times["bwd"].append(t1 - t0)
            times["wgrad"].append(t2 - t1)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dtype", default="float64")
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    module = block_stack(args.width, args.blocks).to(dtype)
    x = torch.randn(args.rows, args.width, dtype=dtype)
    g = torch.randn(args.rows, args.width, dtype=dtype)
    full = measure(False, module, x, g, args.reps)["bwd"]
    split = measure(True, module, x, g, args.reps)
    print(
        json.dumps(
            {
                "benchmark": "split_backward",
                "width": args.width,
                "blocks": args.blocks,
                "rows": args.rows,
                "dtype": args.dtype,
                "full_backward_s": full,
                "bwd_s": split["bwd"],
                "wgrad_s": split["wgrad"],
                "ratio": (split["bwd"] + split["wgrad"]) / full,
            }
        )
    )


if __name__ == "__main__":
    main()
