"""`pipec plan` against the baselines a user would pick by hand, simulated and measured.

    python benchmarks/plan_gain.py [--time-limit 20] [--cases gpt2,uneven] [--ps 4,8] [--limits a,recompute]
                                   [--global-batch N] [--measure] [--rounds 4] [--steps 4]

Simulated (every case): on the committed profiled layer tables (benchmarks/profiles/gpt2-small-layers.json:
examples/hf_gpt2.py with GPT-2's vocabulary of 50257, width 768, 12 blocks, float32, 16 sequences of 64
tokens; benchmarks/profiles/uneven-layers.json: examples/uneven.py, 256 samples), at p = 4 and p = 8, on ranks
of one speed and of two (the second half at speed 0.5), each at equal memory: the memory limit is the peak of
(a) Megatron-LM's default (interleaved 1F1B, uniform split, no recomputation) found by a first, short
`pipec plan` run, so neither the plan nor (b) may use more; and (`--limits a,recompute`) at the peak of (a)
with full recomputation on every rank, what Megatron-LM's default falls back to when its plain peak does not
fit (found by a run with the limit one byte below (a)'s plain peak), where the limit binds the others too.
Then `pipec plan --layers-cost TABLE -p P --global-batch G [--ranks speed=...] --memory-limit PEAK
--time-limit T --json`. One JSON line per case: the
plan's, (a)'s and (b)'s simulated steps, the gains, the bound and the seconds the search took.

Measured (`--measure`): at p = 2 on gloo, examples/uneven.py with m = 8 (the profile's): `pipec plan -o DIR`
writes the plan's and the baselines' partition files (and .pipe files where memory ops are chosen), then
`pipec run` runs each `--rounds` times in ABBA order (`sidebyside.alternate`), `--steps` steps, the median of
steps 2.. per run; one JSON line per baseline with the measured gain (median baseline / median plan) beside the
simulated one, and whether `pipec run --check` passed on the plan.

    python benchmarks/plan_gain.py --smoke    # one small case, a 3 s search: the format (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from sidebyside import alternate, emit, load_average, smoke_flag, summarize

PIPEC = [sys.executable, "-m", "pipec"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = {
    "gpt2": ("benchmarks/profiles/gpt2-small-layers.json", 16),
    "uneven": ("benchmarks/profiles/uneven-layers.json", 256),
}


def plan_json(args: list[str]) -> dict:
    proc = subprocess.run([*PIPEC, "plan", *args, "--json"], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"pipec plan {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def simulated(case: str, p: int, two_speeds: bool, time_limit: float, tight: bool = False, batch: int = 0) -> dict:
    table, batch = TABLES[case][0], batch or TABLES[case][1]
    base = ["--layers-cost", table, "-p", str(p), "--global-batch", str(batch)]
    if two_speeds:
        base += ["--ranks", "speed=" + ",".join(["1"] * (p // 2) + ["0.5"] * (p - p // 2))]
    first = plan_json([*base, "--time-limit", "3", "--schedules", "1f1b"])
    peak = first["megatron"]["peak"]
    if tight:  # just below (a)'s peak, (a) recomputes on every rank: its peak then is the limit
        below = plan_json([*base, "--memory-limit", f"{int(peak) - 1}B", "--time-limit", "3", "--schedules", "1f1b"])
        if below["megatron"] is None:  # its peak is its parameters': recomputation frees nothing that counts
            return {
                "case": case,
                "p": p,
                "speeds": "1 and 0.5" if two_speeds else "1",
                "limit": "recompute",
                "skipped": "(a) with full recomputation does not fit below (a)'s own peak",
            }
        peak = below["megatron"]["peak"]
    t0, load0, c0 = time.perf_counter(), load_average(), os.times()
    doc = plan_json([*base, "--memory-limit", f"{int(peak)}B", "--time-limit", str(time_limit)])
    wall, c1 = time.perf_counter() - t0, os.times()
    rec = {
        "benchmark": "plan_gain",
        "case": case,
        "p": p,
        "speeds": "1 and 0.5" if two_speeds else "1",
        "global_batch": batch,
        "memory_limit": int(peak),
        "limit": "(a) with full recomputation's peak" if tight else "(a)'s peak",
        "command": " ".join(
            ["pipec", "plan", *base, "--memory-limit", f"{int(peak)}B", "--time-limit", f"{time_limit:g}"]
        ),
        "plan": doc["plan"]["label"],
        "plan_layers": doc["plan"]["layers_per_stage"],
        "plan_step": doc["plan"]["step"],
        "plan_peak": doc["plan"]["peak"],
        "megatron": doc["megatron"] and doc["megatron"]["label"],
        "megatron_step": doc["megatron"] and doc["megatron"]["step"],
        "gain_vs_megatron": doc["megatron"] and doc["megatron"]["gain"],
        "library": doc["library"] and doc["library"]["label"],
        "library_step": doc["library"] and doc["library"]["step"],
        "gain_vs_library": doc["library"] and doc["library"]["gain"],
        "lower_bound": doc["lower_bound"],
        "gap": doc["gap"],
        "search_s": doc["seconds"],
        "load_avg_start": load0,
        "load_avg_end": load_average(),
        "record_wall_s": wall,
        "record_cpu_s": (c1.children_user + c1.children_system) - (c0.children_user + c0.children_system),
    }
    return rec


def run_steps(target: list[str], part: str, steps: int) -> float:
    cmd = [*PIPEC, "run", *target, "--model", "examples/uneven.py", "--partition", part, "--nproc", "2"]
    out = subprocess.run([*cmd, "--steps", str(steps), "--json"], capture_output=True, text=True, check=True, cwd=ROOT)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    return statistics.median(s["seconds"] for s in doc["steps"][1:])


def measured(rounds: int, steps: int, time_limit: float) -> None:
    out = tempfile.mkdtemp(prefix="plan-gain-")
    table, batch = TABLES["uneven"]
    args = ["--layers-cost", table, "--model", "examples/uneven.py", "-p", "2", "--global-batch", str(batch)]
    args += ["--microbatches", "8"]  # the profile's: what the table measured, so the runs are what was simulated
    peak = plan_json([*args, "--time-limit", "3", "--schedules", "1f1b"])["megatron"]["peak"]  # equal memory
    doc = plan_json([*args, "--memory-limit", f"{int(peak)}B", "--time-limit", str(time_limit), "-o", out])
    systems, sim = {}, {}
    for key in ("plan", "megatron", "library"):
        pt = doc[key]
        if pt is None:
            continue
        run = (doc["run"] if key == "plan" else pt["run"]).split()
        target = run[2 : run.index("--model")]
        part = run[run.index("--partition") + 1]
        systems[key] = lambda target=target, part=part: run_steps(target, part, steps)
        sim[key] = pt["step"]
    run = doc["run"].split()
    check = subprocess.run(
        [*PIPEC, *run[1 : run.index("--check")], "--check", "--steps", "1"], capture_output=True, text=True, cwd=ROOT
    )
    load0 = load_average()
    times = alternate(systems, rounds)
    for key in ("megatron", "library"):
        if key not in times:
            continue
        rec = summarize(
            "plan_gain_measured",
            times,
            (key, "plan"),
            load0,
            baseline=doc[key]["label"],
            plan=doc["plan"]["label"],
            plan_layers=doc["plan"]["layers_per_stage"],
            baseline_layers=doc[key]["layers_per_stage"],
            simulated_gain=sim[key] / sim["plan"],
            steps=steps,
            check_passed=check.returncode == 0,
            check_tail=check.stdout.strip().splitlines()[-1:] if check.stdout else check.stderr[-300:],
            files=out,
        )
        rec["measured_gain"] = rec["ratio"]  # median baseline / median plan; its spread: ratio_range
        rec["measured_over_simulated"] = rec["ratio"] / rec["simulated_gain"]
        emit(rec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--cases", default="gpt2,uneven")
    ap.add_argument("--ps", default="4,8")
    ap.add_argument("--limits", default="a,recompute", help="a: (a)'s peak; recompute: (a)'s with recomputation")
    ap.add_argument("--global-batch", type=int, default=0, help="instead of each table's (gpt2 16, uneven 256)")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # one case, a short search: the format (tests)
        args.cases, args.ps, args.time_limit = "uneven", "4", 3.0
    for case in filter(None, args.cases.split(",")):  # --cases "" --measure: the measured part alone
        for p in (int(x) for x in args.ps.split(",")):
            for two in (False, True):
                for limit in args.limits.split(","):
                    emit(simulated(case, p, two, args.time_limit, limit == "recompute", args.global_batch))
                    if args.smoke:
                        return
    if args.measure:
        measured(args.rounds, args.steps, args.time_limit)


if __name__ == "__main__":
    main()
