"""Token-level pipelining (TeraPipe) against micro-batch pipelining, and TeraPipe's slicing against uniform
slicing, at p = 4 with one or two sequences per step: simulated steps and their ratios.

    python benchmarks/terapipe.py [--cost benchmarks/profiles/gpt-L2048-p4.toml] [--sequences 1,2] [--measured]

Three cost models, each a JSON line per number of sequences m:

- `profiled`: the cost file measured once on this repository's examples/gpt.py at a long context
  (GPT_CONTEXT=2048, one sequence per micro-batch, float32, 4 stages of one block each):
  `pipec profile gpipe -D p=4 -D m=1 --model examples/gpt.py --slices 8 --reps 5 -o FILE`, which gives
  each stage's F and B for the whole sequence and `attn`, `op_fixed` fitted to the slices (its
  `[measured.slices]` table has the residual).
- `gpt3-analytic`: GPT-3 175B's layer (hidden d = 12288) at L = 2048: F = 1, B = 2 per stage and sequence,
  attn = L / (12 d + L) = 0.0137 (causal attention's 2 L^2 d of a layer's 24 L d^2 + 2 L^2 d forward
  FLOPs), and an assumed op_fixed of 1% of F per op (what slices too short to fill a GPU lose).
- `long-context-analytic`: d = 1024 at L = 8192 (attn = 0.4), the same op_fixed.

For each: micro-batch pipelining (`gpipe -D p=4 -D m=M`, the sequences unsliced), and `pipec slice terapipe
-D p=4 -D m=M -D L=L` (pipec.slicing.slice_schedule): TeraPipe's dynamic program, uniform slices of as many,
the best uniform count, each simulated on the schedule file written for it. Every line has the load
average (the simulator's figures do not depend on it; `--measured`'s do). A markdown table of the step-time
ratios ends the output.

`--measured` also runs the profiled case on 4 gloo processes (`pipec run FILE --model examples/gpt.py
--nproc 4 --steps S --json`, GPT_CONTEXT = the profile's L): the DP's sliced schedule and the unsliced
micro-batch one, `--rounds` times in turn, medians of steps 2.., beside the simulated steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from sidebyside import load_average

from pipec.api import simulate
from pipec.frontend.library import read
from pipec.sim.costs import cost_spec
from pipec.slicing import slice_schedule

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "benchmarks" / "profiles" / "gpt-L2048-p4.toml"
FIXED = 0.01  # the analytic cases' op_fixed: 1% of a stage's F of the whole sequence, per op


def analytic(d: int, L: int) -> dict:
    return {"F": 1.0, "B": 2.0, "attn": round(L / (12 * d + L), 6), "op_fixed": FIXED, "_from": f"d={d} L={L}"}


def cases(cost_file: Path) -> list[tuple[str, int, list[dict], dict]]:
    """(name, L, cost documents, what they are) of each cost model."""
    with open(cost_file, "rb") as f:
        raw = tomllib.load(f)
    L = int(raw["measured"]["slices"]["seqlen"])
    prof = {
        "file": str(cost_file.relative_to(ROOT)) if cost_file.is_relative_to(ROOT) else str(cost_file),
        "attn": raw["attn"],
        "op_fixed": raw["op_fixed"],
        "fit_residual": raw["measured"]["slices"]["fit_residual"],
        "loadavg_when_profiled": raw["measured"]["run"].get("loadavg_1min"),
    }
    out = [("profiled", L, [cost_spec(str(cost_file))], prof)]
    for name, d, seq in (("gpt3-analytic", 12288, 2048), ("long-context-analytic", 1024, 8192)):
        doc = analytic(d, seq)
        out.append((name, seq, [doc], {k: doc[k] for k in ("attn", "op_fixed")} | {"d": d}))
    return out


def run_steps(schedule: str, defines: list[str], L: int, m: int, steps: int) -> float:
    """The median step (steps 2..) of `pipec run` on 4 gloo processes, examples/gpt.py at context L with m
    sequences a step (one per micro-batch, as profiled)."""
    env = dict(os.environ, GPT_CONTEXT=str(L), GPT_BATCH=str(m), GPT_DTYPE="float32")
    cmd = [sys.executable, "-m", "pipec", "run", schedule, *defines, "--model", str(ROOT / "examples" / "gpt.py")]
    cmd += ["--nproc", "4", "--steps", str(steps), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    return statistics.median(s["seconds"] for s in doc["steps"][1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cost", type=Path, default=PROFILE, help="the profiled cost file (with [measured.slices])")
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--sequences", default="1,2", help="sequences per step to compare (default 1,2)")
    ap.add_argument("--measured", action="store_true", help="also run the profiled case on 4 gloo processes")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    table = []
    for name, L, docs, about in cases(args.cost):
        for m in (int(x) for x in args.sequences.split(",")):
            params = {"p": args.p, "m": m, "L": L}
            micro = simulate("gpipe", {"p": args.p, "m": m}, cost=docs).stats.makespan
            res = slice_schedule(read("terapipe"), params, docs)
            rows = {r["slicing"].split(" (")[0]: r for r in res.rows}
            dp = rows["TeraPipe DP"]
            line = {
                "bench": "terapipe",
                "costs": name,
                **about,
                "p": args.p,
                "sequences": m,
                "L": L,
                "granularity": res.granularity,
                "dp_tokens": dp["tokens"],
                "dp_seconds": round(res.choice.seconds, 3),
                "step_microbatch": micro,
                "step_dp": dp["step"],
                "step_uniform_same": rows["uniform, same count"]["step"],
                "uniform_best_slices": rows["uniform, best count"]["slices"],
                "step_uniform_best": rows["uniform, best count"]["step"],
                "microbatch_over_dp": micro / dp["step"],
                "uniform_same_over_dp": rows["uniform, same count"]["step"] / dp["step"],
                "uniform_best_over_dp": rows["uniform, best count"]["step"] / dp["step"],
                "loadavg": load_average(),
            }
            if args.measured and name == "profiled":
                line.update(measured(res.text, args, m, L))
            print(json.dumps(line), flush=True)
            table.append(line)
    print()
    print(
        "| costs | m | L | micro-batch (gpipe) | uniform, same n | uniform, best n | TeraPipe DP (n) "
        "| micro-batch / DP | uniform same / DP | uniform best / DP |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        n = len(t["dp_tokens"])
        print(
            f"| {t['costs']} | {t['sequences']} | {t['L']} | {t['step_microbatch']:.4g} | "
            f"{t['step_uniform_same']:.4g} | {t['step_uniform_best']:.4g} ({t['uniform_best_slices']}) | "
            f"{t['step_dp']:.4g} ({n}) | {t['microbatch_over_dp']:.2f}x | {t['uniform_same_over_dp']:.3f}x | "
            f"{t['uniform_best_over_dp']:.3f}x |"
        )


def measured(text: str, args: argparse.Namespace, m: int, L: int) -> dict:
    """The DP's sliced schedule and micro-batch gpipe run in turn on 4 gloo processes: median steps."""
    with tempfile.TemporaryDirectory(prefix="terapipe-") as tmp:
        sliced = os.path.join(tmp, "sliced.pipe")
        Path(sliced).write_text(text)
        runs: dict[str, list[float]] = {"sliced": [], "microbatch": []}
        before = load_average()
        for _ in range(args.rounds):
            runs["sliced"].append(run_steps(sliced, [], L, m, args.steps))
            runs["microbatch"].append(run_steps("gpipe", ["-D", f"p={args.p}", "-D", f"m={m}"], L, m, args.steps))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "measured_sliced_s": runs["sliced"],
        "measured_microbatch_s": runs["microbatch"],
        "measured_microbatch_over_sliced": med["microbatch"] / med["sliced"],
        "loadavg_before_runs": before,
        "loadavg_after_runs": load_average(),
    }


if __name__ == "__main__":
    main()
