"""Compile speed: pipec against torch.distributed.pipelining, start-up, and pipec's scaling to a million ops.

Prints one JSON line per measurement (`sidebyside`: medians, every round, the ratio, the load average).
Each measurement runs in a fresh subprocess, so nothing computed by an earlier one helps and peak
memory is its own. pipec compiles from text (parse, evaluate, every check, lowering with its rendezvous
dry run, as `pipec compile` does); torch runs `get_schedule_ops(..., with_comms=True)`. The two systems
alternate round by round (pipec, torch, pipec, torch, ...) so both see the same load; `speedup` is
torch's median wall time over pipec's, `cpu_speedup` the same for CPU time (steadier under load).
"fresh": the first compile in the process (pipec loads its parser tables from the per-user cache and
builds its lexers); "warm": after compiling another schedule first. Start-up: the wall time of
`python -c "import ..."` for what each compile needs, against a bare interpreter.

    python benchmarks/compile_speed.py            # everything (a few minutes on 2 cores)
    python benchmarks/compile_speed.py --quick    # skip the 1,000,000-op points
    python benchmarks/compile_speed.py --only ref --rounds 7   # just the side-by-side comparison
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from sidebyside import alternate, emit, load_average, summarize


def pipec_once(name: str, params: dict[str, int], warm: bool = False) -> dict:
    t0 = time.perf_counter()
    from pipec.driver import build
    from pipec.frontend.library import read
    from pipec.passes.compiler import compile_schedule

    t_import = time.perf_counter() - t0
    if warm:  # load the grammar tables and touch every pass once, on another schedule
        compile_schedule(build(read("gpipe"), {"p": 2, "m": 2}))
    source = read(name)
    t0, c0 = time.perf_counter(), time.process_time()
    sched = build(source, params)
    t_front = time.perf_counter() - t0
    compiled = compile_schedule(sched)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "system": "pipec",
        "process": "warm" if warm else "fresh",
        "schedule": name,
        "params": params,
        "compute_ops": sched.num_ops,
        "instructions": compiled.program.num_instructions,
        "seconds": round(total, 4),
        "cpu_seconds": round(cpu, 4),
        "seconds_front_end": round(t_front, 4),
        "import_seconds": round(t_import, 4),
        "us_per_op": round(1e6 * total / sched.num_ops, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def torch_once(p: int, v: int, m: int, warm: bool = False) -> dict:
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    if warm:
        get_schedule_ops(ScheduleInterleaved1F1B, 2, 2, num_stages_per_rank=2, with_comms=True)
    t0, c0 = time.perf_counter(), time.process_time()
    ops = get_schedule_ops(ScheduleInterleaved1F1B, p, m, num_stages_per_rank=v, with_comms=True)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    compute = sum(1 for rank in ops for a in rank if a is not None and "SEND" not in str(a) and "RECV" not in str(a))
    return {
        "system": "torch.distributed.pipelining",
        "process": "warm" if warm else "fresh",
        "schedule": "interleaved-1f1b",
        "params": {"p": p, "v": v, "m": m},
        "compute_ops_and_reduce": compute,
        "seconds": round(seconds, 4),
        "cpu_seconds": round(cpu, 4),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def in_subprocess(kind: str, name: str, params: dict[str, int], warm: bool = False) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--one", kind, name, json.dumps(params)] + (["--warm"] if warm else []),
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_bytecode() -> None:
    """Write pipec's bytecode first, as installing it does: with PYTHONDONTWRITEBYTECODE set (as on some
    machines) a fresh process would otherwise recompile every edited module, which torch's installed
    modules never pay."""
    import compileall
    import importlib.util

    for name in ("pipec", "pipec.runtime", "pipec.grammar", "pipec.schedules"):
        spec = importlib.util.find_spec(name)
        for where in spec.submodule_search_locations or () if spec else ():
            compileall.compile_dir(where, quiet=1)


def startup_seconds(code: str) -> float:
    """Wall time of a fresh interpreter running `code` (interpreter start included)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t0


PIPEC_IMPORTS = "from pipec.driver import build; from pipec.frontend.library import read; " + (
    "from pipec.passes.compiler import compile_schedule"
)
TORCH_IMPORTS = "from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops; " + (
    "from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B"
)


def reference(rounds: int) -> None:
    """Interleaved 1F1B, p=32, v=2, m=256 (32,768 compute ops): pipec and torch side by side."""
    ref = {"p": 32, "v": 2, "m": 256}
    for warm in (False, True):
        records: dict[str, list[dict]] = {"pipec": [], "torch": []}

        def run(kind: str, warm: bool = warm, records: dict[str, list[dict]] = records):
            def once() -> float:
                records[kind].append(in_subprocess(kind, "interleaved-1f1b", ref, warm))
                return records[kind][-1]["seconds"]

            return once

        start = load_average()
        seconds = alternate({"pipec": run("pipec"), "torch": run("torch")}, rounds)
        ours, theirs = records["pipec"], records["torch"]
        rec = summarize(
            "compile_speed",
            seconds,
            ratio=("torch", "pipec"),
            load_start=start,
            comparison="interleaved-1f1b p=32 v=2 m=256, compile with comms",
            process="warm" if warm else "fresh",
            compute_ops=ours[0]["compute_ops"],
            instructions=ours[0]["instructions"],
            pipec_front_end_median_s=statistics.median(r["seconds_front_end"] for r in ours),
            pipec_import_median_s=statistics.median(r["import_seconds"] for r in ours),
            pipec_peak_rss_mb=max(r["peak_rss_mb"] for r in ours),
            torch_peak_rss_mb=max(r["peak_rss_mb"] for r in theirs),
        )
        rec["speedup"] = rec["ratio"]
        rec["target_speedup"] = 20
        # CPU time of the same runs: both compile on one thread, and other load moves it far less.
        cpu = {k: statistics.median(r["cpu_seconds"] for r in v) for k, v in records.items()}
        rec["cpu_median_s"] = {k: round(x, 4) for k, x in cpu.items()}
        rec["cpu_speedup"] = round(cpu["torch"] / cpu["pipec"], 4)
        emit(rec)


def startup(rounds: int) -> None:
    """`python -c` with what a compile needs imported, pipec against torch, and a bare interpreter."""
    start = load_average()
    seconds = alternate(
        {
            "python": lambda: startup_seconds("pass"),
            "import_pipec": lambda: startup_seconds("import pipec"),
            "pipec_compile_imports": lambda: startup_seconds(PIPEC_IMPORTS),
            "torch_pipelining_imports": lambda: startup_seconds(TORCH_IMPORTS),
        },
        rounds,
    )
    emit(
        summarize(
            "startup",
            seconds,
            ratio=("torch_pipelining_imports", "pipec_compile_imports"),
            load_start=start,
            pipec_imports=PIPEC_IMPORTS,
            torch_imports=TORCH_IMPORTS,
        )
    )


def scaling(quick: bool) -> None:
    """About 10k to 1M compute ops, one fresh process each."""
    points = {
        "1f1b": [{"p": 8, "m": 640}, {"p": 32, "m": 1600}, {"p": 64, "m": 3200}, {"p": 128, "m": 4096}],
        "zb-v": [{"p": 8, "m": 208}, {"p": 32, "m": 520}, {"p": 64, "m": 1300}, {"p": 128, "m": 1302}],
    }
    for name, grid in points.items():
        rows = []
        for params in grid:
            if quick and params["p"] == 128:
                continue
            rec = in_subprocess("pipec", name, params)
            rec["load_avg"] = load_average()
            rows.append(rec)
            emit(rec)
        if len(rows) >= 2:
            emit(
                {
                    "scaling": name,
                    "ops_small": rows[0]["compute_ops"],
                    "ops_large": rows[-1]["compute_ops"],
                    "us_per_op_small": rows[0]["us_per_op"],
                    "us_per_op_large": rows[-1]["us_per_op"],
                    "per_op_ratio": round(rows[-1]["us_per_op"] / rows[0]["us_per_op"], 2),
                    "target_per_op_ratio": 1.5,
                    "seconds_large": rows[-1]["seconds"],
                    "target_seconds_at_1M": 10,
                    "load_avg": load_average(),
                }
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the largest scaling points")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per comparison (default 5)")
    ap.add_argument("--only", choices=("ref", "startup", "scaling"), help="run one part only")
    ap.add_argument("--one", nargs=3, metavar=("KIND", "NAME", "PARAMS"), help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        kind, name, params = args.one
        params = json.loads(params)
        if kind == "pipec":
            emit(pipec_once(name, params, args.warm))
        else:
            emit(torch_once(params["p"], params["v"], params["m"], args.warm))
        return
    compile_bytecode()
    if args.only in (None, "ref"):
        reference(args.rounds)
    if args.only in (None, "startup"):
        startup(args.rounds)
    if args.only in (None, "scaling"):
        scaling(args.quick)


if __name__ == "__main__":
    main()
