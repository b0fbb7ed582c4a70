"""Split backward costs no recomputation: time of BWD (input gradient) + WGRAD (weight gradients)
against one full backward, per stage of the example MLP. One JSON line per stage.

    .venv/bin/python benchmarks/split_backward.py [--width 256] [--blocks 4] [--rows 32] [--reps 30]
                                                    [--threads 1] [--clock cpu]
    .venv/bin/python benchmarks/split_backward.py --smoke   # one round, width 32: the format (tests)

Target (issue 4): ratio (bwd + wgrad) / full <= 1.2. A middle stage is measured (its input needs a
gradient); the first stage's split is trivially 1.0 (its BWD does nothing, its WGRAD is the full backward).
Full and split backwards alternate round by round in ABBA order (`sidebyside`), and the medians are compared.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from sidebyside import alternate, emit, load_average, smoke_flag, summarize
from torch import nn

from pipec.runtime.exec.stage import Stage


def block_stack(width: int, blocks: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(width, width), nn.GELU())])


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def one_backward(st: Stage, x: torch.Tensor, g: torch.Tensor, parts: list[tuple[float, float]], clock) -> float:
    """Forward (untimed), then the timed backward: full, or input-only BWD then WGRAD."""
    st.forward(0, (x.clone(),))
    t0 = clock()
    st.backward(0, (g,))
    t1 = clock()
    if st.split_backward:
        st.wgrad(0)
    t2 = clock()
    st.zero_grad()
    parts.append((t1 - t0, t2 - t1))
    return t2 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30, help="ABBA rounds (full split, split full, ...)")
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as each rank runs)")
    ap.add_argument(
        "--clock",
        choices=CLOCKS,
        default="cpu",
        help="cpu: this thread's CPU time (default; with one thread it holds all the work, and other load "
        "on the machine barely moves it); wall: elapsed time",
    )
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # one round on a narrow stack: the format (tests)
        args.width, args.rows, args.reps = 32, 4, 1
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu counts the main thread only: use it with --threads 1")
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)  # on a shared machine, more threads mostly measure the contention
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    module = block_stack(args.width, args.blocks).to(dtype)
    x = torch.randn(args.rows, args.width, dtype=dtype)
    g = torch.randn(args.rows, args.width, dtype=dtype)
    # One module, two stages over it: each round runs a full backward and a split one, so both see
    # the same load (timing all of one kind first let a load spike decide the ratio).
    full, split = Stage(1, 3, module, None, 1.0, False, None), Stage(1, 3, module, None, 1.0, True, None)
    parts: dict[str, list[tuple[float, float]]] = {"full": [], "split": []}
    start = load_average()
    seconds = alternate(
        {
            "full": lambda: one_backward(full, x, g, parts["full"], clock),
            "split": lambda: one_backward(split, x, g, parts["split"], clock),
        },
        rounds=args.reps,
        warmup=3,
    )
    timed_split = parts["split"][-args.reps :]
    rec = summarize(
        "split_backward",
        seconds,
        ratio=("split", "full"),
        load_start=start,
        width=args.width,
        blocks=args.blocks,
        rows=args.rows,
        dtype=args.dtype,
        threads=args.threads,
        clock=args.clock,
        full_backward_s=statistics.median(seconds["full"]),
        bwd_s=statistics.median(b for b, _ in timed_split),
        wgrad_s=statistics.median(w for _, w in timed_split),
        target_ratio=1.2,
    )
    emit(rec)


if __name__ == "__main__":
    main()
