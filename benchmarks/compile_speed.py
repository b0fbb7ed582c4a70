"""Compile speed: pipec against torch.distributed.pipelining, cold and warm, start-up, and pipec's scaling.

Prints one JSON line per measurement (`sidebyside`: medians, every round, the ratio with its spread over
the rounds, CPU beside wall time, the load average). Each compile runs in a fresh subprocess, so nothing
computed by an earlier one in memory helps and peak memory is its own. pipec compiles from text (parse,
evaluate, every check, lowering with its rendezvous dry run, as `pipec compile` does); torch runs
`get_schedule_ops(..., with_comms=True)` on interleaved 1F1B p=32 v=2 m=256. The figure is the compile
alone, in the process (imports not counted: `startup` times those), as wall time and as CPU time (the
process's: one thread compiles, and other load on the machine moves CPU time far less than wall time).
The two systems alternate in ABBA rounds (pipec torch, torch pipec, ...: `sidebyside.alternate`).

- cold: pipec's fresh process with an empty `PIPEC_CACHE_DIR` (a new temporary folder every round), so it
  builds lark's parser tables and the schedule text's generated code itself, as a user's first compile of
  a new schedule file does; torch has no such cache, so its every run is cold.
- warm: pipec's fresh process with a `PIPEC_CACHE_DIR` an earlier (untimed) process filled: the per-user
  cache already holds the parser tables and this text's code, as on a second compile of the same file.

Ratios are torch's time over pipec's (higher is better for pipec; the issue's goal is 20 cold):
`cold_ratio_cpu`, `cold_ratio_wall`, `warm_ratio_cpu`, `warm_ratio_wall`, each with its spread over the
rounds (`..._range`: the smallest and largest round's ratio). Start-up: the wall and CPU time of
`python -c "import ..."` for what each compile needs, against a bare interpreter. Scaling: pipec alone from
about 10,000 to 1,000,000 compute ops, one fresh process each, wall, user and system (kernel) CPU time.

    python benchmarks/compile_speed.py            # everything (a few minutes on 2 cores)
    python benchmarks/compile_speed.py --quick    # skip the 1,000,000-op points
    python benchmarks/compile_speed.py --only ref --rounds 7   # just the cold and warm comparisons
    python benchmarks/compile_speed.py --only cli              # `pipec --version` and `pipec list` start-up
    python benchmarks/compile_speed.py --only wide --rounds 3  # wide pipelines: 1f1b p=10000 m=8, p=1000 m=64
    python benchmarks/compile_speed.py --only wide --against REV --rounds 3  # the same, this tree against REV
    python benchmarks/compile_speed.py --smoke    # ref and scaling at their smallest, 1 round (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from sidebyside import Timing, alternate, emit, load_average, run_process, smoke_flag, summarize


def _rusage() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def pipec_once(name: str, params: dict[str, int]) -> dict:
    """One compile in this (fresh) process; the cache is whatever `PIPEC_CACHE_DIR` holds."""
    t0 = time.perf_counter()
    from pipec.driver import build
    from pipec.frontend.library import read
    from pipec.passes.compiler import compile_schedule

    t_import = time.perf_counter() - t0
    source = read(name)
    (u0, s0), t0, c0 = _rusage(), time.perf_counter(), time.process_time()
    sched = build(source, params)
    t_front = time.perf_counter() - t0
    compiled = compile_schedule(sched)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    u1, s1 = _rusage()
    return {
        "benchmark": "compile_speed_one",
        "system": "pipec",
        "schedule": name,
        "params": params,
        "compute_ops": sched.num_ops,
        "instructions": compiled.program.num_instructions,
        "seconds": round(total, 4),
        "cpu_seconds": round(cpu, 4),
        "user_seconds": round(u1 - u0, 4),
        "system_seconds": round(s1 - s0, 4),
        "seconds_front_end": round(t_front, 4),
        "import_seconds": round(t_import, 4),
        "us_per_op": round(1e6 * total / sched.num_ops, 3),
        "cpu_us_per_op": round(1e6 * cpu / sched.num_ops, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def torch_once(p: int, v: int, m: int) -> dict:
    """One `get_schedule_ops(with_comms=True)` in this (fresh) process."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    t0, c0 = time.perf_counter(), time.process_time()
    ops = get_schedule_ops(ScheduleInterleaved1F1B, p, m, num_stages_per_rank=v, with_comms=True)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    compute = sum(1 for rank in ops for a in rank if a is not None and "SEND" not in str(a) and "RECV" not in str(a))
    return {
        "benchmark": "compile_speed_one",
        "system": "torch.distributed.pipelining",
        "schedule": "interleaved-1f1b",
        "params": {"p": p, "v": v, "m": m},
        "compute_ops_and_reduce": compute,
        "seconds": round(seconds, 4),
        "cpu_seconds": round(cpu, 4),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def in_subprocess(
    kind: str, name: str, params: dict[str, int], cache: str | None = None, tree: str | None = None
) -> dict:
    """One compile in a fresh process (`--one`), with `PIPEC_CACHE_DIR=cache` where given and pipec imported
    from the checkout `tree` where given (`--against`); its record."""
    env = dict(os.environ, **({"PIPEC_CACHE_DIR": cache} if cache else {}))
    if tree:
        env["PYTHONPATH"] = tree
    out = subprocess.run(
        [sys.executable, __file__, "--one", kind, name, json.dumps(params)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
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


def startup_seconds(code: str) -> Timing:
    """Wall and CPU time of a fresh interpreter running `code` (interpreter start included)."""
    return run_process([sys.executable, "-c", code])


PIPEC_IMPORTS = "from pipec.driver import build; from pipec.frontend.library import read; " + (
    "from pipec.passes.compiler import compile_schedule"
)
TORCH_IMPORTS = "from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops; " + (
    "from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B"
)


REF = {"p": 32, "v": 2, "m": 256}


def reference(rounds: int, ref: dict[str, int] = REF) -> None:
    """Interleaved 1F1B, p=32, v=2, m=256 (32,768 compute ops): pipec and torch side by side, cold and warm
    (see the module docstring); one record each, then one line with the four ratios."""
    named: dict = {}
    with tempfile.TemporaryDirectory(prefix="pipec-compile-speed-") as tmp:
        warm_cache = os.path.join(tmp, "warm")
        in_subprocess("pipec", "interleaved-1f1b", ref, warm_cache)  # fills the warm cache (untimed)
        for process in ("cold", "warm"):
            records: dict[str, list[dict]] = {"pipec": [], "torch": []}

            def run(kind: str, process: str = process, records: dict = records):
                def once() -> Timing:
                    cache = warm_cache if process == "warm" else tempfile.mkdtemp(dir=tmp, prefix="cold-")
                    rec = in_subprocess(kind, "interleaved-1f1b", ref, cache if kind == "pipec" else None)
                    records[kind].append(rec)
                    return Timing(rec["seconds"], rec["cpu_seconds"])

                return once

            start = load_average()
            seconds = alternate({"pipec": run("pipec"), "torch": run("torch")}, rounds)
            ours, theirs = records["pipec"], records["torch"]
            rec = summarize(
                "compile_speed",
                seconds,
                ratio=("torch", "pipec"),
                load_start=start,
                comparison="interleaved-1f1b p=32 v=2 m=256, compile with comms" if ref == REF else f"{ref}",
                process=process,
                pipec_cache="empty (a new PIPEC_CACHE_DIR each round)" if process == "cold" else "filled earlier",
                compute_ops=ours[0]["compute_ops"],
                instructions=ours[0]["instructions"],
                pipec_front_end_median_s=statistics.median(r["seconds_front_end"] for r in ours),
                pipec_import_median_s=statistics.median(r["import_seconds"] for r in ours),
                pipec_peak_rss_mb=max(r["peak_rss_mb"] for r in ours),
                torch_peak_rss_mb=max(r["peak_rss_mb"] for r in theirs),
            )
            for how, key in (("wall", "ratio"), ("cpu", "ratio_cpu")):
                rec[f"{process}_ratio_{how}"] = rec[key]  # torch / pipec: higher is better for pipec
                rec[f"{process}_ratio_{how}_range"] = rec[f"{key}_range"]
                named[f"{process}_ratio_{how}"], named[f"{process}_ratio_{how}_range"] = rec[key], rec[f"{key}_range"]
            rec["target_ratio"] = 20 if process == "cold" else None
            emit(rec)
    emit(
        {
            "benchmark": "compile_speed_ratios",
            "comparison": "torch time / pipec time, medians over ABBA rounds (higher is better for pipec)",
            "rounds": rounds,
            **named,
            "target_cold_ratio": 20,
        }
    )


def worktree(rev: str) -> str:
    """A checkout of commit `rev` beside this one (git worktree, made once), importable with PYTHONPATH: its
    `pipec/grammar` and `pipec/schedules` linked as the package-dir mapping installs them, so nothing of
    this tree's (its grammar, its shipped parser tables) is read by the other."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sha = subprocess.run(["git", "-C", root, "rev-parse", rev], check=True, capture_output=True, text=True)
    where = os.path.join(tempfile.gettempdir(), f"pipec-at-{sha.stdout.strip()[:12]}")
    if not os.path.isdir(where):
        subprocess.run(
            ["git", "-C", root, "worktree", "add", "--detach", where, sha.stdout.strip()],
            check=True,
            capture_output=True,
        )
    for name in ("grammar", "schedules"):
        link = os.path.join(where, "pipec", name)
        if not os.path.exists(link):
            os.symlink(os.path.join("..", name), link)
    return where


def against(rev: str, rounds: int, ref: dict[str, int] = REF) -> None:
    """This tree's cold compile of the reference case against commit `rev`'s, side by side in ABBA rounds
    (fresh processes, an empty cache each): the ratio before / now (above 1: faster now). Issue 42 asks that
    the stage graph leave the chain's compile within 5% of its figure before the change."""
    tree = worktree(rev)
    records: dict[str, list[dict]] = {"now": [], "before": []}
    with tempfile.TemporaryDirectory(prefix="pipec-compile-against-") as tmp:

        def run(which: str):
            def once() -> Timing:
                cache = tempfile.mkdtemp(dir=tmp, prefix="cold-")
                rec = in_subprocess("pipec", "interleaved-1f1b", ref, cache, tree if which == "before" else None)
                records[which].append(rec)
                return Timing(rec["seconds"], rec["cpu_seconds"])

            return once

        start = load_average()
        seconds = alternate({"now": run("now"), "before": run("before")}, rounds)
    rec = summarize(
        "compile_speed_against",
        seconds,
        ratio=("before", "now"),
        load_start=start,
        before=rev,
        comparison=f"interleaved-1f1b {ref}, cold compile with comms, this tree against {rev}",
        instructions={k: v[0]["instructions"] for k, v in records.items()},
    )
    rec["target"] = "ratio >= 0.95 (within 5%)"
    emit(rec)


WIDE = [{"p": 10000, "m": 8}, {"p": 1000, "m": 64}]


def wide(rounds: int, rev: str | None = None, points: list[dict[str, int]] = WIDE) -> None:
    """Wide pipelines (many ranks, few ops each: 1f1b p=10000 m=8 is 160,000 compute ops over ten thousand
    ranks, issue 45): one fresh process per round, a warm cache (the parse cache filled by an untimed
    process, so the figure is evaluation and the compile), medians over the rounds; with `rev`, this tree
    against commit `rev`'s in ABBA rounds (ratio before / now, above 1: faster now)."""
    tree = worktree(rev) if rev else None
    with tempfile.TemporaryDirectory(prefix="pipec-compile-wide-") as tmp:
        for params in points:
            records: dict[str, list[dict]] = {"now": [], "before": []}
            for which in ("now", "before") if tree else ("now",):  # fill each tree's warm cache, untimed
                in_subprocess("pipec", "1f1b", params, os.path.join(tmp, which), tree if which == "before" else None)

            def run(which: str, records: dict = records, params: dict = params):
                def once() -> Timing:
                    cache = os.path.join(tmp, which)
                    rec = in_subprocess("pipec", "1f1b", params, cache, tree if which == "before" else None)
                    records[which].append(rec)
                    return Timing(rec["seconds"], rec["cpu_seconds"])

                return once

            start = load_average()
            systems = {"now": run("now"), "before": run("before")} if tree else {"now": run("now")}
            seconds = alternate(systems, rounds)
            rec = summarize(
                "compile_speed_wide",
                seconds,
                ratio=("before", "now") if tree else None,
                load_start=start,
                schedule="1f1b",
                params=params,
                before=rev,
                compute_ops=records["now"][0]["compute_ops"],
                instructions=records["now"][0]["instructions"],
                **{
                    f"{which}_{field}_median_s": round(statistics.median(r[key] for r in rs), 4)
                    for which, rs in records.items()
                    if rs
                    for field, key in (("front_end", "seconds_front_end"), ("total", "seconds"), ("cpu", "cpu_seconds"))
                },
                **{
                    f"{which}_compile_median_s": round(
                        statistics.median(r["seconds"] - r["seconds_front_end"] for r in rs), 4
                    )
                    for which, rs in records.items()
                    if rs
                },
            )
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


def cli_startup(rounds: int) -> None:
    """`pipec --version` and `pipec list` (the console script, a fresh process each, as a shell runs them)
    against a bare interpreter, in ABBA rounds; the goal is 0.10 s wall each (issue 41). The ratios are
    each command's time over the bare interpreter's: what pipec adds to Python's own start."""
    script = os.path.join(os.path.dirname(sys.executable), "pipec")
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "pipec"]
    start = load_average()
    seconds = alternate(
        {
            "python": lambda: run_process([sys.executable, "-c", "pass"]),
            "pipec_version": lambda: run_process([*command, "--version"]),
            "pipec_list": lambda: run_process([*command, "list"]),
        },
        rounds,
        warmup=1,
    )
    for name in ("pipec_version", "pipec_list"):
        rec = summarize(f"cli_startup_{name}", seconds, ratio=(name, "python"), load_start=start, command=command)
        rec["target_s"] = 0.10
        emit(rec)


SCALING = {
    "1f1b": [{"p": 8, "m": 640}, {"p": 32, "m": 1600}, {"p": 64, "m": 3200}, {"p": 128, "m": 4096}],
    "zb-v": [{"p": 8, "m": 208}, {"p": 32, "m": 520}, {"p": 64, "m": 1300}, {"p": 128, "m": 1302}],
}


def scaling(quick: bool, points: dict = SCALING) -> None:
    """About 10k to 1M compute ops, one fresh process each."""
    for name, grid in points.items():
        rows = []
        for params in grid:
            if quick and params["p"] == 128:
                continue
            rec = in_subprocess("pipec", name, params)
            rec["benchmark"] = "compile_speed_point"
            rows.append(rec)
            emit(rec)
        if len(rows) >= 2:
            emit(
                {
                    "benchmark": "compile_speed_scaling",
                    "scaling": name,
                    "ops_small": rows[0]["compute_ops"],
                    "ops_large": rows[-1]["compute_ops"],
                    "us_per_op_small": rows[0]["us_per_op"],
                    "us_per_op_large": rows[-1]["us_per_op"],
                    "per_op_ratio": round(rows[-1]["us_per_op"] / rows[0]["us_per_op"], 2),
                    "cpu_us_per_op_small": rows[0]["cpu_us_per_op"],
                    "cpu_us_per_op_large": rows[-1]["cpu_us_per_op"],
                    "cpu_per_op_ratio": round(rows[-1]["cpu_us_per_op"] / rows[0]["cpu_us_per_op"], 2),
                    "system_seconds_large": rows[-1]["system_seconds"],
                    "target_per_op_ratio": 1.5,
                    "seconds_large": rows[-1]["seconds"],
                    "target_seconds_at_1M": 10,
                }
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the largest scaling points")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per comparison (default 5)")
    ap.add_argument("--only", choices=("ref", "startup", "cli", "scaling", "wide"), help="run one part only")
    ap.add_argument("--against", metavar="REV", help="this tree's cold compile against commit REV's (side by side)")
    ap.add_argument("--one", nargs=3, metavar=("KIND", "NAME", "PARAMS"), help=argparse.SUPPRESS)
    smoke_flag(ap)
    args = ap.parse_args()
    if args.one:
        kind, name, params = args.one
        params = json.loads(params)
        if kind == "pipec":
            emit(pipec_once(name, params))
        else:
            emit(torch_once(params["p"], params["v"], params["m"]))
        return
    compile_bytecode()
    if args.only == "wide":
        wide(1 if args.smoke else args.rounds, args.against, [{"p": 16, "m": 8}] if args.smoke else WIDE)
        return
    if args.against:
        against(args.against, args.rounds)
        return
    small = args.smoke  # p=4 v=2 m=8 for the comparison, two small scaling points, 1 round
    if small:
        args.rounds = 1
    if args.only in (None, "ref"):
        reference(args.rounds, {"p": 4, "v": 2, "m": 8} if small else REF)
    if args.only in (None, "startup") and not small:  # --smoke: `startup` is a plain summarize line, skipped
        startup(args.rounds)
    if args.only in (None, "cli") and not small:  # a plain summarize line, like `startup`
        cli_startup(max(args.rounds, 10))
    if args.only in (None, "scaling"):
        scaling(args.quick, {"1f1b": [{"p": 4, "m": 8}, {"p": 4, "m": 32}]} if small else SCALING)


if __name__ == "__main__":
    main()
