"""Peak saved activation bytes predicted against measured, and recompute/offload against the simulator:
JSON lines, or docs/memory.md's "Predicted against measured" tables with --markdown.

    .venv/bin/python benchmarks/memory_measured.py peaks [--markdown]      # every library schedule, p=4
    .venv/bin/python benchmarks/memory_measured.py peaks --model examples/hf_gpt2.py --markdown
    .venv/bin/python benchmarks/memory_measured.py time [--rounds 3] [--steps 6] [--markdown]
    .venv/bin/python benchmarks/memory_measured.py --smoke   # both parts, 1F1B alone, 1 round (tests)

`peaks`: every library schedule (`pipec list`) at p=4 (m=8; the default parameters otherwise) on
examples/mlp.py, run in this process (`LocalPipeline`, the runtime's executor and saved-tensor holders,
pipec.runtime.exec.saved) for two steps; the measured figure is each rank's peak saved bytes in the last step
(device and host pools), the predicted one pipec's memory model (`program_memory`) on the bytes `pipec
profile` counts (`stage_bytes`). A schedule that does not build at p=4 (a topology it needs) is reported
as skipped with its reason.

`time`: 1f1b, 1f1b-recompute, zb-v, zb-v-recompute and 1f1b-offload at p=4 m=8 on 4 gloo processes: each
family is profiled once (`pipec profile 1f1b|zb-v -o COST.toml`, ops timed one at a time), each schedule
simulated on its family's file (`pipec simulate NAME --cost COST.toml --json`: makespan, and per rank
the device and host peaks less the rank's parameter state), then run in `--rounds` alternating rounds
(the launch entry point `pipec run` starts, with `--memory-out`: per-step seconds, and the last step's
measured peaks). A run's step is the median of its
steps after the first; a schedule's, the median over the rounds; `vs_1f1b_measured` is the median over
rounds of its step over 1f1b's in the same round (side by side), against the simulated ratio. Every line
carries the load averages (the machine is shared: the times are fidelity figures, not speeds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from sidebyside import emit, load_average, smoke_flag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "examples", "mlp.py")
TIMED = ("1f1b", "1f1b-recompute", "zb-v", "zb-v-recompute", "1f1b-offload")


def _load() -> float:
    return load_average()[0]


def _compile(name: str, p: int, m: int):
    from pipec.driver import build
    from pipec.frontend import library
    from pipec.passes.compiler import compile_schedule

    sched = build(library.read(name), [("p", str(p)), ("m", str(m))])
    return sched, compile_schedule(sched).program


def peaks_row(name: str, p: int = 4, m: int = 8, steps: int = 2, model_path: str = MODEL) -> dict:
    """One schedule's predicted and measured peaks per rank (see the module docstring)."""
    from pipec.driver import memory_overrides
    from pipec.runtime.local import LocalPipeline
    from pipec.runtime.model.contract import load_model
    from pipec.runtime.profile.held import stage_bytes
    from pipec.runtime.runner import StageOptions
    from pipec.sim.memory import program_memory

    try:
        sched, program = _compile(name, p, m)
    except Exception as e:  # noqa: BLE001 - reported in the row
        return {"schedule": name, "skipped": str(e).splitlines()[0]}
    model = load_model(model_path)
    options = StageOptions(optimizer=model.optimizer, dtype=model.dtype)
    pipe = LocalPipeline(program, model.build_stage, model.loss_fn, options=options)
    for runner in pipe.runners:
        runner.executor.measure_memory()
    for step in range(steps):
        pipe.step(*model.batch(step))
    predicted = program_memory(program, sched, memory_overrides([stage_bytes(program, model)]))
    ranks = []
    for r, (rep, runner) in enumerate(zip(predicted, pipe.runners)):
        got = runner.executor.peaks
        ranks.append(
            {
                "rank": r,
                "device_predicted": int(round(rep.peak - rep.params)),
                "device_measured": got.device,
                "host_predicted": int(round(rep.host_peak)),
                "host_measured": got.host,
            }
        )
    return {
        "schedule": name,
        "model": os.path.relpath(model_path, ROOT),
        "params": dict(program.params),
        "ranks": ranks,
        "worst_error": _worst(ranks),
    }


def _worst(ranks: list[dict]) -> float:
    errs = [
        abs(r[f"{pool}_measured"] - r[f"{pool}_predicted"]) / r[f"{pool}_predicted"]
        for r in ranks
        for pool in ("device", "host")
        if r[f"{pool}_predicted"]
    ]
    return round(max(errs, default=0.0), 6)


def _pipec(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipec", *argv], capture_output=True, text=True, cwd=ROOT)


def base_of(name: str) -> str:
    """The schedule whose profile `name` is simulated with: its family's plain one (same ops, same B)."""
    return "zb-v" if name.startswith("zb-v") else "1f1b"


def profile_and_simulate(name: str, tmp: str, p: int = 4, m: int = 8) -> dict:
    """`pipec profile BASE -o COST.toml` once per family (`base_of`: on a shared machine two profiles of the
    same ops differ with the load, which would show as a difference between the schedules), then `pipec
    simulate NAME --cost COST.toml --json` (see the module docstring)."""
    import tomllib

    cost = os.path.join(tmp, f"{base_of(name)}.toml")
    defs = ["-D", f"p={p}", "-D", f"m={m}"]
    if not os.path.exists(cost):
        prof = _pipec("profile", base_of(name), *defs, "--model", MODEL, "-o", cost, "--reps", "10")
        if prof.returncode:
            return {"error": prof.stderr.strip().splitlines()[-1:]}
    sim = json.loads(_pipec("simulate", name, *defs, "--cost", cost, "--json").stdout)["results"][0]
    with open(cost, "rb") as f:
        state = tomllib.load(f)["state_bytes"]
    _, program = _compile(name, p, m)
    rank_state = [sum(state[s] for s, r in enumerate(program.placement) if r == k) for k in range(program.num_ranks)]
    return {"sim": sim, "rank_state": rank_state}


def run_once(name: str, tmp: str, p: int = 4, m: int = 8, steps: int = 6) -> dict:
    """One `pipec run`-style job (the launch entry point, with `--memory-out`): the median step after the
    first, and each rank's measured peaks."""
    from pipec.runtime.job.report import read_records

    out_path = os.path.join(tmp, f"{name}.memory.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(p)]
    cmd += ["-m", "pipec.runtime.job.launch", name, "-D", f"p={p}", "-D", f"m={m}", "--model", MODEL]
    records = os.path.join(tmp, f"{name}.records.jsonl")
    cmd += ["--steps", str(steps), "--memory-out", out_path, "--records", records]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // p))))
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if run.returncode:
        return {"error": (run.stdout + run.stderr).strip().splitlines()[-3:]}
    seconds = [s["seconds"] for s in read_records(records)["steps"]][1:]
    with open(out_path) as f:
        return {"step": statistics.median(seconds), "peaks": json.load(f), "loadavg": _load()}


def time_rows(tmp: str, rounds: int, steps: int, names: tuple[str, ...] = TIMED) -> list[dict]:
    """Every schedule profiled and simulated once, then run in `rounds` ABBA rounds; per schedule the
    median measured step over the rounds against the simulated makespan, and, side by side, its measured
    step over 1f1b's in the same round against the simulated ratio."""
    sims = {name: profile_and_simulate(name, tmp) for name in names}
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):  # ABBA: every other round in reverse, so no schedule always runs first
        for name in names if r % 2 == 0 else names[::-1]:
            if "error" not in sims[name]:
                runs[name].append(run_once(name, tmp, steps=steps))
    rows = []
    base = "1f1b"
    for name in names:
        bad = sims[name].get("error") or next((r["error"] for r in runs[name] if "error" in r), None)
        if bad:
            rows.append({"schedule": name, "error": bad})
            continue
        sim, state = sims[name]["sim"], sims[name]["rank_state"]
        step = statistics.median(r["step"] for r in runs[name])
        peaks = runs[name][-1]["peaks"]
        ranks = [
            {
                "rank": r,
                "device_simulated": int(per["peak_memory"] - state[r]),
                "device_measured": peaks[r]["device"],
                "host_simulated": int(per.get("host_peak_memory", 0)),
                "host_measured": peaks[r]["host"],
            }
            for r, per in enumerate(sim["per_rank"])
        ]
        row = {
            "schedule": name,
            "p": 4,
            "m": 8,
            "rounds": rounds,
            "step_measured_s": round(step, 6),
            "makespan_simulated_s": round(sim["makespan"], 6),
            "time_ratio": round(step / sim["makespan"], 3),
            "ranks": ranks,
            "load_avg_1min_per_round": [r["loadavg"] for r in runs[name]],
        }
        if base in runs and runs[base] and "error" not in sims[base] and all("step" in r for r in runs[base]):
            per_round = [a["step"] / b["step"] for a, b in zip(runs[name], runs[base])]
            row["vs_1f1b_measured"] = round(statistics.median(per_round), 3)
            row["vs_1f1b_measured_range"] = [round(min(per_round), 3), round(max(per_round), 3)]
            row["vs_1f1b_simulated"] = round(sim["makespan"] / sims[base]["sim"]["makespan"], 3)
        rows.append(row)
    return rows


def _kib(x: int) -> str:
    return f"{x / 1024:.1f}"


def peaks_markdown(rows: list[dict]) -> str:
    lines = [
        "| schedule | rank: device KiB predicted / measured (host) | worst error |",
        "|---|---|---|",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['schedule']} | skipped: {row['skipped']} | - |")
            continue
        cells = []
        for r in row["ranks"]:
            cell = f"{r['rank']}: {_kib(r['device_predicted'])} / {_kib(r['device_measured'])}"
            if r["host_predicted"] or r["host_measured"]:
                cell += f" (host {_kib(r['host_predicted'])} / {_kib(r['host_measured'])})"
            cells.append(cell)
        lines.append(f"| {row['schedule']} | {'; '.join(cells)} | {100 * row['worst_error']:.1f}% |")
    return "\n".join(lines)


def time_markdown(rows: list[dict]) -> str:
    lines = [
        "| schedule | step measured ms | simulated ms | measured / simulated | vs 1F1B measured / simulated "
        "| device KiB per rank: simulated / measured | host KiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['schedule']} | failed: {' '.join(row['error'])} | | | | | |")
            continue
        dev = "; ".join(f"{_kib(r['device_simulated'])} / {_kib(r['device_measured'])}" for r in row["ranks"])
        host = "; ".join(f"{_kib(r['host_simulated'])} / {_kib(r['host_measured'])}" for r in row["ranks"])
        vs = f"{row['vs_1f1b_measured']:.2f} / {row['vs_1f1b_simulated']:.2f}" if "vs_1f1b_measured" in row else "-"
        lines.append(
            f"| {row['schedule']} | {1e3 * row['step_measured_s']:.1f} | {1e3 * row['makespan_simulated_s']:.1f} "
            f"| {row['time_ratio']:.2f} | {vs} | {dev} | {host} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", nargs="?", choices=("peaks", "time"), help="required unless --smoke")
    ap.add_argument("--steps", type=int, default=6, help="time: training steps per run (the first is dropped)")
    ap.add_argument("--rounds", type=int, default=3, help="time: alternating rounds of runs (default 3)")
    ap.add_argument("--markdown", action="store_true", help="print docs/memory.md's table instead of JSON lines")
    ap.add_argument("--model", default=MODEL, help="peaks: the model file (default examples/mlp.py)")
    ap.add_argument("--schedules", default=None, help="peaks: comma-separated library names (default: all)")
    smoke_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:  # both parts on 1F1B alone, the time part for one round of 2 steps: the format (tests)
        peaks = main(["peaks", "--schedules", "1f1b"])
        with tempfile.TemporaryDirectory(prefix="pipec-memory-") as tmp:
            for row in time_rows(tmp, 1, 2, ("1f1b",)):
                emit({"benchmark": "memory_measured_time", **row})
        return peaks
    if args.part is None:
        ap.error("the part (peaks or time) is required")
    rows = []
    if args.part == "peaks":
        from pipec.frontend import library

        for name in args.schedules.split(",") if args.schedules else library.names():
            rows.append(peaks_row(name, model_path=os.path.abspath(args.model)))
            if not args.markdown:
                emit({"benchmark": "memory_measured_peaks", **rows[-1]})
        if args.markdown:
            print(peaks_markdown(rows))
        return 0 if all(r.get("worst_error", 0.0) <= 0.05 for r in rows) else 1
    with tempfile.TemporaryDirectory(prefix="pipec-memory-") as tmp:
        rows = time_rows(tmp, args.rounds, args.steps)
    if not args.markdown:
        for row in rows:
            emit({"benchmark": "memory_measured_time", **row})
    if args.markdown:
        print(time_markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
