"""The executor's own CPU per instruction, profiled: where `executor_cpu_us` goes, and a tree against another.

    .venv/bin/python benchmarks/executor_profile.py                          # p=2 m=64 and p=4 m=8, shm ranks
    .venv/bin/python benchmarks/executor_profile.py --trees /tmp/before,.    # A/B: two source trees, alternated
    .venv/bin/python benchmarks/executor_profile.py --profile 25 --configs 2x64   # cProfile of rank 0's steps
    .venv/bin/python benchmarks/executor_profile.py --mode local             # every rank in this one process
    .venv/bin/python benchmarks/executor_profile.py --polls 0,20,50,100      # pipec under each poll budget too:
                                                                             # CPU per instruction, ms per step

The workload is runtime_vs_torch's dispatch side (its `Scale` empty model, y = w * x on one number per
micro-batch, 1F1B, float64, its `PipecSide` and `FloorSide`), without torch's side and without the long
rounds. Why a second script: `runtime_vs_torch --only-dispatch` needs minutes per figure and puts torch's
pipeline between every pipec round; this one measures only what the executor adds, so a change to the hot
path can be judged in seconds, and `--profile` says which calls the microseconds go to.

`--mode shm` (default): p processes on this host with the shared-memory transport (what runtime_vs_torch's
`pipec` side uses); each round, every rank times `--steps` pipec steps and then `--steps` floor steps with
`time.thread_time` (its main thread's CPU: waiting on a futex costs none), summed over the ranks and divided
by the ranks' instructions: `dispatch_cpu_us`, `floor_cpu_us`, and their difference `executor_cpu_us`, the
median of `--rounds` rounds with [min, max]; beside them `system_cpu_us`, the kernel's part of the pipec
steps' CPU per instruction (futex sleeps and wake-ups), and `sleeps_per_step`, the main threads' voluntary
context switches per step over all ranks (`getrusage(RUSAGE_THREAD)`). `--mode local`: all ranks in this process through
`pipec.runtime.LocalPipeline` (in-memory queues, one thread: deterministic, the generator path of the loop).

`--trees A,B`: each tree's pipec is imported in its own processes (its folder first on `sys.path`), the
trees alternated launch by launch (A B B A ...) `--launches` times, so both see the same load; one JSON line
per launch and a summary line per tree. Every line carries the load average (`/proc/loadavg`).

`--profile N`: rank 0's pipec steps (shm) or the whole step (local) under cProfile; the N functions of
most own time, as `tottime_us` per instruction of that rank (cProfile's own overhead inflates every figure
alike: read it for proportions).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from sidebyside import emit, smoke_flag

HERE = os.path.dirname(os.path.abspath(__file__))


def load() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def use_tree(tree: str | None) -> None:
    """Import pipec from `tree` (its folder first on sys.path), and runtime_vs_torch from this folder."""
    if tree:
        sys.path.insert(0, os.path.abspath(tree))
    sys.path.insert(1 if tree else 0, HERE)


def profile_rows(prof, instrs: int, top: int) -> list[dict]:
    import pstats

    st = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in st.stats.items():
        rows.append(
            {
                "function": f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({name})",
                "calls_per_instr": round(ncalls / instrs, 3),
                "tottime_us": round(1e6 * tottime / instrs, 3),
                "cumtime_us": round(1e6 * cumtime / instrs, 3),
            }
        )
    rows.sort(key=lambda r: -r["tottime_us"])
    return rows[:top]


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    use_tree(args.tree)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import torch.distributed.nn.functional  # noqa: F401  (before the group: see runtime_vs_torch.worker)
    from runtime_vs_torch import FloorSide, PipecSide, Scale, data

    dist.init_process_group("gloo")
    p, m = args.p, args.m
    x, y = data(m, 1)
    pipec = PipecSide("1f1b", rank, Scale.build, p, m, "auto")
    floor = FloorSide(rank, Scale.build, m, pipec.program)
    polled = {}  # --polls: pipec again under each poll budget (PIPEC_SHM_POLL_US, read when its transport starts)
    for us in args.polls:
        os.environ["PIPEC_SHM_POLL_US"] = str(us)
        polled[us] = PipecSide("1f1b", rank, Scale.build, p, m, "auto")
    if args.polls:
        os.environ.pop("PIPEC_SHM_POLL_US", None)
    for side in polled.values():
        for _ in range(3):
            side.step(x, y)
    instrs = sum(pipec.instructions)
    for _ in range(3):  # the handshake, the first allocations
        pipec.step(x, y)
        floor.step(x, y)
    prof = None
    if args.profile and rank == 0:
        import cProfile

        prof = cProfile.Profile(time.thread_time)  # CPU, not wall: waits cost none

    def timed(side, n: int, profiled: bool = False) -> tuple[float, float, float, float]:
        """Per step, summed over the ranks: main-thread CPU s, its system part s, its sleeps (voluntary
        context switches: each a wait for a message, and a wake-up by its sender); and the wall s of the
        n steps, summed over the ranks (they start together, after a barrier)."""
        dist.barrier()
        t0, c0, r0 = time.perf_counter(), time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD)
        if profiled:
            prof.enable()
        for _ in range(n):
            side.step(x, y)
        if profiled:
            prof.disable()
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        sums = [time.thread_time() - c0, r1.ru_stime - r0.ru_stime, r1.ru_nvcsw - r0.ru_nvcsw, time.perf_counter() - t0]
        cpu = torch.tensor(sums, dtype=torch.float64)
        dist.all_reduce(cpu)
        return tuple(float(v) / n for v in cpu)

    rounds, system = [], []
    per_poll: dict[int, list[float]] = {us: [] for us in polled}
    poll_wall: dict[int, list[float]] = {us: [] for us in polled}
    for k in range(args.rounds):
        a, a_sys, a_sleeps, _ = timed(pipec, args.steps, prof is not None)
        b = timed(floor, args.steps)[0]
        rounds.append((1e6 * a / instrs, 1e6 * b / instrs))
        system.append((1e6 * a_sys / instrs, a_sleeps))
        for us in list(polled)[:: 1 if k % 2 == 0 else -1]:  # A B C, C B A, ...
            cpu, _, _, wall = timed(polled[us], args.steps)
            per_poll[us].append(1e6 * cpu / instrs)
            poll_wall[us].append(1e3 * wall / p)  # ms per step, the ranks' mean
    if rank == 0:
        res = {"rounds": rounds, "system": system, "transport": pipec.transport, "instructions": pipec.instructions}
        if per_poll:
            res["polls"] = {us: round(statistics.median(v), 2) for us, v in per_poll.items()}
            res["poll_wall"] = {us: round(statistics.median(v), 3) for us, v in poll_wall.items()}
        if prof is not None:
            res["profile"] = profile_rows(prof, args.rounds * args.steps * pipec.instructions[0], args.profile)
        out.put(res)
    dist.destroy_process_group()


def run_shm(args: argparse.Namespace) -> dict:
    import multiprocessing as mp

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.p, store.port, args, out)) for r in range(args.p)]
    for pr in procs:
        pr.start()
    try:
        res = out.get(timeout=args.timeout)
    except Exception:
        for pr in procs:
            pr.kill()
        sys.exit(f"no result after {args.timeout} s (a rank failed: see above)")
    for pr in procs:
        pr.join(60)
    return res


def run_local(args: argparse.Namespace) -> dict:
    use_tree(args.tree)
    import torch

    torch.set_num_threads(1)
    from runtime_vs_torch import FloorSide, Scale, data, loss_fn

    from pipec.api import load as load_schedule
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime import LocalPipeline, StageOptions

    program = compile_schedule(load_schedule("1f1b", p=args.p, m=args.m)).program

    def build_seeded(s: int, S: int):
        torch.manual_seed(1000 + s)
        return Scale.build(s, S)

    opts = StageOptions(optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3), dtype=torch.float64, seed=None)
    pipe = LocalPipeline(program, build_seeded, loss_fn, options=opts)
    floors = [FloorSide(r, Scale.build, args.m, program) for r in range(args.p)]
    x, y = data(args.m, 1)
    instrs = sum(len(rp) for rp in program.ranks)

    def floor_step() -> None:
        for f in floors:
            f.step(x, y)

    for _ in range(3):
        pipe.step(x, y)
        floor_step()
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile(time.thread_time)  # CPU, not wall: waits cost none
    rounds = []
    for _ in range(args.rounds):
        c0 = time.thread_time()
        if prof is not None:
            prof.enable()
        for _ in range(args.steps):
            pipe.step(x, y)
        if prof is not None:
            prof.disable()
        a = (time.thread_time() - c0) / args.steps
        c0 = time.thread_time()
        for _ in range(args.steps):
            floor_step()
        b = (time.thread_time() - c0) / args.steps
        rounds.append((1e6 * a / instrs, 1e6 * b / instrs))
    res = {"rounds": rounds, "transport": "LocalComm", "instructions": [len(rp) for rp in program.ranks]}
    if prof is not None:
        res["profile"] = profile_rows(prof, args.rounds * args.steps * instrs, args.profile)
    return res


def summary(rounds: list[tuple[float, float]]) -> dict:
    disp = [a for a, _ in rounds]
    floor = [b for _, b in rounds]
    own = [a - b for a, b in rounds]

    def fig(xs: list[float]) -> list[float]:
        return [round(statistics.median(xs), 2), round(min(xs), 2), round(max(xs), 2)]

    return {"dispatch_cpu_us": fig(disp), "floor_cpu_us": fig(floor), "executor_cpu_us": fig(own)}


def system_figures(system: list[tuple[float, float]] | None) -> dict:
    """shm mode: of the pipec steps' main-thread CPU per instruction, the kernel's part (`system_cpu_us`:
    futex sleeps and wake-ups, the FIFO polls), and the sleeps per step over all ranks (`sleeps_per_step`),
    medians over the rounds: what waiting for messages costs, which no executor code can take off."""
    if not system:
        return {}
    return {
        "system_cpu_us": round(statistics.median(s for s, _ in system), 2),
        "sleeps_per_step": round(statistics.median(n for _, n in system), 1),
    }


def child(args: argparse.Namespace) -> None:
    """One launch: the figures of one tree at one configuration, as one JSON line on stdout."""
    t0, load0 = time.perf_counter(), load()
    res = run_shm(args) if args.mode == "shm" else run_local(args)
    rec = {
        "benchmark": "executor_profile",
        "tree": args.tree or ".",
        "mode": args.mode,
        "transport": res["transport"],
        "p": args.p,
        "m": args.m,
        "steps": args.steps,
        "rounds": args.rounds,
        **summary(res["rounds"]),
        "executor_cpu_us_rounds": [round(a - b, 2) for a, b in res["rounds"]],
        **system_figures(res.get("system")),
        **({"dispatch_cpu_us_by_poll_us": res["polls"]} if "polls" in res else {}),
        **({"step_ms_by_poll_us": res["poll_wall"]} if "polls" in res else {}),
        "load_avg_start": load0,
        "load_avg_end": load(),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    emit(rec)
    for row in res.get("profile", []):
        emit({"profile": f"p={args.p} m={args.m}", **row})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="2x64,4x8", help="p x m pairs, comma-separated (default 2x64,4x8)")
    ap.add_argument("--mode", choices=("shm", "local"), default="shm")
    ap.add_argument("--steps", type=int, default=10, help="steps per round and side")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trees", default="", help="source trees to alternate, comma-separated (default: this one)")
    ap.add_argument("--launches", type=int, default=2, help="launches per tree and configuration, alternated")
    ap.add_argument("--profile", type=int, default=0, help="print the N functions of most own time (cProfile)")
    ap.add_argument(
        "--polls",
        default="",
        help="shm mode: also time pipec under each of these poll budgets (us, comma-separated; PIPEC_SHM_POLL_US),"
        " alternated within each round: `dispatch_cpu_us_by_poll_us`",
    )
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--tree", default="", help=argparse.SUPPRESS)  # a child launch: the one tree it imports
    ap.add_argument("--p", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--m", type=int, default=0, help=argparse.SUPPRESS)
    smoke_flag(ap)
    args = ap.parse_args()
    if args.p:  # a child launch: the poll budgets as numbers
        args.polls = [int(v) for v in args.polls.split(",") if v]
        if args.polls and args.mode != "shm":
            sys.exit("--polls needs --mode shm")
    if args.smoke:  # one small configuration, one launch of 2 short rounds, one poll budget: the format (tests)
        args.configs, args.steps, args.rounds, args.launches = "2x4", 2, 2, 1
        args.polls = args.polls or "0"
    if args.p:
        child(args)
        return
    trees = [t for t in args.trees.split(",") if t] or [""]
    per: dict[tuple[str, str], list[list[float]]] = {}
    for cfg in args.configs.split(","):
        p, m = (int(v) for v in cfg.split("x"))
        for k in range(args.launches):
            order = trees if k % 2 == 0 else trees[::-1]  # A B, B A, ...: a first-launch cost is shared
            for tree in order:
                argv = [sys.executable, __file__, "--p", str(p), "--m", str(m), "--mode", args.mode]
                argv += ["--steps", str(args.steps), "--rounds", str(args.rounds), "--tree", tree]
                argv += ["--profile", str(args.profile), "--timeout", str(args.timeout), "--polls", args.polls]
                text = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
                sys.stdout.write(text)
                sys.stdout.flush()
                first = json.loads(text.splitlines()[0])
                per.setdefault((cfg, tree or "."), []).extend(first["executor_cpu_us_rounds"])
    for (cfg, tree), own in per.items():
        fig = [round(statistics.median(own), 2), round(min(own), 2), round(max(own), 2)]
        emit({"summary": cfg, "tree": tree, "executor_cpu_us": fig, "rounds": len(own), "load": load()})


if __name__ == "__main__":
    main()
