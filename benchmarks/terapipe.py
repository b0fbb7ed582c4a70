"""Token-level pipelining (TeraPipe) against micro-batch pipelining, and TeraPipe's slicing against uniform
slicing, with one or two sequences per step: simulated steps and their ratios, and with `--measured` the
profiled case run on p gloo processes beside them.

    python benchmarks/terapipe.py [--p 2|4] [--cost FILE] [--sequences 1,2] [--measured --rounds 5]
    python benchmarks/terapipe.py --smoke   # profiled costs, one sequence, simulated, tables on stderr

Three cost models, each a JSON line per number of sequences m:

- `profiled`: a cost file measured on this repository's examples/gpt.py (GPT_LAYERS = 4 blocks of width 64,
  one sequence per micro-batch, float32, the blocks split evenly over the p stages) at a long context, by
  `GPT_CONTEXT=L GPT_BATCH=1 GPT_DTYPE=float32 pipec profile gpipe -D p=P -D m=1 --model examples/gpt.py
  --threads 1 --reps 5 --warmup 2 --slices 8 -o FILE`, which gives each stage's F and B for the whole
  sequence and `attn`, `op_fixed` fitted to the slices (its `[measured.slices]` table has the residual).
  By default the one for `--p`: benchmarks/profiles/gpt-L2048-p4.toml (L = 2048, one block a stage) at
  p = 4, gpt-L1024-p2.toml (L = 1024, two blocks a stage) at p = 2.
- `gpt3-analytic`: GPT-3 175B's layer (hidden d = 12288) at L = 2048: F = 1, B = 2 per stage and sequence,
  attn = L / (12 d + L) = 0.0137 (causal attention's 2 L^2 d of a layer's 24 L d^2 + 2 L^2 d forward
  FLOPs), and an assumed op_fixed of 1% of F per op (what slices too short to fill a GPU lose).
- `long-context-analytic`: d = 1024 at L = 8192 (attn = 0.4), the same op_fixed.

For each: micro-batch pipelining (`gpipe -D p=P -D m=M`, the sequences unsliced), and `pipec slice terapipe
-D p=P -D m=M -D L=L` (pipec.slicing.slice_schedule): TeraPipe's dynamic program, uniform slices of as many,
the best uniform count, each simulated on the schedule file written for it. Every line has the load
average (the simulator's figures do not depend on it; `--measured`'s do). A markdown table of the simulated
step-time ratios ends the output.

`--measured` also runs the profiled case on p gloo processes (`pipec run FILE --model examples/gpt.py --nproc
P --steps S --json`, GPT_CONTEXT = the profile's L, float32, one thread and one CPU per rank as `pipec run`
gives them: OMP_NUM_THREADS = CPUs / P, `--cpu-bind auto`): micro-batch gpipe, uniform slices at the DP's
count, and the DP's slices, in alternating rounds (`sidebyside.alternate`: A B C C B A ...) so that a change
of load falls on all three alike. A run's figure is the median of its steps 2.. (step 1 exchanges shapes); a
schedule's, the median over rounds. Before the rounds each schedule runs once with `--check` (float64, a short
run at the same L, so the exact same slices) against the single-process reference. A second table puts each
measured ratio beside the simulated one; p processes need p free CPUs to pipeline at all (on fewer, any
pipelining gains at most CPUs-fold), which the line's `cpus` says.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from sidebyside import alternate, emit, load_average, ratio_fields, smoke_flag

from pipec.api import simulate
from pipec.frontend.library import read
from pipec.sim.cost_files import cost_spec
from pipec.slicing import slice_schedule, uniform, write_schedule

ROOT = Path(__file__).resolve().parent.parent
TABLE_OUT = [sys.stdout]  # where the markdown tables go (--smoke: standard error, so stdout is JSON lines)


def _table(*parts: object) -> None:
    print(*parts, file=TABLE_OUT[0])


PROFILES = ROOT / "benchmarks" / "profiles"
MODEL = ROOT / "examples" / "gpt.py"
LAYERS = 4  # examples/gpt.py's default; every gpt-L*-p*.toml profile was measured with it
FIXED = 0.01  # the analytic cases' op_fixed: 1% of a stage's F of the whole sequence, per op
KINDS = ("microbatch", "uniform", "dp")  # the measured schedules, in the order each round runs them


def default_profile(p: int) -> Path:
    """The profiled cost file for p stages: benchmarks/profiles/gpt-L<L>-p<p>.toml (the longest L if many)."""
    found = sorted(PROFILES.glob(f"gpt-L*-p{p}.toml"), key=lambda f: int(re.search(r"-L(\d+)-", f.name)[1]))
    if not found:
        sys.exit(f"no profile benchmarks/profiles/gpt-L*-p{p}.toml: measure one (see this file's docstring)")
    return found[-1]


def analytic(d: int, L: int) -> dict:
    return {"F": 1.0, "B": 2.0, "attn": round(L / (12 * d + L), 6), "op_fixed": FIXED, "_from": f"d={d} L={L}"}


def cases(cost_file: Path, p: int) -> list[tuple[str, int, list[dict], dict]]:
    """(name, L, cost documents, what they are) of each cost model."""
    with open(cost_file, "rb") as f:
        raw = tomllib.load(f)
    if raw["stages"] != p:
        sys.exit(f"{cost_file} profiles {raw['stages']} stages, not --p {p}")
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


def gpt_env(L: int, m: int, dtype: str) -> dict[str, str]:
    """examples/gpt.py as profiled: m sequences of L tokens a step, one per micro-batch."""
    return dict(os.environ, GPT_CONTEXT=str(L), GPT_BATCH=str(m), GPT_DTYPE=dtype, GPT_LAYERS=str(LAYERS))


def pipec_run(schedule: list[str], p: int, env: dict[str, str], extra: list[str]) -> str:
    """`pipec run` of the schedule (a file, or a name with its -D's) on p gloo processes: its stdout."""
    cmd = [sys.executable, "-m", "pipec", "run", *schedule, "--model", str(MODEL), "--nproc", str(p), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout


def run_steps(schedule: list[str], p: int, L: int, m: int, steps: int) -> float:
    """The median step (steps 2..) of one `pipec run`, float32."""
    out = pipec_run(schedule, p, gpt_env(L, m, "float32"), ["--steps", str(steps), "--json"])
    doc = json.loads(out.strip().splitlines()[-1])
    return statistics.median(s["seconds"] for s in doc["steps"][1:])


def check_run(schedule: list[str], p: int, L: int, m: int) -> str:
    """One step with `--check` in float64: the run's OK line (its largest relative error)."""
    out = pipec_run(schedule, p, gpt_env(L, m, "float64"), ["--steps", "1", "--check"])
    return next((ln for ln in out.splitlines() if ln.startswith("OK")), out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=int, default=4, help="stages and, with --measured, gloo processes (default 4)")
    ap.add_argument("--cost", type=Path, help="the profiled cost file (default: the one for --p)")
    ap.add_argument("--sequences", default="1,2", help="sequences per step to compare (default 1,2)")
    ap.add_argument("--measured", action="store_true", help="also run the profiled case on p gloo processes")
    ap.add_argument("--steps", type=int, default=4, help="steps of each measured run (the first is left out)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds of the three schedules in turn")
    ap.add_argument("--no-check", action="store_true", help="--measured: skip the --check runs")
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # the profiled costs, one sequence, simulated only; the tables on standard error (tests)
        args.sequences, args.measured = "1", False
        TABLE_OUT[0] = sys.stderr
    cost = args.cost or default_profile(args.p)
    table = []
    for name, L, docs, about in cases(cost, args.p)[: 1 if args.smoke else None]:
        for m in (int(x) for x in args.sequences.split(",")):
            params = {"p": args.p, "m": m, "L": L}
            micro = simulate("gpipe", {"p": args.p, "m": m}, cost=docs).stats.makespan
            res = slice_schedule(read("terapipe"), params, docs)
            rows = {r["slicing"].split(" (")[0]: r for r in res.rows}
            dp = rows["TeraPipe DP"]
            line = {
                "benchmark": "terapipe",
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
            }
            if args.measured and name == "profiled":
                line.update(measured(res.text, args, m, L, len(dp["tokens"])))
            table.append(emit(line))
    _table()
    _table(
        f"| costs | m | L | micro-batch (gpipe) | uniform, same n | uniform, best n | TeraPipe DP (n) "
        f"| micro-batch / DP | uniform same / DP | uniform best / DP |   (simulated, p = {args.p})"
    )
    _table("|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        n = len(t["dp_tokens"])
        _table(
            f"| {t['costs']} | {t['sequences']} | {t['L']} | {t['step_microbatch']:.4g} | "
            f"{t['step_uniform_same']:.4g} | {t['step_uniform_best']:.4g} ({t['uniform_best_slices']}) | "
            f"{t['step_dp']:.4g} ({n}) | {t['microbatch_over_dp']:.2f}x | {t['uniform_same_over_dp']:.3f}x | "
            f"{t['uniform_best_over_dp']:.3f}x |"
        )
    if args.measured:
        measured_table([t for t in table if "measured" in t], args.p)


def measured_table(lines: list[dict], p: int) -> None:
    """Each schedule's simulated and measured step, and the ratios side by side."""
    _table()
    _table(
        f"| m | n (DP) | micro-batch sim / meas s | uniform sim / meas s | DP sim / meas s "
        f"| micro-batch / DP sim / meas | uniform / DP sim / meas | load (1 min) |   (p = {p} gloo processes)"
    )
    _table("|---|---|---|---|---|---|---|---|")
    for t in lines:
        sim = {"microbatch": t["step_microbatch"], "uniform": t["step_uniform_same"], "dp": t["step_dp"]}
        meas = t["measured"]
        loads = [x for k in KINDS for x in meas[k]["loadavg"]]
        _table(
            f"| {t['sequences']} | {len(t['dp_tokens'])} | "
            + " | ".join(f"{sim[k]:.3f} / {meas[k]['median_s']:.3f}" for k in KINDS)
            + f" | {sim['microbatch'] / sim['dp']:.2f}x / {meas['microbatch_over_dp']:.2f}x"
            f" | {sim['uniform'] / sim['dp']:.3f}x / {meas['uniform_over_dp']:.3f}x"
            f" | {min(loads):.2f}-{max(loads):.2f} |"
        )


def measured(text: str, args: argparse.Namespace, m: int, L: int, n: int) -> dict:
    """Micro-batch gpipe, uniform slices at the DP's count n and the DP's slices, each checked once, then
    run in alternating rounds on p gloo processes: each run's median step, its load, the medians."""
    p = args.p
    with tempfile.TemporaryDirectory(prefix="terapipe-") as tmp:
        files = {"dp": os.path.join(tmp, "dp.pipe"), "uniform": os.path.join(tmp, "uniform.pipe")}
        Path(files["dp"]).write_text(text)
        even = write_schedule(read("terapipe"), {"p": p, "m": m, "L": L}, uniform(L, n))
        Path(files["uniform"]).write_text(even)
        sched = {"microbatch": ["gpipe", "-D", f"p={p}", "-D", f"m={m}"], "uniform": [files["uniform"]]}
        sched["dp"] = [files["dp"]]
        checks = {} if args.no_check else {k: check_run(sched[k], p, L, m) for k in KINDS}
        runs: dict[str, dict[str, list[float]]] = {k: {"steps_s": [], "loadavg": []} for k in KINDS}

        def one(k: str):
            def run() -> float:
                runs[k]["loadavg"].append(load_average()[0])
                return run_steps(sched[k], p, L, m, args.steps)

            return run

        for k, steps in alternate({k: one(k) for k in KINDS}, args.rounds).items():
            runs[k]["steps_s"] = steps
    for k in KINDS:
        runs[k]["median_s"] = statistics.median(runs[k]["steps_s"])
    med = {k: runs[k]["median_s"] for k in KINDS}
    return {
        "measured": {
            **runs,
            "check": checks,
            "procs": p,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "microbatch_over_dp": med["microbatch"] / med["dp"],
            "uniform_over_dp": med["uniform"] / med["dp"],
            # each ratio's spread over the rounds (a round's three runs are side by side)
            "microbatch_over_dp_range": ratio_fields(runs["microbatch"]["steps_s"], runs["dp"]["steps_s"])[
                "ratio_range"
            ],
            "uniform_over_dp_range": ratio_fields(runs["uniform"]["steps_s"], runs["dp"]["steps_s"])["ratio_range"],
            "loadavg_after_runs": load_average(),
        }
    }


if __name__ == "__main__":
    main()
