"""pipec's runtime against torch.distributed.pipelining on the same model, the same data, in one run.

    .venv/bin/python benchmarks/runtime_vs_torch.py [--rounds 5] [--steps 4] [--schedules 1f1b,interleaved-1f1b,zb-v]
    .venv/bin/python benchmarks/runtime_vs_torch.py --only-dispatch    # the empty-model runs alone
    .venv/bin/python benchmarks/runtime_vs_torch.py --smoke            # 1 round of 1 step, small: the format

The model: 16 blocks of Linear(256, 256) + GELU in float64, split evenly over the stages (4 stages of 4
blocks for 1F1B; 8 stages of 2 blocks for interleaved 1F1B with v=2 and for ZB-V), the MSE loss against a
fixed target; the batch is m=8 micro-batches of 32 rows. p=4 processes on gloo, one thread each. A step is
what a training loop does: zero the gradients, the schedule's forward and backward passes, SGD on every
stage (torch's `schedule.step()` then `optimizer.step()`; pipec's `Runner.step`, whose STEP instructions
run the optimizers). Its time is the slowest rank's, between two barriers.

Before timing, each system runs one step from the same initial weights on the same batch, and their
gradients are compared, parameter by parameter, in float64 (pipec's with torch's, and on the dispatch runs
the minimal loop's with pipec's): the largest relative difference
(max |pipec - torch| / max |torch| over each tensor) is in every line as `grad_max_rel_diff`, and the
script exits with an error when it exceeds `grad_rtol` (1e-9). That step also holds the first-step
shape inference. Then two warm-up steps each, and `--rounds` rounds in ABBA order (`sidebyside.alternate`:
torch pipec, pipec torch, ...) of `--steps` steps; a round's figure is its mean per step. One JSON line per
schedule (`sidebyside.summarize`): medians over the rounds of the step's wall time, of the CPU seconds of
all ranks' processes (all threads: compute, Python, gloo's I/O threads; other load disturbs it less than
wall time) and of all ranks' main threads, and the ratios pipec / torch (`ratio`, target <= 1.0;
`ratio_cpu`; `ratio_main_cpu`) each with its spread over the rounds (`..._range`, `..._iqr`).

The dispatch figure, on an empty model (y = w * x on one number per micro-batch, one scalar weight per
stage), 1F1B at p=2 m=64 and at p=4 m=8 (issue 31's two configurations), one line each:
`dispatch_cpu_us`, pipec's main-thread CPU per instruction = (the sum over ranks of the main threads' CPU
time per step) / (the sum over ranks of the instructions per step), the executor's own cost (the
instruction loop, posting and completing messages, the tiny autograd calls), median over the rounds with
its spread; `pipec_over_torch_main_cpu_per_step`, pipec's main-thread CPU per step over torch's on the same
empty model (target <= 0.5). Beside them, in the same ABBA rounds, the floor: the model's own calls on each
rank's stages (forward, loss, the engine's backward, SGD) with no pipeline around them (`FloorSide`), as
`floor_cpu_us` per pipec instruction, and `executor_cpu_us` = `dispatch_cpu_us` - `floor_cpu_us` per round:
what the executor itself adds over a model with no pipeline around it. On shared memory two more sides run
in the same rounds: `minimal` (`MinimalSide`, the same Program over the same transport under a hand-written
loop of the fewest Python calls, its gradients checked against pipec's): `minimal_cpu_us`,
`minimal_over_floor_cpu_us` (what a pipeline across processes costs on this machine whatever the executor),
`executor_over_minimal_us` (pipec's executor's own cost over that loop); and `pipec-sleep`, pipec with its
readers sleeping at once (`PIPEC_SHM_POLL_US=0`, runtime/exec/shm.py "Poll first"): its figures under
`poll_off`, and `poll_main_cpu_saved` (1 - pipec's main-thread CPU over its, median over the rounds) and
`poll_wall_ratio` (step wall time, pipec over it). `step_wall_per_instruction_us` (the step's wall time over
the busiest rank's instructions) is mostly waiting for peers, not dispatch. Every line carries the load
average at its start and end (`sidebyside.emit`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

from sidebyside import Timing, alternate, emit, load_average, smoke_flag, summarize

P, M, ROWS, WIDTH, BLOCKS = 4, 8, 32, 256, 16
SCHEDULES = {  # pipec library name -> (torch class name, stages per rank)
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "zb-v": ("ScheduleZBVZeroBubble", 2),
}
DISPATCH = ((2, 64), (4, 8))  # (p, m) of the empty-model runs: issue 31's two configurations


def placement(name: str, stage: int, p: int) -> int:
    """The rank of a stage: looped for 1F1B and interleaved 1F1B, a V for ZB-V."""
    if name == "zb-v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


@dataclass(frozen=True)
class Case:
    """One side-by-side run: `label` (the schedule, or "empty:1f1b"), the model, p ranks, m micro-batches."""

    label: str
    empty: bool
    p: int
    m: int

    @property
    def schedule(self) -> str:
        return self.label.split(":")[-1]


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
    def __init__(self, name: str, rank: int, build, p: int = P, m: int = M) -> None:
        import torch
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining.stage import PipelineStage

        cls_name, per_rank = SCHEDULES[name]
        S = per_rank * p
        self.mine = [s for s in range(S) if placement(name, s, p) == rank]
        self.modules = make_modules(S, self.mine, build)
        stages = [PipelineStage(self.modules[s], s, S, torch.device("cpu")) for s in self.mine]
        cls = getattr(schedules, cls_name)
        self.schedule = cls(stages[0] if cls_name == "Schedule1F1B" else stages, m, loss_fn=loss_fn)
        params = [p for mod in self.modules.values() for p in mod.parameters()]
        self.opt = torch.optim.SGD(params, lr=1e-3)
        self.first, self.last = 0 in self.mine, S - 1 in self.mine

    def step(self, x, y) -> None:
        self.opt.zero_grad(set_to_none=True)
        kw = {"target": y, "losses": []} if self.last else {}
        self.schedule.step(*((x,) if self.first else ()), **kw)
        self.opt.step()


class FloorSide:
    """The model's own calls on this rank, with no pipeline around them: per step, for each of the rank's
    stages and each micro-batch, the forward (the loss on the last stage, scaled by 1/m), the backward
    through autograd's engine (the call pipec's Stage makes, without the public API's Python checks)
    with a gradient of ones from the next stage, then SGD and zeroing. No messages, no instruction loop:
    what any executor of this Program must spend, so `dispatch_cpu_us` minus this, per instruction, is
    the executor's own cost (`executor_cpu_us`). Its gradients are not pipec's (a gradient of ones stands
    for the next stage's), only its calls are the same."""

    def __init__(self, rank: int, build, m: int, program) -> None:
        import torch

        S = program.num_stages
        self.mine = [s for s in range(S) if program.placement[s] == rank]
        self.modules = make_modules(S, self.mine, build)
        self.S, self.m = S, m
        params = [q for mod in self.modules.values() for q in mod.parameters()]
        self.opt = torch.optim.SGD(params, lr=1e-3)
        try:
            from torch.autograd.graph import _engine_run_backward as engine
        except ImportError:  # pragma: no cover - an older torch: the public call
            engine = None
        self.engine = engine

    def step(self, x, y) -> None:
        import torch

        self.opt.zero_grad(set_to_none=True)
        xs, ys = x.chunk(self.m), y.chunk(self.m)
        for s in self.mine:
            mod = self.modules[s]
            for i in range(self.m):
                inp = xs[i] if s == 0 else xs[i].detach().requires_grad_()
                out = mod(inp)
                if s == self.S - 1:
                    outs = (loss_fn(out, ys[i]) * (1.0 / self.m),)
                else:
                    outs = (out,)
                grads = (torch.ones_like(outs[0]),)
                if self.engine is None:
                    torch.autograd.backward(outs, grads)
                else:
                    self.engine(outs, grads, False, False, (), allow_unreachable=True, accumulate_grad=True)
        self.opt.step()


class MinimalSide:
    """The fewest Python calls that execute the same Program over the same transport: a hand-written loop
    over this rank's instructions (1F1B on the chain, one stage per rank: FWD, BWD, the four transfers,
    STEP), calling the model, autograd's engine and pipec's shared-memory transport (`ShmComm`) directly,
    with none of pipec's executor (no handler table, no values table, no receive slots, no checks). What it
    adds over the floor is what running a pipeline across processes costs on this machine (waits, wake-ups,
    the copies through shared memory) whatever the executor; pipec's executor's own cost is what pipec adds
    over it (`executor_over_minimal_us`). Its gradients are checked against pipec's after its first step."""

    def __init__(self, rank: int, build, m: int, program, x) -> None:
        import torch
        import torch.distributed as dist

        from pipec.ir.opcodes import OPCODES
        from pipec.runtime.exec import shm
        from pipec.runtime.exec.rankplan import RankPlan
        from pipec.runtime.exec.shapes import TensorSpec

        S = program.num_stages
        self.mine = [s for s in range(S) if program.placement[s] == rank]
        if len(self.mine) != 1 or program.graph is not None or program.split_backward:
            raise ValueError("the minimal loop runs a chain with one stage per rank and a whole backward")
        self.modules = make_modules(S, self.mine, build)
        self.S, self.m = S, m
        self.opt = torch.optim.SGD([q for mod in self.modules.values() for q in mod.parameters()], lr=1e-3)
        store = dist.PrefixStore("minimal/", dist.distributed_c10d._get_default_store())
        self.comm = shm.ShmComm(program, rank, 60.0, None, store)
        plan = RankPlan(program, rank)
        self.spec = (TensorSpec(tuple(x.chunk(m)[0].shape), x.dtype),)
        specs = dict.fromkeys((k for k in plan.tkeys if k is not None), self.spec)
        self.comm.prepare(specs, specs)
        self.instrs, self.tkeys = plan.instrs, plan.tkeys
        self.ops = {name: OPCODES.index(name) for name in ("FWD", "BWD", "STEP")}
        from torch.autograd.graph import _engine_run_backward

        self.engine = _engine_run_backward

    def step(self, x, y) -> None:
        import torch

        self.opt.zero_grad(set_to_none=True)
        xs, ys = x.chunk(self.m), y.chunk(self.m)
        FWD, BWD, STEP = self.ops["FWD"], self.ops["BWD"], self.ops["STEP"]
        comm, take, engine, last = self.comm, self.comm.take, self.engine, self.S - 1
        out_of, posted, saved = {}, {}, {}
        for (op, mb, s, peer, _), key in zip(self.instrs, self.tkeys):
            if op == FWD:
                inp = xs[mb] if s == 0 else take(posted.pop((0, mb, s - 1)))[0].requires_grad_()
                out = self.modules[s](inp)
                if s == last:
                    out = loss_fn(out, ys[mb]) * (1.0 / self.m)
                else:
                    out_of[(0, mb, s)] = (out.detach(),)
                saved[mb] = (inp, out)
            elif op == BWD:
                inp, out = saved.pop(mb)
                grad = torch.ones_like(out) if s == last else take(posted.pop((1, mb, s + 1)))[0]
                engine((out,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)
                if s > 0:
                    out_of[(1, mb, s)] = (inp.grad,)
            elif op == STEP:
                self.opt.step()
            elif key in out_of:  # SEND_ACT, SEND_GRAD
                comm.send(key, peer, out_of.pop(key))
            elif key is not None:  # RECV_ACT, RECV_GRAD
                posted[key] = comm.post(key, peer, self.spec)


class PipecSide:
    def __init__(self, name: str, rank: int, build, p: int = P, m: int = M, p2p: str = "auto") -> None:
        import torch

        from pipec.api import load
        from pipec.passes.compiler import compile_schedule
        from pipec.runtime import Runner, StageOptions, Transport

        params = {"p": p, "m": m, **({"v": 2} if name == "interleaved-1f1b" else {})}
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
            transport=Transport(p2p=p2p),
        )
        self.transport = type(self.runner.executor.comm).__name__
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


class poll_off:
    """Within it, shared-memory readers made sleep at once (`PIPEC_SHM_POLL_US=0`), as before the poll."""

    def __enter__(self) -> None:
        self.before = os.environ.get("PIPEC_SHM_POLL_US")
        os.environ["PIPEC_SHM_POLL_US"] = "0"

    def __exit__(self, *exc) -> None:
        if self.before is None:
            os.environ.pop("PIPEC_SHM_POLL_US", None)
        else:
            os.environ["PIPEC_SHM_POLL_US"] = self.before


def round_of(timed, side, x, y, steps: int):
    """One round of a system: `steps` timed steps (its mean per step, a `Timing`)."""
    return lambda: timed(side, x, y, steps)


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

    def timed(side, x, y, n: int) -> Timing:
        """Mean per step over n steps: wall s of the slowest rank, CPU s of all ranks' processes, CPU s of
        all ranks' main threads."""
        total = [0.0, 0.0, 0.0]
        for _ in range(n):
            dist.barrier()
            t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
            side.step(x, y)
            t1, c1, h1 = time.perf_counter(), time.process_time(), time.thread_time()
            wall = torch.tensor([t1 - t0], dtype=torch.float64)
            cpu = torch.tensor([c1 - c0, h1 - h0], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
            for k, v in enumerate((float(wall), *cpu.tolist())):
                total[k] += v
        return Timing(total[0] / n, total[1] / n, total[2] / n)

    for case in args.cases:
        build, rows_per_mb, width = (Scale.build, 1, 1) if case.empty else (build_stage, ROWS, WIDTH)
        x, y = data(rows_per_mb * case.m, width)
        sides = {
            "torch": TorchSide(case.schedule, rank, build, case.p, case.m),
            "pipec": PipecSide(case.schedule, rank, build, case.p, case.m, args.transport),
        }
        if case.empty and sides["pipec"].transport != "DistComm":  # the dispatch figure on gloo beside it
            sides["pipec-gloo"] = PipecSide(case.schedule, rank, build, case.p, case.m, "gloo")
        if case.empty:  # the model's own calls alone: what no executor can save
            sides["floor"] = FloorSide(rank, build, case.m, sides["pipec"].program)
        if case.empty and sides["pipec"].transport == "ShmComm":
            # the same transport under the fewest Python calls, and pipec with its readers sleeping at once
            sides["minimal"] = MinimalSide(rank, build, case.m, sides["pipec"].program, x)
            with poll_off():
                sides["pipec-sleep"] = PipecSide(case.schedule, rank, build, case.p, case.m, args.transport)
        # Both start from the same weights and see the same batch: their first step's gradients must agree.
        for side in sides.values():
            side.step(x, y)
        worst, compared = largest_rel_diff(grads_of(sides["pipec"].runner.modules()), grads_of(sides["torch"].modules))
        if "minimal" in sides:  # the minimal loop computes what pipec computes, or its figure means nothing
            off, _ = largest_rel_diff(grads_of(sides["minimal"].modules), grads_of(sides["pipec"].runner.modules()))
            worst = max(worst, off)
        diff, count = torch.tensor([worst], dtype=torch.float64), torch.tensor([compared], dtype=torch.int64)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
        for side in sides.values():
            timed(side, x, y, 2)  # warm-up: first allocations
        rounds = alternate({who: round_of(timed, side, x, y, args.steps) for who, side in sides.items()}, args.rounds)
        rows.append((case, rounds, sides["pipec"].instructions, (float(diff), int(count)), sides["pipec"].transport))
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


def record(case: Case, rounds: dict, instrs: list[int], grad: tuple[float, int], comm: str, args, load_start) -> dict:
    """One JSON line: the side-by-side record, and for the empty model the dispatch figure (with the same
    figures for pipec on gloo, from the same rounds, under `gloo`, when pipec's own transport is another)."""
    grad_diff, grad_tensors = grad
    common = {
        "schedule": case.schedule,
        "p": case.p,
        "m": case.m,
        "backend": "gloo",
        "transport": {"ShmComm": "shm", "DistComm": "gloo"}.get(comm, comm),
        "steps_per_round": args.steps,
        "grad_max_rel_diff": grad_diff,
        "grad_rtol": GRAD_RTOL,
        "grad_tensors_compared": grad_tensors,
    }
    if not case.empty:
        model = f"{BLOCKS} x (Linear({WIDTH}, {WIDTH}) + GELU), float64, {ROWS} rows per micro-batch"
        rec = summarize("runtime_vs_torch", rounds, ("pipec", "torch"), load_start, model=model, **common)
        rec["torch_step_s"], rec["pipec_step_s"] = rec["median_s"]["torch"], rec["median_s"]["pipec"]
        return rec
    rec = summarize(
        "dispatch",
        rounds,
        ("pipec", "torch"),
        load_start,
        model="empty (y = w * x, one scalar per micro-batch)",
        **common,
        instructions_per_rank=instrs,
    )
    rec.update(dispatch_figures(rounds["pipec"], rounds["torch"], instrs))
    rec["dispatch_cpu_us_target"] = 20
    if "pipec-gloo" in rounds:
        rec["gloo"] = dispatch_figures(rounds["pipec-gloo"], rounds["torch"], instrs)
    floor = [1e6 * t.main_cpu / sum(instrs) for t in rounds["floor"]]
    own = [1e6 * t.main_cpu / sum(instrs) - f for t, f in zip(rounds["pipec"], floor)]
    rec["floor_cpu_us"] = round(statistics.median(floor), 2)
    rec["floor_cpu_us_range"] = [round(min(floor), 2), round(max(floor), 2)]
    rec["executor_cpu_us"] = round(statistics.median(own), 2)
    rec["executor_cpu_us_range"] = [round(min(own), 2), round(max(own), 2)]
    if "minimal" in rounds:
        mini = [1e6 * t.main_cpu / sum(instrs) for t in rounds["minimal"]]
        over = [1e6 * t.main_cpu / sum(instrs) - b for t, b in zip(rounds["pipec"], mini)]
        rec["minimal_cpu_us"] = round(statistics.median(mini), 2)
        rec["minimal_cpu_us_range"] = [round(min(mini), 2), round(max(mini), 2)]
        rec["minimal_over_floor_cpu_us"] = round(statistics.median(m - f for m, f in zip(mini, floor)), 2)
        rec["executor_over_minimal_us"] = round(statistics.median(over), 2)
        rec["executor_over_minimal_us_range"] = [round(min(over), 2), round(max(over), 2)]
    if "pipec-sleep" in rounds:  # the poll before sleeping: pipec with it (`pipec`) and without, same rounds
        rec["poll_off"] = dispatch_figures(rounds["pipec-sleep"], rounds["torch"], instrs)
        kept = [a.main_cpu / b.main_cpu for a, b in zip(rounds["pipec"], rounds["pipec-sleep"])]
        rec["poll_main_cpu_saved"] = round(1 - statistics.median(kept), 3)
        walls = [a.wall / b.wall for a, b in zip(rounds["pipec"], rounds["pipec-sleep"])]
        rec["poll_wall_ratio"] = round(statistics.median(walls), 3)
    main_cpu = [t.main_cpu for t in rounds["pipec"]]
    torch_main = [t.main_cpu for t in rounds["torch"]]
    rec["pipec_over_torch_main_cpu_per_step"] = rec["ratio_main_cpu"]  # summarize's ratio_main_cpu, named
    rec["pipec_over_torch_main_cpu_per_step_range"] = rec["ratio_main_cpu_range"]
    rec["pipec_over_torch_main_cpu_per_step_target"] = 0.5
    rec["pipec_main_cpu_per_step_s"] = round(statistics.median(main_cpu), 6)
    rec["torch_main_cpu_per_step_s"] = round(statistics.median(torch_main), 6)
    # the step's wall time over the busiest rank's instructions: mostly waiting for peers, not dispatch
    rec["step_wall_per_instruction_us"] = round(1e6 * rec["median_s"]["pipec"] / max(instrs), 2)
    return rec


def dispatch_figures(pipec: list, torch: list, instrs: list[int]) -> dict:
    """`dispatch_cpu_us` (main-thread CPU per instruction, median over the rounds, its range and every
    round's) and the main-thread CPU per step against torch's (each round's ratio: median and range)."""
    per_instr = [1e6 * t.main_cpu / sum(instrs) for t in pipec]  # per step, summed over ranks, one per round
    ratios = [a.main_cpu / b.main_cpu for a, b in zip(pipec, torch)]
    return {
        "dispatch_cpu_us": round(statistics.median(per_instr), 2),
        "dispatch_cpu_us_range": [round(min(per_instr), 2), round(max(per_instr), 2)],
        "dispatch_cpu_us_rounds": [round(x, 2) for x in per_instr],
        "main_cpu_ratio_rounds_median": round(statistics.median(ratios), 3),
        "main_cpu_ratio_rounds_range": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="ABBA rounds per system (default 5)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round (default 4)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default: all three)")
    ap.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    ap.add_argument("--no-empty", dest="empty", action="store_false", help="skip the empty-model dispatch runs")
    ap.add_argument("--only-dispatch", action="store_true", help="only the empty-model dispatch runs")
    ap.add_argument(
        "--transport",
        choices=("auto", "gloo", "shm"),
        default="auto",
        help="pipec's point-to-point transport, as `pipec run --transport` (default auto: shm on one host); the "
        "dispatch runs add pipec on gloo beside it when it is not gloo",
    )
    smoke_flag(ap)
    args = ap.parse_args()
    dispatch, p_full = DISPATCH, P
    if args.smoke:  # 1F1B, 1 round of 1 step, both models on 2 processes (one spawn): the format (tests)
        args.rounds, args.steps, args.schedules, dispatch, p_full = 1, 1, "1f1b", ((2, 8),), 2
    schedules = [] if args.only_dispatch else [s for s in args.schedules.split(",") if s]
    cases = [Case(s, False, p_full, M) for s in schedules]
    if args.empty or args.only_dispatch:
        cases += [Case("empty:1f1b", True, p, m) for p, m in dispatch]
    runs: dict[int, list[Case]] = {}  # one spawn of p processes runs every case with that p
    for case in cases:
        runs.setdefault(case.p, []).append(case)
    disagree = []
    for world, cases in runs.items():
        args.cases = cases
        load_start = load_average()  # other processes on the machine, before this run adds its own
        rows, codes = run_ranks(worker, world, args)
        for case, rounds, instrs, grad, comm in rows:
            emit(record(case, rounds, instrs, grad, comm, args, load_start))
            if not grad[0] <= GRAD_RTOL or grad[1] == 0:
                disagree.append(f"{case.label} p={case.p}: {grad[0]:.3g}")
        if any(codes):  # after the results were sent: reported, not fatal
            print(f"note: worker exit codes {codes}", file=sys.stderr)
    if disagree:  # the timings mean nothing if the two systems do not compute the same thing
        sys.exit(
            f"error: pipec's and torch's gradients disagree (largest relative difference, float64): "
            f"{'; '.join(disagree)} > {GRAD_RTOL}"
        )


if __name__ == "__main__":
    main()
