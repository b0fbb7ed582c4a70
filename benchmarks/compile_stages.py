"""Compiled stages against eager on the CPU (issue 43, part 3): the same pipeline, step for step, with each
stage's forward through torch.compile (`pipec run --compile`, pipec.runtime.exec.compiled) and without.

    .venv/bin/python benchmarks/compile_stages.py [--rounds 5] [--steps 3] [--schedules 1f1b,zb-h1]
    .venv/bin/python benchmarks/compile_stages.py --smoke     # 1 round of 1 step, zb-h1, a tiny GPT, aot_eager

The model is examples/gpt.py (GPT_* variables, default its own sizes, float64), p=2, m=4, every rank in this
process (`LocalPipeline`, one thread: the figure is the stages' compute, not the overlap between ranks). Each
schedule builds two pipelines from the same weights; the compiled one compiles at its first step (its wall
time is `compile_s`), after which their gradients are compared (the largest relative difference over every
parameter, `grad_max_rel_diff`; float64), then a warm-up step each and `--rounds` rounds in ABBA order
(`sidebyside.alternate`) of `--steps` steps each, a round's figure its mean per step. One JSON line per
schedule: medians and every round of the step's wall and CPU time, `ratio` = compiled / eager with its
spread, the load average at start and end (the machine is shared: compare within a line, never across
lines). zb-h1 has split backward: the compiled stage's B runs its one compiled backward, W accumulates the
weight gradients it kept (split_backward's `whole`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from sidebyside import Timing, alternate, emit, load_average, smoke_flag, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"GPT_LAYERS": "2", "GPT_WIDTH": "16", "GPT_HEADS": "2", "GPT_CONTEXT": "8", "GPT_BATCH": "8"}


def pipeline(name: str, model, compiled: bool):
    from pipec.api import load
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime import LocalPipeline, StageOptions

    prog = compile_schedule(load(name, p=2, m=4)).program
    options = StageOptions(optimizer=model.optimizer, dtype=model.dtype, compile=compiled)
    return LocalPipeline(prog, model.build_stage, model.loss_fn, options=options)


def run_steps(pipe, model, steps: int, first: int) -> Timing:
    t0, c0 = time.perf_counter(), time.process_time()
    for k in range(steps):
        x, y = model.batch(first + k)
        pipe.step(x, y)
    return Timing((time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps)


def grad_diff(a, b) -> tuple[float, int]:
    """The largest relative difference (max |a - b| / max |b| per tensor) over the tensors whose gradient is at
    least 1e-8 of the largest, and how many were left out: a gradient that is zero but for rounding (a key
    projection's bias under softmax, which shifts every score of a row alike) has no relative error to speak of."""
    ga, gb = a.named_gradients(), b.named_gradients()
    scales = {k: float(x.abs().max()) for k, x in gb.items() if x is not None}
    top = max(scales.values(), default=0.0)
    worst, noise = 0.0, 0
    for key, x in gb.items():
        y = ga.get(key)
        if x is None or y is None:
            continue
        if scales[key] < 1e-8 * top:
            noise += 1
            continue
        worst = max(worst, float((y - x).abs().max()) / scales[key])
    return worst, noise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="ABBA rounds (default 5)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round (default 3)")
    ap.add_argument("--schedules", default="1f1b,zb-h1", help="comma-separated library names (p=2 m=4)")
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.schedules = 1, 1, "zb-h1"
        os.environ.update(TINY)
    import torch

    from pipec.runtime.exec import compiled

    if args.smoke:  # the format only: dynamo and AOTAutograd without inductor's code generation
        compiled.BACKEND = "aot_eager"

    torch.set_num_threads(1)
    from pipec.runtime import load_model

    model = load_model(os.path.join(ROOT, "examples", "gpt.py"))
    for name in [s for s in args.schedules.split(",") if s]:
        load_start = load_average()
        eager, fast = pipeline(name, model, False), pipeline(name, model, True)
        x, y = model.batch(0)
        eager.step(x, y)
        t0 = time.perf_counter()
        fast.step(x, y)  # compiled after its shape exchange: this step pays for the compilation
        compile_s = time.perf_counter() - t0
        diff, noise = grad_diff(fast, eager)  # same weights, same batch
        turn = lambda pipe: lambda: run_steps(pipe, model, args.steps, 1)  # noqa: E731

        seconds = alternate({"compiled": turn(fast), "eager": turn(eager)}, rounds=args.rounds, warmup=1)
        rec = summarize(
            "compile_stages",
            seconds,
            ("compiled", "eager"),
            load_start,
            schedule=name,
            p=2,
            m=4,
            model="examples/gpt.py " + " ".join(f"{k}={os.environ[k]}" for k in sorted(TINY) if k in os.environ),
            dtype=str(model.dtype).removeprefix("torch."),
            backend=compiled.BACKEND,
            split_backward=fast.program.split_backward,
            steps_per_round=args.steps,
            compile_s=round(compile_s, 3),
            grad_max_rel_diff=diff,
            grad_tensors_rounding_only=noise,
            torch=torch.__version__,
        )
        emit(rec)
        if diff > (1e-9 if model.dtype == torch.float64 else 1e-4):
            sys.exit(f"error: compiled and eager gradients differ on {name}: {diff:.3g}")


if __name__ == "__main__":
    main()
