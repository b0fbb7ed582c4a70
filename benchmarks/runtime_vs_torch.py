"""pipec's runtime against torch.distributed.pipelining on the same model, the same data, in one run.

    .venv/bin/python benchmarks/runtime_vs_torch.py [--rounds 5] [--steps 4] [--schedules 1f1b,interleaved-1f1b,zb-v]

The model: 16 blocks of Linear(256, 256) + GELU in float64, split evenly over the stages (4 stages of 4
blocks for 1F1B; 8 stages of 2 blocks for interleaved 1F1B with v=2 and for ZB-V), the MSE loss against a
fixed target; the batch is m=8 micro-batches of 32 rows. p=4 processes on gloo, one thread each. A step is
what a training loop does: zero the gradients, the schedule's forward and backward passes, SGD on every
stage (torch's `schedule.step()` then `optimizer.step()`; pipec's `Runner.step`, whose STEP instructions
run the optimizers). Its time is the slowest rank's, between two barriers.

Before timing, each system runs one step from the same initial weights on the same batch, and their
gradients are compared, parameter by parameter, in float64: the largest relative difference
(max |pipec - torch| / max |torch| over each tensor) is in every line as `grad_max_rel_diff`, and the
script exits with an error when it exceeds `grad_rtol` (1e-9). That step also holds the first-step
shape inference. Each system then runs `--steps` steps per round (after two warm-up steps), rounds
alternate between the two systems (`sidebyside.alternate`: torch, pipec, torch, ...) so both see the
same load, and the median over all
timed steps is reported: one JSON line per schedule with the ratio pipec/torch (target <= 1.0), and the
CPU seconds per step of all four processes (all their threads: compute, Python, gloo's I/O threads),
which other load on the machine disturbs less than wall time. Then the dispatch overhead on an empty
model (y = w * x on one number per micro-batch, one scalar weight per stage), 1F1B: both systems' step
times, pipec's step time per instruction of its busiest rank (mostly waiting for peers), and its main
threads' CPU time per instruction (the executor's own cost: the instruction loop, posting and
completing messages, the tiny autograd calls), next to torch's main-thread CPU per step. The load
average before the run (other processes) and after it is in every line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from sidebyside import alternate, emit, load_average

P, M, ROWS, WIDTH, BLOCKS = 4, 8, 32, 256, 16
SCHEDULES = {  # pipec library name -> (torch class name, stages, placement)
    "1f1b": ("Schedule1F1B", P, lambda s: s),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2 * P, lambda s: s % P),
    "zb-v": ("ScheduleZBVZeroBubble", 2 * P, lambda s: s if s < P else 2 * P - 1 - s),
}


def build_stage(stage: int, num_stages: int, blocks: int = BLOCKS, width: int = WIDTH):
    from torch import nn

    n = blocks // num_stages
    return nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(width, width), nn.GELU())])


class Scale:
    """The empty model's stage: y = w * x, one scalar weight."""

    @staticmethod
    def build(stage: int, num_stages: int):
        import torch
        from torch import nn

        class _Scale(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(()))

            def forward(self, x):
                return x * self.w

        return _Scale()


def loss_fn(output, target):
    import torch

    return torch.nn.functional.mse_loss(output, target)


def data(rows: int, width: int):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g, dtype=torch.float64)
    return x, torch.randn(rows, width, generator=g, dtype=torch.float64)


def make_modules(num_stages: int, mine: list[int], build) -> dict:
    import torch

    out = {}
    for s in mine:
        torch.manual_seed(1000 + s)
        out[s] = build(s, num_stages).double()
    return out


class TorchSide:
    def __init__(self, name: str, rank: int, build, rows: int) -> None:
        import torch
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining.stage import PipelineStage

        cls_name, S, place = SCHEDULES[name]
        self.mine = [s for s in range(S) if place(s) == rank]
        self.modules = make_modules(S, self.mine, build)
        stages = [PipelineStage(self.modules[s], s, S, torch.device("cpu")) for s in self.mine]
        cls = getattr(schedules, cls_name)
        self.schedule = cls(stages[0] if cls_name == "Schedule1F1B" else stages, M, loss_fn=loss_fn)
        params = [p for mod in self.modules.values() for p in mod.parameters()]
        self.opt = torch.optim.SGD(params, lr=1e-3)
        self.first, self.last = 0 in self.mine, S - 1 in self.mine

    def step(self, x, y) -> None:
        self.opt.zero_grad(set_to_none=True)
        kw = {"target": y, "losses": []} if self.last else {}
        self.schedule.step(*((x,) if self.first else ()), **kw)
        self.opt.step()


class PipecSide:
    def __init__(self, name: str, rank: int, build, rows: int) -> None:
        import torch

        from pipec.api import load
        from pipec.passes.compiler import compile_schedule
        from pipec.runtime import Runner, StageOptions

        params = {"p": P, "m": M, **({"v": 2} if name == "interleaved-1f1b" else {})}
        self.program = compile_schedule(load(name, **params)).program

        def build_seeded(s: int, S: int):
            torch.manual_seed(1000 + s)
            return build(s, S)

        self.runner = Runner(
            self.program,
            build_seeded,
            loss_fn,
            rank=rank,
            options=StageOptions(optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3), dtype=torch.float64, seed=None),
        )
        self.instructions = [len(rp) for rp in self.program.ranks]

    def step(self, x, y) -> None:
        self.runner.step(x, y)


GRAD_RTOL = 1e-9  # float64: the two systems sum the same micro-batch gradients, in orders that may differ


def grads_of(modules: dict) -> dict[tuple[int, str], object]:
    """This rank's gradients by (stage, parameter name), after a step."""
    return {(s, n): p.grad for s, mod in modules.items() for n, p in mod.named_parameters()}


def largest_rel_diff(ours: dict, theirs: dict) -> tuple[float, int]:
    """max over parameters of max|ours - theirs| / max|theirs| (inf when one side lacks a gradient or
    has another shape), and how many nonzero gradient tensors were compared."""
    worst, compared = 0.0, 0
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape != b.shape:
            return float("inf"), compared
        scale = float(b.abs().max())
        diff = float((a - b).abs().max())
        worst = max(worst, diff / scale if scale > 0 else diff)
        compared += scale > 0
    return worst, compared


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")  # the store is the parent's
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Before the group exists, or its default arguments keep the group and gloo's threads alive past
    # destroy_process_group, and one may abort the exit (see runtime/job/launch.py, Worker._teardown).
    import torch.distributed.nn.functional  # noqa: F401

    dist.init_process_group("gloo")
    rows = []

    def timed(side, x, y, n: int) -> list[tuple[float, float, float]]:
        """(wall s of the slowest rank, CPU s of all ranks' processes, CPU s of all ranks' main threads)."""
        times = []
        for _ in range(n):
            dist.barrier()
            t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
            side.step(x, y)
            t1, c1, h1 = time.perf_counter(), time.process_time(), time.thread_time()
            wall = torch.tensor([t1 - t0], dtype=torch.float64)
            cpu = torch.tensor([c1 - c0, h1 - h0], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
            times.append((float(wall), *cpu.tolist()))
        return times

    cases = [(name, build_stage, ROWS, WIDTH) for name in args.schedules]
    if args.empty:
        cases.append(("empty:1f1b", Scale.build, 1, 1))
    for name, build, rows_per_mb, width in cases:
        sched = name.split(":")[-1]
        x, y = data(rows_per_mb * M, width)
        sides = {
            "torch": TorchSide(sched, rank, build, rows_per_mb),
            "pipec": PipecSide(sched, rank, build, rows_per_mb),
        }
        times: dict[str, list[tuple[float, float, float]]] = {"torch": [], "pipec": []}
        # Both start from the same weights and see the same batch: their first step's gradients must agree.
        for side in sides.values():
            side.step(x, y)
        worst, compared = largest_rel_diff(grads_of(sides["pipec"].runner.modules()), grads_of(sides["torch"].modules))
        diff, count = torch.tensor([worst], dtype=torch.float64), torch.tensor([compared], dtype=torch.int64)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
        for side in sides.values():
            timed(side, x, y, 2)  # warm-up: first allocations

        def run(who: str, sides: dict = sides, times: dict = times, x=x, y=y):
            def one_round() -> float:
                steps = timed(sides[who], x, y, args.steps)
                times[who] += steps
                return sum(t[0] for t in steps)

            return one_round

        alternate({"torch": run("torch"), "pipec": run("pipec")}, args.rounds)
        rows.append((name, times, sides["pipec"].instructions, (float(diff), int(count))))
        del sides
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def run_ranks(target, world: int, args: argparse.Namespace) -> tuple[list, list[int | None]]:
    """Spawn `target(rank, world, port, args, queue)` on `world` processes around one c10d store; return
    what rank 0 puts on the queue and the processes' exit codes (exit with a message after `args.timeout`
    seconds without a result)."""
    import multiprocessing as mp

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, store.port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        rows = out.get(timeout=args.timeout)
    except Exception:
        for p in procs:
            p.kill()
        sys.exit(f"no result after {args.timeout} s (a rank failed: see above)")
    for p in procs:
        p.join(60)
    return rows, [p.exitcode for p in procs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per system (default 5)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round (default 4)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default: all three)")
    ap.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    ap.add_argument("--no-empty", dest="empty", action="store_false", help="skip the dispatch-overhead run")
    args = ap.parse_args()
    args.schedules = [s for s in args.schedules.split(",") if s]
    load_before = load_average()[0]  # other processes on the machine, before this run adds its own
    rows, codes = run_ranks(worker, P, args)
    load = {"loadavg_1min_before": round(load_before, 2), "loadavg_1min_after": load_average()[0]}
    disagree = []
    for name, times, instrs, (grad_diff, grad_tensors) in rows:
        med = {who: [statistics.median(t[k] for t in ts) for k in range(3)] for who, ts in times.items()}
        (t, t_cpu, t_main), (q, q_cpu, q_main) = med["torch"], med["pipec"]
        common = {
            "p": P,
            "m": M,
            "backend": "gloo",
            "steps": len(times["pipec"]),
            "grad_max_rel_diff": grad_diff,
            "grad_rtol": GRAD_RTOL,
            "grad_tensors_compared": grad_tensors,
            **load,
        }
        if not grad_diff <= GRAD_RTOL or grad_tensors == 0:
            disagree.append(f"{name}: {grad_diff:.3g}")
        if name.startswith("empty:"):
            line = {
                "benchmark": "dispatch_overhead",
                "schedule": name.split(":")[1],
                "model": "empty (y = w * x, one scalar per micro-batch)",
                **common,
                "pipec_step_s": q,
                "torch_step_s": t,
                "instructions_per_rank": instrs,
                "pipec_per_instruction_us": q / max(instrs) * 1e6,
                "pipec_main_thread_cpu_per_instruction_us": q_main / sum(instrs) * 1e6,
                "torch_main_thread_cpu_per_step_s": t_main,
                "pipec_main_thread_cpu_per_step_s": q_main,
            }
        else:
            line = {
                "benchmark": "runtime_vs_torch",
                "schedule": name,
                "model": f"{BLOCKS} x (Linear({WIDTH}, {WIDTH}) + GELU), float64, {ROWS} rows per micro-batch",
                **common,
                "torch_step_s": t,
                "pipec_step_s": q,
                "ratio": q / t,
                "torch_cpu_s": t_cpu,
                "pipec_cpu_s": q_cpu,
                "cpu_ratio": q_cpu / t_cpu,
            }
        emit(line)
    if any(codes):  # after the results were sent: reported, not fatal
        print(f"note: worker exit codes {codes}", file=sys.stderr)
    if disagree:  # the timings mean nothing if the two systems do not compute the same thing
        sys.exit(
            f"error: pipec's and torch's gradients disagree (largest relative difference, float64): "
            f"{'; '.join(disagree)} > {GRAD_RTOL}"
        )


if __name__ == "__main__":
    main()
