"""Simulator fidelity: the step time `pipec simulate` predicts from `pipec profile`'s costs, against the step
time `pipec run` measures, on p=2 (or `--p 4`, `--dp 2`) gloo processes, for 1F1B, interleaved 1F1B (v=2), ZB-H1
and ZB-V.

    .venv/bin/python benchmarks/fidelity.py [--rounds 3] [--steps 12] [--reps 30] [--m 8]
    .venv/bin/python benchmarks/fidelity.py --smoke    # 1F1B, a small model, 1 round: the format (tests)

The model is benchmarks/blocks_model.py (16 blocks of Linear(256, 256) + GELU in float64, 32 rows per
micro-batch). For each schedule and round, exactly what a user would type:

    pipec profile NAME -D p=2 [-D v=2] -D m=8 --model benchmarks/blocks_model.py -o costs.toml
    pipec simulate NAME -D p=2 [-D v=2] -D m=8 --cost costs.toml --json        # its makespan
    pipec profile NAME ... --in-situ -o situ.toml; pipec simulate NAME ... --cost situ.toml --json
    pipec run NAME -D p=2 [-D v=2] -D m=8 --model benchmarks/blocks_model.py --nproc 2 --steps K

The measured step time is the median of the printed step times after the first two (the shape
handshake and first allocations). One JSON line per schedule: the medians over the rounds of the
simulated and measured step times and the relative error (simulated - measured) / measured, which the
target wants within 15%, and the error of each round. To tell where a difference comes from, the run
and the simulation also write traces of one step (`--trace`): `compute_ratio` is the busiest rank's
measured compute time over the simulated one (how well the profiled op times held in the run),
`idle_ms` a rank's time between the step's first and last op not spent computing (mean over ranks),
and `send_to_use_ms` the median time from sending a message to the start of the op that uses it,
each measured and simulated.
`measured_over_simulated_per_kind` is the residual per op kind: the traced step's F (B, W) time on all ranks,
measured over simulated. `shares_cores`: the profile timed more processes than CPUs in turns and the cost file
says so (docs/simulate.md, "Ranks that share cores").
`overhead_us` is the per-instruction overhead `pipec profile` measured, and `error_without_overhead`
the error of a simulation that leaves it out (`--cost overhead=0`). The `in_situ_*` fields are the same
for the costs of `pipec profile --in-situ` (F, B, W and the overhead measured in steps of the schedule
run on two processes: pipec.runtime.profile.insitu), whose runs are separate from the measured ones.
`in_situ_own_error` compares that simulation with the in-situ profile's own run (its median step): the costs
and the step come from the same minutes, so the machine's drift between a profile and a later run (on a
shared virtual machine, consecutive runs of one job differ by up to 60%; docs/runtime.md) is out of it, and
what is left is the simulator's composition of the costs. With
`--transfer`, `partner_*` are those of a simulation with the in-situ costs of another schedule with the same
stages and kind of backward (GPipe for 1F1B, looped BFS for interleaved 1F1B, ZB-H2 for ZB-H1): whether
costs measured in one schedule predict another.
The load average (at the start and end, `sidebyside.emit`) is reported because other processes on the machine
stretch the measured times.
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

import numpy as np
from sidebyside import emit, load_average, smoke_flag

from pipec.formats.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]
PIPEC = [sys.executable, "-m", "pipec.cli.app"]
MODEL = "benchmarks/blocks_model.py"
MODEL_TEXT = "{BLOCKS} x (Linear({BLOCKS_WIDTH}, {BLOCKS_WIDTH}) + GELU), float64, {BLOCKS_ROWS} rows per micro-batch"
CASES = {"1f1b": {}, "interleaved-1f1b": {"v": 2}, "zb-h1": {}, "zb-v": {}}
# --transfer: a schedule with the same stages and kind of backward, whose in-situ costs predict the case's
PARTNER = {"1f1b": "gpipe", "interleaved-1f1b": "looped-bfs", "zb-h1": "zb-h2", "zb-v": "zb-v"}
STEP = re.compile(r"^step\s+(\d+)/\d+: loss \S+, ([0-9.]+) s", re.M)


def sim_result(text: str) -> dict:
    """The one result of `pipec simulate --json` (its envelope: version, command, ok, results)."""
    return json.loads(text)["results"][0]


def defines(extra: dict, m: int, p: int = 2, dp: int = 1) -> list[str]:
    out = []
    for k, v in {"p": p, **extra, "m": m}.items():
        out += ["-D", f"{k}={v}"]
    return out + (["--dp", str(dp)] if dp > 1 else [])


def sh(args: list[str], env: dict, tries: int = 2) -> str:
    for attempt in range(tries):
        res = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
        if res.returncode == 0:
            return res.stdout
        cmd = " ".join(args)
        print(f"attempt {attempt + 1} failed ({res.returncode}): {cmd}\n{res.stderr[-2000:]}", file=sys.stderr)
    sys.exit(f"failed {tries} times: {' '.join(args)}")


def one_round(name: str, extra: dict, args: argparse.Namespace, tmp: str, env: dict) -> dict:
    d = defines(extra, args.m, args.p, args.dp)
    cost, sim_trace, run_trace = (os.path.join(tmp, f"{name}.{x}") for x in ("toml", "sim.json", "run.json"))
    sh([*PIPEC, "profile", name, *d, "--model", MODEL, "-o", cost, "--reps", str(args.reps)], env)
    sim = sim_result(sh([*PIPEC, "simulate", name, *d, "--cost", cost, "--json", "--trace", sim_trace], env))
    bare = sim_result(sh([*PIPEC, "simulate", name, *d, "--cost", cost, "--cost", "overhead=0", "--json"], env))
    situ_cost = os.path.join(tmp, f"{name}.situ.toml")
    sh([*PIPEC, "profile", name, *d, "--model", MODEL, "-o", situ_cost, "--reps", str(args.reps), "--in-situ"], env)
    situ = sim_result(sh([*PIPEC, "simulate", name, *d, "--cost", situ_cost, "--json"], env))
    with open(situ_cost, "rb") as f:  # the in-situ profile's own run: its median step, at the same moment
        situ_step = tomllib.load(f)["measured"]["in_situ"]["step"]
    moved = None
    if args.transfer:  # the partner's in-situ costs, simulated for this schedule
        moved_cost = os.path.join(tmp, f"{name}.partner.toml")
        profile = [*PIPEC, "profile", PARTNER[name], *d, "--model", MODEL, "-o", moved_cost, "--reps", str(args.reps)]
        sh([*profile, "--in-situ"], env)
        moved = sim_result(sh([*PIPEC, "simulate", name, *d, "--cost", moved_cost, "--json"], env))["makespan"]
    run = [*PIPEC, "run", name, *d, "--model", MODEL, "--nproc", str(args.p * args.dp), "--steps", str(args.steps)]
    out = sh([*run, "--trace", run_trace], env)
    steps = [float(t) for _, t in STEP.findall(out)]
    if len(steps) != args.steps:
        sys.exit(f"could not read {args.steps} step times from pipec run's output:\n{out}")
    simulated, measured = read_trace(sim_trace), read_trace(run_trace)  # the last step, traced
    return {
        "simulated_s": sim["makespan"],
        "simulated_without_overhead_s": bare["makespan"],
        "overhead_us": 1e6 * sim["costs"]["overhead"],
        "in_situ_simulated_s": situ["makespan"],
        "partner_simulated_s": moved,
        "in_situ_overhead_us": 1e6 * situ["costs"]["overhead"],
        "in_situ_own_step_s": situ_step,
        "measured_s": statistics.median(steps[2:]),
        # where a difference comes from: compute (the busiest rank's op time) or waiting (idle time)
        "compute_ratio": busiest(measured) / busiest(simulated),
        "idle_ms": 1e3 * idle(measured),
        "simulated_idle_ms": 1e3 * idle(simulated),
        "send_to_use_ms": 1e3 * send_to_use(measured),
        "simulated_send_to_use_ms": 1e3 * send_to_use(simulated),
        "kind_ratio": kind_ratio(measured, simulated),
        "shares_cores": "cores_per_node" in open(cost).read(),
    }


KINDS = {0: "F", 1: "B", 2: "W"}  # the traces' op codes of the compute kinds


def kind_ratio(measured, simulated) -> dict[str, float]:
    """Per op kind, the traced step's measured time over the simulated one (all ranks' ops of the kind):
    the residual of each kind's cost, 1.0 where the simulator charged it exactly."""
    out = {}
    for code, kind in KINDS.items():
        sim = float((simulated.end - simulated.start)[simulated.op == code].sum())
        mea = float((measured.end - measured.start)[measured.op == code].sum())
        if sim > 0:
            out[kind] = mea / sim
    return out


def busiest(tl) -> float:
    """Compute time of the busiest rank."""
    return max(float((tl.end - tl.start)[tl.rank == r].sum()) for r in range(tl.num_ranks))


def idle(tl) -> float:
    """Mean over ranks of the time between the step's first op and its last one not spent computing."""
    span = float(tl.end.max() - tl.start.min())
    return float(np.mean([span - (tl.end - tl.start)[tl.rank == r].sum() for r in range(tl.num_ranks)]))


def send_to_use(tl) -> float:
    """Median time from sending a message to the start of the op that uses it (FWD of the next stage for
    an activation, BWD of the previous stage for a gradient): transfer plus any wait for the receiver."""
    start = {(int(o), int(m), int(s)): float(t) for o, m, s, t in zip(tl.op, tl.mb, tl.stage, tl.start)}
    gaps = []
    for kind, mb, stage, sent in zip(tl.msg_kind, tl.msg_mb, tl.msg_stage, tl.msg_send):
        use = start.get((0, int(mb), int(stage) + 1) if kind == 0 else (1, int(mb), int(stage) - 1))
        if use is not None:
            gaps.append(use - float(sent))
    return float(np.median(gaps)) if gaps else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="profile+simulate+run rounds per schedule (default 3)")
    ap.add_argument("--steps", type=int, default=12, help="steps per pipec run (default 12; the first 2 dropped)")
    ap.add_argument("--reps", type=int, default=30, help="pipec profile --reps (default 30)")
    ap.add_argument("--m", type=int, default=8, help="micro-batches (default 8)")
    ap.add_argument("--p", type=int, default=2, help="pipeline ranks (default 2; 4 on 2 cores: ranks share them)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    ap.add_argument("--schedules", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    ap.add_argument(
        "--transfer",
        action="store_true",
        help="also simulate each schedule with the in-situ costs of a partner (" + ", ".join(PARTNER.values()) + ")",
    )
    smoke_flag(ap)
    args = ap.parse_args()
    small = {}
    if args.smoke:  # 1F1B on a small model, one round of 3 steps, a short profile: the format, not the figure
        args.rounds, args.steps, args.reps, args.m, args.schedules = 1, 3, 2, 2, "1f1b"
        small = {"BLOCKS": "4", "BLOCKS_WIDTH": "32", "BLOCKS_ROWS": "4"}
    if args.steps < 3:
        ap.error("--steps must be at least 3")
    env = dict(os.environ, BLOCKS_M=str(args.m), PYTHONPATH=str(ROOT), **small)
    names = [s for s in args.schedules.split(",") if s]
    results: dict[str, list[dict]] = {n: [] for n in names}
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="pipec-fidelity-") as tmp:
        for r in range(args.rounds):  # schedules alternate within a round, so a load spike hits them all alike;
            for name in names if r % 2 == 0 else names[::-1]:  # ABBA: every other round in reverse
                results[name].append(one_round(name, CASES[name], args, tmp, env))
    for name in names:
        rows = results[name]
        med = {
            k: statistics.median(r[k] for r in rows)
            for k in rows[0]
            if rows[0][k] is not None and not isinstance(rows[0][k], dict)
        }
        kinds = {k: round(statistics.median(r["kind_ratio"][k] for r in rows), 3) for k in rows[0]["kind_ratio"]}
        sim, mea = med["simulated_s"], med["measured_s"]
        own = [(r["in_situ_simulated_s"] - r["in_situ_own_step_s"]) / r["in_situ_own_step_s"] for r in rows]
        emit(
            {
                "benchmark": "fidelity",
                "schedule": name,
                "params": {"p": args.p, **CASES[name], "m": args.m, **({"dp": args.dp} if args.dp > 1 else {})},
                "shares_cores": rows[0]["shares_cores"],
                "model": MODEL_TEXT.format(**{"BLOCKS": "16", "BLOCKS_WIDTH": "256", "BLOCKS_ROWS": "32", **small}),
                "backend": "gloo",
                "rounds": args.rounds,
                "simulated_s": sim,
                "measured_s": mea,
                "error": (sim - mea) / mea,
                "within_10pct": abs(sim - mea) <= 0.10 * mea,
                "within_15pct": abs(sim - mea) <= 0.15 * mea,
                "measured_over_simulated_per_kind": kinds,
                "overhead_us": round(med["overhead_us"], 1),
                "error_without_overhead": (med["simulated_without_overhead_s"] - mea) / mea,
                "error_per_round": [round((r["simulated_s"] - r["measured_s"]) / r["measured_s"], 4) for r in rows],
                "in_situ_simulated_s": med["in_situ_simulated_s"],
                "in_situ_error": (med["in_situ_simulated_s"] - mea) / mea,
                "in_situ_within_15pct": abs(med["in_situ_simulated_s"] - mea) <= 0.15 * mea,
                "in_situ_error_per_round": [
                    round((r["in_situ_simulated_s"] - r["measured_s"]) / r["measured_s"], 4) for r in rows
                ],
                "in_situ_overhead_us": round(med["in_situ_overhead_us"], 1),
                # the simulator against the very run the in-situ costs came from: no drift of the machine
                # between the profile and the measurement, only the model's composition of the costs
                "in_situ_own_error_per_round": [round(e, 4) for e in own],
                "in_situ_own_error": statistics.median(own),
                **(
                    {
                        "partner": PARTNER[name],
                        "partner_simulated_s": med["partner_simulated_s"],
                        "partner_error": (med["partner_simulated_s"] - mea) / mea,
                    }
                    if args.transfer
                    else {}
                ),
                "compute_ratio": round(med["compute_ratio"], 3),
                "idle_ms": round(med["idle_ms"], 3),
                "simulated_idle_ms": round(med["simulated_idle_ms"], 3),
                "send_to_use_ms": round(med["send_to_use_ms"], 3),
                "simulated_send_to_use_ms": round(med["simulated_send_to_use_ms"], 3),
                "load_avg_start": load_start,
            }
        )


if __name__ == "__main__":
    main()
