"""torchtitan 0.2.2 trains its llama3 debug model on 2 CPU gloo processes with pipec's schedules.

Issue 18, item 5: for each pair (torch's built-in class, pipec's exported CSV of the same
schedule) this runs torchtitan's own ``Trainer`` (its llama3 ``debugmodel`` flavor, its
``pipeline_llm`` -> ``pipeline_module_split`` -> ``build_pipeline_schedule`` path, its AdamW,
warm-up LR schedule and global-norm clipping) for a few steps with the same seed and the same
token batches, and prints the loss and gradient norm of every step as JSON lines, then one
line per pair with the largest difference.

torchtitan is not a dependency of pipec, so it runs in a throwaway virtual environment
(``--setup`` makes a fresh one: torch 2.13.0 CPU, ``torchtitan==0.2.2 --no-deps`` and the
packages it imports). Nothing in torchtitan's files is edited; the worker (this file run with
``--worker`` under that environment's ``torchrun``) patches, before importing torchtitan:

- the device: torchtitan picks ``torch._utils._get_available_device_type() or "cuda"`` at
  import time, so on a CPU machine it would ask for CUDA; the worker makes it ``"cpu"`` and
  gives torchtitan a device module with the few calls ``torch.cpu`` lacks (memory stats,
  device name and properties) and ``current_device() == 0`` (its gloo barrier takes it as a
  device id), so its metrics and process group (gloo) work;
- its MoE triton kernels module (imports ``triton``, which a CPU machine lacks; llama3 has no
  MoE) and ``datasets`` (imported by its HF text dataloader, replaced here) by empty stand-ins;
- the tokenizer and data: the wheel has no ``tests/assets`` (tokenizer, c4_test), so the
  llama3 TrainSpec is registered again (torchtitan's own extension point) with no tokenizer
  and a dataloader of fixed token batches, the same on every rank and in every run.

    python3 benchmarks/torchtitan_train.py --setup            # once: /tmp/tt-venv
    python3 benchmarks/torchtitan_train.py --steps 5          # the three pairs
    python3 benchmarks/torchtitan_train.py --steps 5 --more   # and five pipec-only schedules
    python3 benchmarks/torchtitan_train.py --smoke            # 1F1B, 2 steps: the format
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from sidebyside import emit, smoke_flag  # stdlib only: it imports in the torchtitan environment too

REPO = Path(__file__).resolve().parent.parent

# (case, torch's class, pipec library schedule, its parameters beyond p and m): torch ships the
# same schedule as a class; pipec's CSV runs under that class's placement.
CASES = [
    ("1f1b", "1F1B", "1f1b", []),
    ("interleaved-1f1b", "Interleaved1F1B", "interleaved-1f1b", ["-D", "v=2"]),
    ("zb-v", "ZBVZeroBubble", "zb-v", []),
]
# --more: pipec schedules torch has no class for, against torch's class of the same placement
# (the one `pipec export --to torchtitan` writes): the same sums of gradients in other orders.
MORE = [
    ("gpipe", "1F1B", "gpipe", []),
    ("zb-h1", "1F1B", "zb-h1", []),
    ("looped-bfs", "Interleaved1F1B", "looped-bfs", ["-D", "v=2"]),
    ("v-half", "ZBVZeroBubble", "v-half", []),
    ("dualpipe-v", "DualPipeV", "dualpipe-v", []),
]
# torchtitan settings a case needs on CPU, on both sides. DualPipeV: torchtitan registers its MoE
# expert-overlap callback for OVERLAP_F_B on the DualPipeV class (never on a CSV's runtime), and
# that callback asks for an accelerator stream: "RuntimeError: Accelerator expected" on CPU
# (torchtitan/distributed/dual_pipe_v.py:263). Without it torch runs a pair's F then its B.
CPU_SETTINGS = {"dualpipe-v": ["--parallelism.no_pipeline_parallel_expert_parallel_overlap"]}
PACKAGES = ["torchdata", "tokenizers", "tomli", "fsspec", "tyro", "tensorboard", "einops", "pillow"]


def setup(venv: Path) -> None:
    """A fresh environment: torch pinned to 2.13.0 so no dependency moves it."""
    if venv.exists():
        raise SystemExit(f"{venv} exists: remove it first or pass another --venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    pin = venv / "torch-pin.txt"
    pin.write_text("torch==2.13.0\n")
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "--no-deps", "torchtitan==0.2.2"], check=True)
    subprocess.run([*pip, "-c", str(pin), *PACKAGES], check=True)


# ---------------------------------------------------------------- worker (torchtitan's venv)


def _cpu_device_module():
    """torch.cpu plus the calls torchtitan makes on a CUDA device module (metrics, barrier)."""
    import types

    import torch

    mod = types.ModuleType("torchtitan_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mod.current_device = lambda: 0  # torch.cpu says "cpu"; torchtitan's barrier wants an index
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=total)
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.empty_cache = lambda: None
    mod.memory_stats = lambda device=None: {}
    return mod


def _stub_unused_imports() -> None:
    """MoE triton kernels and datasets (HF text loader): imported at module level, unused here.

    The kernels module is replaced rather than triton itself: torch probes for triton and
    a fake one breaks torch._dynamo.
    """
    import types

    kernels = types.ModuleType("torchtitan.models.moe.kernels")
    kernels.generate_permute_indices = kernels.fill_indices_wrapper = None
    sys.modules["torchtitan.models.moe.kernels"] = kernels
    try:
        import datasets  # noqa: F401
    except ImportError:
        ds = types.ModuleType("datasets")
        ds.Dataset = ds.load_dataset = None
        dist = types.ModuleType("datasets.distributed")
        dist.split_dataset_by_node = None
        ds.distributed = dist
        sys.modules["datasets"] = ds
        sys.modules["datasets.distributed"] = dist


def _import_torchtitan_on_cpu():
    """Import torchtitan with its device switched to CPU; torch's own lookups are restored after."""
    import torch._utils as tu

    _stub_unused_imports()
    saved = tu._get_available_device_type, tu._get_device_module
    cpu = _cpu_device_module()
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda device_type=None: cpu if device_type in (None, "cpu") else saved[1](device_type)
    try:
        import torchtitan.models.llama3 as llama3
        import torchtitan.train as train
        from torchtitan.tools import utils

        assert utils.device_type == "cpu", utils.device_type
    finally:
        tu._get_available_device_type, tu._get_device_module = saved
    return train, llama3


def _fixed_batches(vocab: int, batch: int, seq_len: int, seed: int):
    """A dataloader of learnable token rows (t[k+1] = 5 t[k] + 3 mod vocab, random starts)."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader

    class FixedTokens(BaseDataLoader):
        def __init__(self) -> None:
            self.step = 0

        def __iter__(self):
            while True:
                g = torch.Generator().manual_seed(seed * 1000 + self.step)
                self.step += 1
                start = torch.randint(0, vocab, (batch, 1), generator=g)
                rows = [start]
                for _ in range(seq_len):
                    rows.append((rows[-1] * 5 + 3) % vocab)
                tokens = torch.cat(rows, dim=1)
                yield {"input": tokens[:, :-1]}, tokens[:, 1:]

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, state_dict) -> None:
            self.step = state_dict["step"]

    return FixedTokens()


def worker(out: Path, seed: int, tt_args: list[str]) -> None:
    train, llama3 = _import_torchtitan_on_cpu()
    import dataclasses

    import torch
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import register_train_spec
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = ConfigManager().parse_args(tt_args)
    vocab = llama3.llama3_args[config.model.flavor].vocab_size

    def dataloader(**_: object):
        return _fixed_batches(vocab, config.training.local_batch_size, config.training.seq_len, seed)

    spec = dataclasses.replace(
        llama3.get_train_spec(),
        build_tokenizer_fn=None,
        build_dataloader_fn=dataloader,
        build_validator_fn=None,
    )
    register_train_spec(config.model.name, spec)  # user specs win over torchtitan's own
    trainer = train.Trainer(config)
    rank = torch.distributed.get_rank()
    schedule = trainer.pp_schedule
    stages = schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]
    record = {
        "rank": rank,
        "stages": [s.stage_index for s in stages],
        "schedule_class": type(trainer.pp_schedule).__name__,
        "has_last_stage": trainer.pp_has_last_stage,
        # the compute actions this rank runs; a single-stage class (1F1B) runs its own loop, and
        # the table it shows is not that loop (in torch 2.13 rank 1's is off by one micro-batch)
        "order": None
        if isinstance(schedule, PipelineScheduleSingle)
        else [str(a) for a in schedule.pipeline_order[rank] if a is not None],
        "loss": [],
        "grad_norm": [],
    }
    log = trainer.metrics_processor.log

    def logged(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        record["loss"].append(float(global_avg_loss))
        record["grad_norm"].append(float(grad_norm))
        return log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    trainer.metrics_processor.log = logged
    try:
        trainer.train()
    finally:
        trainer.close()
    (out.parent / f"{out.name}.{rank}.json").write_text(json.dumps(record))
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- driver (any python)


def common_args(args: argparse.Namespace, dump: Path) -> list[str]:
    return [
        "--model.name=llama3",
        "--model.flavor=debugmodel",
        f"--training.steps={args.steps}",
        f"--training.seq_len={args.seq_len}",
        f"--training.local_batch_size={args.m}",
        "--parallelism.pipeline_parallel_degree=2",
        "--parallelism.pipeline_parallel_microbatch_size=1",
        "--lr_scheduler.warmup_steps=2",
        "--metrics.log_freq=1",
        f"--debug.seed={args.seed}",
        "--activation_checkpoint.mode=none",
        f"--job.dump_folder={dump}",
        "--comm.trace_buf_size=0",
        "--comm.init_timeout_seconds=300",
        "--comm.train_timeout_seconds=300",
    ]


def launch(args: argparse.Namespace, work: Path, name: str, tt_args: list[str]) -> dict:
    """torchrun 2 CPU processes; the losses come from the rank that holds the last stage."""
    out = work / name
    cmd = [
        str(args.venv / "bin" / "python"),
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        "--worker",
        f"--out={out}",
        f"--seed={args.seed}",
        "--",
        *tt_args,
    ]
    env = {**os.environ, "LOG_RANK": "0,1", "OMP_NUM_THREADS": "1"}
    began = time.monotonic()
    log = work / f"{name}.log"
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    ranks = [json.loads(p.read_text()) for p in sorted(work.glob(f"{name}.[01].json"))]
    if rc != 0 or len(ranks) != 2:
        tail = log.read_text().splitlines()[-25:]
        raise SystemExit(f"{name}: torchrun exited {rc}; log {log}:\n" + "\n".join(tail))
    last = [r for r in ranks if r["has_last_stage"]]
    assert len(last) == 1, ranks
    return {
        "loss": last[0]["loss"],
        "grad_norm": ranks[0]["grad_norm"],
        "stages": {r["rank"]: r["stages"] for r in ranks},
        "order": {r["rank"]: r["order"] for r in ranks},
        "class": ranks[0]["schedule_class"],
        "seconds": round(time.monotonic() - began, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--venv", type=Path, default=Path("/tmp/tt-venv"))
    ap.add_argument("--setup", action="store_true", help="create --venv fresh and install torchtitan 0.2.2")
    ap.add_argument("--pipec", default=str(REPO / ".venv" / "bin" / "pipec"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--m", type=int, default=4, help="micro-batches (local_batch_size, micro-batch size 1)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--more", action="store_true", help="also the pipec schedules torch has no class for")
    ap.add_argument("--case", action="append", choices=[c[0] for c in CASES + MORE])
    ap.add_argument("--work", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("tt_args", nargs="*", help=argparse.SUPPRESS)
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # 1F1B, 2 steps (needs the --setup environment; not in the test suite's smoke run)
        args.case, args.steps = ["1f1b"], 2
    if args.worker:
        worker(args.out, args.seed, args.tt_args)
        return
    if args.setup:
        setup(args.venv)
        return
    if not (args.venv / "bin" / "python").exists():
        raise SystemExit(f"no torchtitan environment at {args.venv}: run with --setup first")
    work = args.work or Path(tempfile.mkdtemp(prefix="tt-train-"))
    work.mkdir(parents=True, exist_ok=True)
    all_ok = True
    cases = CASES + MORE if args.more or args.case else CASES
    for case, cls, schedule, extra in [c for c in cases if not args.case or c[0] in args.case]:
        files = work / case
        subprocess.run(
            [args.pipec, "export", schedule, "-D", "p=2", "-D", f"m={args.m}", *extra]
            + ["--to", "torchtitan", "-o", str(files), "--json"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        with open(f"{files}.toml", "rb") as f:
            written = tomllib.load(f)["parallelism"]["pipeline_parallel_schedule"]
        if written != cls:
            raise SystemExit(f"{case}: pipec wrote pipeline_parallel_schedule = {written!r}, not {cls!r}")
        base = common_args(args, work / "dump") + CPU_SETTINGS.get(case, [])
        runs = {
            "torch": launch(args, work, f"{case}-torch", [*base, f"--parallelism.pipeline_parallel_schedule={cls}"]),
            "pipec": launch(args, work, f"{case}-pipec", [f"--job.config_file={files}.toml", *base]),
        }
        for who, run in runs.items():
            for step, (loss, norm) in enumerate(zip(run["loss"], run["grad_norm"]), 1):
                emit({"case": case, "schedule": who, "step": step, "loss": loss, "grad_norm": norm})
            emit(
                {
                    "case": case,
                    "schedule": who,
                    "class": run["class"],
                    "stages": run["stages"],
                    "seconds": run["seconds"],
                }
            )
        t, p = runs["torch"], runs["pipec"]
        diff = max(abs(a - b) for a, b in zip(t["loss"] + t["grad_norm"], p["loss"] + p["grad_norm"]))
        rel = max(abs(a - b) / abs(a) for a, b in zip(t["loss"] + t["grad_norm"], p["loss"] + p["grad_norm"]))
        ok = len(t["loss"]) == len(p["loss"]) == args.steps and t["stages"] == p["stages"] and rel <= args.rtol
        all_ok &= ok
        emit(
            {
                "case": case,
                "torch_class": cls,
                "pipec_csv": f"{files}.csv",
                "steps": len(p["loss"]),
                "losses_equal": t["loss"] == p["loss"],
                "max_abs_diff": diff,
                "max_rel_diff": rel,
                "rtol": args.rtol,
                "same_stages": t["stages"] == p["stages"],
                # whether pipec's CSV is torch's own order of actions (null: a single-stage class)
                "same_order": None if None in t["order"].values() else t["order"] == p["order"],
                "ok": ok,
            }
        )
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
