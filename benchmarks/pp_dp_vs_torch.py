"""pipec PP x DP against torch.distributed.pipelining composed with FSDP2, on the same model, in one run.

    .venv/bin/python benchmarks/pp_dp_vs_torch.py [--rounds 5] [--steps 3] [--schedules 1f1b,interleaved-1f1b,zb-v]
                                                  [--kinds ddp,fsdp] [--rows 32]
    .venv/bin/python benchmarks/pp_dp_vs_torch.py --smoke    # 1F1B ddp, 1 round of 1 step (tests)

A 2 x 2 mesh on gloo: 4 processes, `init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))`, global
rank g at (pp, dp) = divmod(g, 2) (pipec.runtime.exec.replicas's layout). The model: 16 blocks of
Linear(256, 256) + GELU in float64 (benchmarks/runtime_vs_torch.py's), split evenly over the stages (2
stages of 8 blocks for 1F1B; 4 stages of 4 blocks for interleaved 1F1B with v=2 and for ZB-V), the MSE
loss against a fixed target, SGD. Each replica trains on its half of the global batch (rows split as
`pipec.runtime.exec.replicas.slice_replica` splits them), m=8 micro-batches of `--rows` rows each.

Both sides use the same FSDP2 machinery on the "dp" sub-mesh, wrapped the same way:
- ddp: `replicate` (torch.distributed._composable.replicate_with_fsdp), gradients all-reduced once per step;
- fsdp: `fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)` per stage, parameters gathered
  once per step and gradients reduce-scattered once per step (torchtitan's setting under PP: resharding
  after every forward would all-gather every stage twice per micro-batch).
torch: `PipelineStage` on the "pp" group and `Schedule1F1B`, `ScheduleInterleaved1F1B` or
`ScheduleZBVZeroBubble` (its `perform_reduce_grad` runs the post-backward reductions); pipec: the Program
compiled with `DataParallel(2, kind)` (REDUCE_GRAD after each stage's last backward; for fsdp UNSHARD /
RESHARD windows) run by `Runner(transport=Transport(mesh=...))`, as `pipec run --dp 2 --dp-kind KIND` runs it.

Before timing, each side runs one step from the same weights on the same batch, and their gathered
gradients are compared in float64 (largest relative difference per tensor, `grad_max_rel_diff`; the
script fails above 1e-9): the two sides do the same work. Then two warm-up steps each, and `--rounds`
rounds in ABBA order (`sidebyside.alternate`: pipec torch, torch pipec, ...) of `--steps` steps. A step's
time is the slowest of the 4 processes, between barriers; a round's figure is its mean per step. One JSON
line per schedule x kind (`sidebyside.summarize`: `rounds` counts rounds; the medians over the rounds and
every round's figure, `ratio` = pipec / torch (goal <= 1.0) with its spread over the rounds (`ratio_range`,
`ratio_iqr`, `ratio_rounds`), the load average at start and end), plus the same for the CPU seconds per
step of all 4 processes (`ratio_cpu`) and of their main threads (`ratio_main_cpu`), which other load on the
machine disturbs less than wall time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from runtime_vs_torch import WIDTH, build_stage, data, largest_rel_diff, loss_fn, run_ranks  # the same model and data
from sidebyside import Timing, alternate, emit, load_average, smoke_flag, summarize

P, DP, M = 2, 2, 8
SCHEDULES = {  # pipec library name -> (torch class name, stages, placement)
    "1f1b": ("Schedule1F1B", P, lambda s: s),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2 * P, lambda s: s % P),
    "zb-v": ("ScheduleZBVZeroBubble", 2 * P, lambda s: s if s < P else 2 * P - 1 - s),
}
GRAD_RTOL = 1e-9  # float64: both sides sum the same micro-batch gradients, in orders that may differ


def build_seeded(stage: int, num_stages: int):
    """The same weights in both systems and every replica: seeded by the stage."""
    import torch

    torch.manual_seed(1000 + stage)
    return build_stage(stage, num_stages)


def dp_wrap(module, kind: str, dp_mesh):
    """FSDP2 on the "dp" mesh, as pipec.runtime.exec.replicas.wrap does it (so the comparison is of the
    pipelines, not of two data-parallel libraries)."""
    from torch.distributed.fsdp import fully_shard

    if kind == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(module, mesh=dp_mesh)
    else:
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
    return module


class TorchSide:
    def __init__(self, name: str, kind: str, mesh) -> None:
        import torch
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining.stage import PipelineStage

        cls_name, S, place = SCHEDULES[name]
        pp = mesh["pp"].get_local_rank()
        self.mine = [s for s in range(S) if place(s) == pp]
        self.modules = {s: dp_wrap(build_seeded(s, S).double(), kind, mesh["dp"]) for s in self.mine}
        group = mesh["pp"].get_group()
        stages = [PipelineStage(self.modules[s], s, S, torch.device("cpu"), group=group) for s in self.mine]
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

    def gradients(self) -> dict:
        from pipec.runtime.exec.replicas import named_full

        return named_full([((s, n), p.grad) for s, mod in self.modules.items() for n, p in mod.named_parameters()])


class PipecSide:
    def __init__(self, name: str, kind: str, mesh) -> None:
        import torch

        from pipec.api import compile as compile_program
        from pipec.ir.dataparallel import DataParallel
        from pipec.runtime import Runner, StageOptions, Transport

        params = {"p": P, "m": M, **({"v": 2} if name == "interleaved-1f1b" else {})}
        self.program = compile_program(name, params, data_parallel=DataParallel(DP, kind))
        self.runner = Runner(
            self.program,
            build_seeded,
            loss_fn,
            options=StageOptions(optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3), dtype=torch.float64, seed=None),
            transport=Transport(mesh=mesh),
        )

    def step(self, x, y) -> None:
        self.runner.step(x, y)

    def gradients(self) -> dict:
        return self.runner.named_gradients()


def round_of(timed, side, who: str, steps: int):
    """One round of a system: `steps` timed steps (its mean per step, a `Timing`)."""
    return lambda: timed(side, who, steps)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")  # the store is the parent's
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import torch.distributed.nn.functional  # noqa: F401 - before the group (see runtime/job/launch.py, Worker._teardown)
    from torch.distributed.device_mesh import init_device_mesh

    from pipec.runtime.exec.replicas import slice_replica

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (P, DP), mesh_dim_names=("pp", "dp"))
    d = mesh["dp"].get_local_rank()
    x, y = data(DP * M * args.rows, WIDTH)
    x_mine, y_mine = slice_replica(x, DP, d, "inputs"), slice_replica(y, DP, d, "targets")
    rows = []

    def timed(side, who: str, n: int) -> Timing:
        """Mean per step over n steps: wall s of the slowest process, CPU s of all processes and of all
        processes' main threads."""
        total = [0.0, 0.0, 0.0]
        for _ in range(n):
            dist.barrier()
            t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
            if who == "pipec":
                side.step(x, y)  # the global batch: the Runner takes this replica's rows
            else:
                side.step(x_mine, y_mine)
            t1, c1, h1 = time.perf_counter(), time.process_time(), time.thread_time()
            wall = torch.tensor([t1 - t0], dtype=torch.float64)
            cpu = torch.tensor([c1 - c0, h1 - h0], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
            for k, v in enumerate((float(wall), *cpu.tolist())):
                total[k] += v
        return Timing(total[0] / n, total[1] / n, total[2] / n)

    for name in args.schedules:
        for kind in args.kinds:
            sides = {"pipec": PipecSide(name, kind, mesh), "torch": TorchSide(name, kind, mesh)}
            for who, side in sides.items():  # the first step, from the same weights on the same batch
                timed(side, who, 1)
            worst, compared = largest_rel_diff(sides["pipec"].gradients(), sides["torch"].gradients())
            diff, count = torch.tensor([worst], dtype=torch.float64), torch.tensor([compared], dtype=torch.int64)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            dist.all_reduce(count, op=dist.ReduceOp.SUM)
            for who, side in sides.items():
                timed(side, who, 2)  # warm-up
            rounds = alternate(
                {who: round_of(timed, side, who, args.steps) for who, side in sides.items()}, args.rounds
            )
            rows.append((name, kind, rounds, float(diff), int(count)))
            del sides
            dist.barrier()
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="ABBA rounds per system (default 5)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round (default 3)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default: all three)")
    ap.add_argument("--kinds", default="ddp,fsdp", help="comma-separated dp kinds (default ddp,fsdp)")
    ap.add_argument("--rows", type=int, default=32, help="rows per micro-batch (default 32)")
    ap.add_argument("--timeout", type=float, default=3600, help="give up after this many seconds")
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # 1F1B with ddp, 1 round of 1 step, 4 rows per micro-batch: the format (tests)
        args.rounds, args.steps, args.schedules, args.kinds, args.rows = 1, 1, "1f1b", "ddp", 4
    args.schedules = [s for s in args.schedules.split(",") if s]
    args.kinds = [k for k in args.kinds.split(",") if k]
    load_start = load_average()  # other processes on the machine, before this run adds its own
    rows, codes = run_ranks(worker, P * DP, args)
    disagree = []
    for name, kind, rounds, grad_diff, grad_tensors in rows:
        rec = summarize(
            "pp_dp_vs_torch",
            rounds,
            ratio=("pipec", "torch"),
            load_start=load_start,
            schedule=name,
            dp_kind=kind,
            mesh=f"{P} x {DP} (pp, dp)",
            m=M,
            rows_per_microbatch=args.rows,
            model="16 x (Linear(256, 256) + GELU), float64, SGD",
            backend="gloo",
            steps_per_round=args.steps,
            grad_max_rel_diff=grad_diff,
            grad_rtol=GRAD_RTOL,
            grad_tensors_compared=grad_tensors,
        )
        rec["target_ratio"] = 1.0
        emit(rec)
        if not grad_diff <= GRAD_RTOL or grad_tensors == 0:
            disagree.append(f"{name} {kind}: {grad_diff:.3g}")
    if any(codes):  # after the results were sent: reported, not fatal
        print(f"note: worker exit codes {codes}", file=sys.stderr)
    if disagree:  # the timings mean nothing if the two systems do not compute the same thing
        sys.exit(f"error: pipec's and torch's gradients disagree (float64): {'; '.join(disagree)} > {GRAD_RTOL}")


if __name__ == "__main__":
    main()
