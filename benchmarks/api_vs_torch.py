"""pipec's torch-native schedule API against torch's schedule classes, same transformer, same split, one run.

    .venv/bin/python benchmarks/api_vs_torch.py [--nproc 4] [--rounds 5] [--steps 3] [--schedules 1f1b,zb-v]

The model: a GPT-2 from `transformers.GPT2Config` (random init, float64, no dropout; GPT_LAYERS 8 blocks of
width 64, 4 heads, context 32, byte vocabulary; the head untied from the embedding, since torch's schedules
have no way to sum a tied weight's gradients across ranks), split by `propose_split` into the schedule's stages (p for
1F1B; 2p for interleaved 1F1B with v=2 and for ZB-V) and wrapped the same way for every system:
`split_model`'s StageModules, each system with its own copy of the weights (seed 0). Three systems per
schedule, on the same gloo processes:

- pipec: `PipelineSchedule(program, stages, loss_fn)`, its `step(x, target=y, losses=[])`;
- torch: `Schedule1F1B` / `ScheduleInterleaved1F1B` / `ScheduleZBVZeroBubble` over torch `PipelineStage`s;
- torch_csv: torch's `_PipelineScheduleRuntime` fed pipec's compute-only CSV of the same schedule
  (`pipec.formats.torch_csv_writer.export_csv`), when torch loads it.

A step is a training loop's: `zero_grad`, the schedule's step, SGD's step (the user's optimizer in all three).
Before timing, one step of each from the same weights on the same batch, and their gradients compared by
parameter name (float64; `grad_max_rel_diff` in every line; the script exits with an error above 1e-9).
Then rounds alternate between the systems (`sidebyside.alternate`), `--steps` timed steps per round, each
step's time the slowest rank's between two barriers, and the median is reported: one JSON line per schedule
with `ratio` = pipec / torch (target <= 1.0; `ratio_per_round`, each round's, shows how much the load moved
it), `ratio_csv` = pipec / torch_csv, `cpu_ratio` = the same for the CPU seconds of all ranks' processes per
step (what each system computes and dispatches, which other load disturbs less than wall time), and the
load average before and after. The process spawning is
runtime_vs_torch.py's `run_ranks`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from runtime_vs_torch import largest_rel_diff, run_ranks
from sidebyside import alternate, emit, load_average

M, ROWS, CONTEXT = 8, 2, 32
LAYERS, WIDTH = int(os.environ.get("GPT_LAYERS", "8")), int(os.environ.get("GPT_WIDTH", "64"))
TORCH_CLASS = {"1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B", "zb-v": "ScheduleZBVZeroBubble"}
GRAD_RTOL = 1e-9


def build_model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=WIDTH, n_layer=LAYERS, n_head=4, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     tie_word_embeddings=False)  # fmt: skip
    return GPT2LMHeadModel(cfg).double()


def loss_fn(logits, target):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def params_of(name: str, p: int) -> dict:
    return {"p": p, "m": M, **({"v": 2} if name == "interleaved-1f1b" else {})}


class System:
    """One system's stages on this rank, its optimizer, and a step."""

    def __init__(self, who: str, name: str, rank: int, world: int, csv_dir: str) -> None:
        import torch

        import pipec
        from pipec.runtime import PipelineSchedule, propose_split, stage_indices
        from pipec.runtime.model.split import split_model

        program = pipec.compile(name, **params_of(name, world))
        S = program.num_stages
        mine = stage_indices(program, rank)
        model = build_model()
        stages = split_model(model, propose_split(model, S), only=mine)
        self.modules = {s: stages[s] for s in mine}
        self.first, self.last = 0 in mine, S - 1 in mine
        if who == "pipec":
            self.schedule = PipelineSchedule(program, stages, loss_fn)
        else:
            from torch.distributed.pipelining import schedules
            from torch.distributed.pipelining.stage import PipelineStage

            pstages = [PipelineStage(self.modules[s], s, S, torch.device("cpu")) for s in mine]
            if who == "torch":
                cls = getattr(schedules, TORCH_CLASS[name])
                self.schedule = cls(pstages[0] if cls is schedules.Schedule1F1B else pstages, M, loss_fn=loss_fn)
            else:
                self.schedule = schedules._PipelineScheduleRuntime(pstages, M, loss_fn=loss_fn)
                self.schedule._load_csv(os.path.join(csv_dir, f"{name}.csv"), format="compute_only")
        self.who = who
        params = {id(p): p for mod in self.modules.values() for p in mod.parameters()}
        self.opt = torch.optim.SGD(list(params.values()), lr=1e-3)

    def step(self, x, y) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.who == "pipec":
            self.schedule.step(x, target=y, losses=[])
        else:
            kw = {"target": y, "losses": []} if self.last else {}
            self.schedule.step(*((x,) if self.first else ()), **kw)
        self.opt.step()

    def grads(self) -> dict:
        return {n: p.grad for mod in self.modules.values() for n, p in mod.named_parameters()}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401  (before the group: docs/runtime.md says why)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (M * ROWS, CONTEXT), generator=g)
    y = torch.randint(0, 256, (M * ROWS, CONTEXT), generator=g)

    def timed(side: System, n: int) -> list[tuple[float, float]]:
        """(wall s of the slowest rank, CPU s of all ranks' processes) per step."""
        times = []
        for _ in range(n):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            side.step(x, y)
            wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu)
            times.append((float(wall), float(cpu)))
        return times

    rows = []
    for name in args.schedules:
        sides = {"torch": System("torch", name, rank, world, args.csv_dir)}
        sides["pipec"] = System("pipec", name, rank, world, args.csv_dir)
        csv_note = None
        try:
            sides["torch_csv"] = System("torch_csv", name, rank, world, args.csv_dir)
        except Exception as e:  # torch cannot load this CSV: said in the line, not fatal
            csv_note = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        for side in sides.values():
            side.step(x, y)
        diffs = {}
        for who, side in sides.items():
            if who != "torch":
                worst, _ = largest_rel_diff(side.grads(), sides["torch"].grads())
                t = torch.tensor([worst], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                diffs[who] = float(t[0])
        for side in sides.values():
            timed(side, 1)  # warm-up
        times: dict[str, list[tuple[float, float]]] = {who: [] for who in sides}

        def run(who: str, sides: dict = sides, times: dict = times):
            def one_round() -> float:
                steps = timed(sides[who], args.steps)
                times[who] += steps
                return sum(t[0] for t in steps)

            return one_round

        rounds = alternate({who: run(who) for who in sides}, args.rounds)
        rows.append((name, times, diffs, csv_note, rounds))
        del sides
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def write_csvs(folder: str, names: list[str], p: int) -> None:
    import pipec
    from pipec.formats.torch_csv_writer import export_csv

    for name in names:
        with open(os.path.join(folder, f"{name}.csv"), "w") as f:
            f.write(export_csv(pipec.load(name, **params_of(name, p))))


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4, help="gloo processes (default 4; 2 on a loaded machine)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per system (default 5)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round (default 3)")
    ap.add_argument("--schedules", default=",".join(TORCH_CLASS), help="comma-separated (default: all three)")
    ap.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    args = ap.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("this benchmark needs transformers (.venv/bin/pip install transformers; it installs no torch)")
    args.schedules = [s for s in args.schedules.split(",") if s]
    args.csv_dir = tempfile.mkdtemp(prefix="pipec-api-bench-")
    write_csvs(args.csv_dir, args.schedules, args.nproc)
    load_before = load_average()[0]
    rows, codes = run_ranks(worker, args.nproc, args)
    bad = []
    for name, times, diffs, csv_note, rounds in rows:
        med = {who: statistics.median(t[0] for t in ts) for who, ts in times.items()}
        cpu = {who: statistics.median(t[1] for t in ts) for who, ts in times.items()}
        line = {
            "benchmark": "api_vs_torch",
            "schedule": name,
            "torch_class": TORCH_CLASS[name],
            "model": f"GPT-2 (transformers) {LAYERS} blocks, width {WIDTH}, context {CONTEXT}, float64",
            "p": args.nproc,
            "m": M,
            "rows_per_microbatch": ROWS,
            "backend": "gloo",
            "steps": len(times["pipec"]),
            "median_step_s": {who: round(v, 6) for who, v in med.items()},
            "ratio": round(med["pipec"] / med["torch"], 4),
            "median_cpu_s": {who: round(v, 6) for who, v in cpu.items()},
            "cpu_ratio": round(cpu["pipec"] / cpu["torch"], 4),
            "ratio_per_round": [round(a / b, 4) for a, b in zip(rounds["pipec"], rounds["torch"])],
            "grad_max_rel_diff": diffs,
            "grad_rtol": GRAD_RTOL,
            "loadavg_1min_before": round(load_before, 2),
            "loadavg_1min_after": load_average()[0],
        }
        if "torch_csv" in med:
            line["ratio_csv"] = round(med["pipec"] / med["torch_csv"], 4)
        if csv_note:
            line["torch_csv_refused"] = csv_note
        emit(line)
        bad += [f"{name} {who}: {d:.3g}" for who, d in diffs.items() if not d <= GRAD_RTOL]
    if any(codes):
        print(f"note: worker exit codes {codes}", file=sys.stderr)
    if bad:
        sys.exit(f"error: the systems' gradients disagree (float64): {'; '.join(bad)} > {GRAD_RTOL}")


if __name__ == "__main__":
    main()
