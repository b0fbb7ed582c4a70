"""The CUDA and NCCL paths of the runtime, checked and timed in one go: the prepared script for a lent GPU
machine (this project's `device` tool), where a session has minutes of GPU time, not hours.

    python3 benchmarks/gpu_check.py [--out DIR] [--device cuda]     # --device cpu: a dry run without a GPU
    python3 benchmarks/gpu_check.py --smoke     # the cpu dry run, the local check on 1F1B alone (tests)

1. Every library schedule with p=2 (m=4, v=2 where declared) in `--local` mode on the device, float64
   MLP, 3 steps: the largest relative error of the loss, the gradients and the parameters against the
   single-process reference on the same device (target: at most 1e-10), and the median step time.
2. A one-rank NCCL job through torchrun and `pipec.runtime.job.launch` (GPipe, p=1, --check): NCCL's
   initialisation with `device_id`, the runner on `cuda:LOCAL_RANK`, a clean teardown. One GPU cannot
   hold two NCCL ranks, so point-to-point over NCCL needs a machine with two.
3. `pipec profile --device cuda` of 1F1B (p=2) on the GPT example: the cost file reads back.
4. CUDA graphs (`--cuda-graphs`, pipec.runtime.exec.compiled): 1F1B and ZB-H1 (split backward) at p=2 m=4
   in `--local` mode, float64 MLP, eager against compiled with CUDA graphs (torch.compile mode
   "reduce-overhead"): the largest relative error of both against the reference (target 1e-10 for eager;
   compiled reported, target 1e-9: inductor reorders sums), the CUDA-graph replays counted over the timed
   steps (must be > 0) and inductor's skips, and the step time of each in ABBA rounds (`ratio`: graphs /
   eager). Then the one-rank NCCL job of 2. again with --cuda-graphs (its output's replay line). With
   --device cpu: the refusal alone (StageOptions(cuda_graphs=True) must say it needs CUDA).

One JSON line per check on stdout and in DIR/gpu_check.jsonl; exit status 1 if any check failed. On the
device machine torch is preinstalled but lark is not: carry its wheel (docs/runtime.md, "On a GPU").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sidebyside

ROOT = Path(__file__).resolve().parents[1]
MLP = {"MLP_WIDTH": "64", "MLP_DEPTH": "8", "MLP_BATCH": "32", "MLP_DTYPE": "float64"}
SCHEDULES: list[str] = []  # the library schedules the local check runs (empty: all; --smoke: 1f1b)


def emit(out, **row) -> bool:
    """One line on stdout (`sidebyside.emit`: the shared fields) and the same in DIR/gpu_check.jsonl."""
    rec = sidebyside.emit({"benchmark": "gpu_check", **row})
    out.write(json.dumps(rec) + "\n")
    out.flush()
    return bool(row.get("ok", True))


def local_schedules(device: str, out) -> bool:
    import torch

    from pipec.api import load
    from pipec.frontend import library
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime import LocalPipeline, Reference, StageOptions, load_model
    from pipec.runtime.reference import compare, rel_err

    os.environ.update(MLP)
    model = load_model(str(ROOT / "examples" / "mlp.py"))
    ok = True
    for name in SCHEDULES or library.names():
        params = {"p": 2, "m": 4, **({"v": 2} if "v" in dict(load(name).params) else {})}
        row = {"check": "local", "device": device, "schedule": name, "params": params}
        try:
            program = compile_schedule(load(name, **params)).program
            if program.slicing is not None:  # token slices need a model with a key/value cache: not the MLP
                ok &= emit(out, **row, ok=True, skipped="token slices: the MLP has no key/value cache")
                continue
            kw = dict(optimizer=model.optimizer, dtype=model.dtype, device=torch.device(device))
            pipe = LocalPipeline(program, model.build_stage, model.loss_fn, options=StageOptions(**kw))
            ref = Reference(model.build_stage, model.loss_fn, program.num_stages, program.num_microbatches, **kw)
            worst, times = 0.0, []
            for step in range(3):
                x, y = model.batch(step)
                t0 = time.perf_counter()
                res = pipe.step(x, y)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                ref_loss = ref.step(x, y)
                g = compare(pipe.named_gradients(), ref.named_gradients())
                p = compare(pipe.named_parameters(), ref.named_parameters())
                worst = max(worst, rel_err(res.loss, ref_loss), *g.values(), *p.values())
            row.update(worst_rel_err=worst, median_step_s=statistics.median(times[1:]), ok=worst <= 1e-10)
        except Exception as e:  # noqa: BLE001 - reported, and the other checks still run
            row.update(ok=False, error=f"{type(e).__name__}: {e}")
        ok &= emit(out, **row)
    return ok


def run_cmd(cmd: list[str], env: dict, timeout: float = 300) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    try:
        # not in the checkout: `python -m` puts its folder first on sys.path, and the checkout's pipec/ lacks
        # what an install maps into it (pipec.schedules is the top-level schedules/ folder)
        res = subprocess.run(cmd, cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True, timeout=timeout)
        return res.returncode, (res.stdout + res.stderr)[-3000:], time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout} s: {e}", time.perf_counter() - t0


def one_rank_job(device: str, out) -> bool:
    backend = "nccl" if device == "cuda" else "gloo"
    env = dict(os.environ, **MLP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    mlp = str(ROOT / "examples" / "mlp.py")
    cmd += ["-m", "pipec.runtime.job.launch", "gpipe", "-D", "p=1", "-D", "m=2", "--model", mlp]
    code, text, secs = run_cmd([*cmd, "--backend", backend, "--steps", "3", "--check", "--timeout", "60"], env)
    ok = code == 0 and "OK: largest relative error" in text
    return emit(out, check="one_rank_job", backend=backend, seconds=round(secs, 2), ok=ok, output=text[-1500:])


def profile_gpt(device: str, tmp: str, out) -> bool:
    cost = os.path.join(tmp, "gpt.toml")
    env = dict(os.environ, GPT_DTYPE="float32")
    cmd = [sys.executable, "-m", "pipec.cli.app", "profile", "1f1b", "-D", "p=2", "-D", "m=4"]
    cmd += ["--model", str(ROOT / "examples" / "gpt.py"), "--device", device, "--reps", "5", "-o", cost]
    code, text, secs = run_cmd(cmd, env)
    ok = code == 0 and os.path.isfile(cost)
    if ok:
        from pipec.sim.cost_files import read_cost_file

        doc = read_cost_file(cost)
        ok = len(doc["F"]) == 2 and all(x > 0 for x in doc["F"])
    return emit(out, check="profile_gpt", device=device, seconds=round(secs, 2), ok=ok, output=text[-1500:])


def cuda_graphs(device: str, out) -> bool:
    import torch

    from pipec.api import load
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime import LocalPipeline, Reference, StageOptions, load_model
    from pipec.runtime.errors import PipelineError
    from pipec.runtime.reference import compare

    os.environ.update(MLP)
    model = load_model(str(ROOT / "examples" / "mlp.py"))
    kw = dict(optimizer=model.optimizer, dtype=model.dtype, device=torch.device(device))
    if device != "cuda":  # the dry run: the refusal, in words
        program = compile_schedule(load("1f1b", p=2, m=4)).program
        try:
            LocalPipeline(program, model.build_stage, model.loss_fn, options=StageOptions(**kw, cuda_graphs=True))
            said = None
        except PipelineError as e:
            said = str(e)
        return emit(out, check="cuda_graphs", device=device, refused=said, ok=bool(said) and "need CUDA" in said)
    from pipec.runtime.exec.compiled import replays

    ok = True
    for name in ("1f1b", "zb-h1"):
        row: dict = {"check": "cuda_graphs", "device": device, "schedule": name, "params": {"p": 2, "m": 4}}
        try:
            program = compile_schedule(load(name, p=2, m=4)).program
            pipes = {
                "graphs": LocalPipeline(
                    program, model.build_stage, model.loss_fn, options=StageOptions(**kw, cuda_graphs=True)
                ),
                "eager": LocalPipeline(program, model.build_stage, model.loss_fn, options=StageOptions(**kw)),
            }
            ref = Reference(model.build_stage, model.loss_fn, program.num_stages, program.num_microbatches, **kw)
            x, y = model.batch(0)
            ref.step(x, y)
            errs = {}
            for what, pipe in pipes.items():  # the same weights and batch: the first step's gradients
                pipe.step(x, y)  # the graphs' first step compiles and records them
                errs[what] = max(compare(pipe.named_gradients(), ref.named_gradients()).values(), default=0.0)

            batch = model.batch(1)

            def timed(pipe, batch=batch):
                def go() -> float:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(3):
                        pipe.step(*batch)
                    torch.cuda.synchronize()
                    return (time.perf_counter() - t0) / 3

                return go

            before = replays()
            seconds = sidebyside.alternate({k: timed(p) for k, p in pipes.items()}, rounds=4, warmup=1)
            after = replays()
            rec = sidebyside.summarize("gpu_check", seconds, ("graphs", "eager"))
            row.update(
                grad_rel_err=errs,
                replays=after[0] - before[0],
                inductor_skips=after[1],
                median_step_s=rec["median_s"],
                ratio=rec["ratio"],
                ratio_range=rec.get("ratio_range"),
                ok=errs["eager"] <= 1e-10 and errs["graphs"] <= 1e-9 and after[0] > before[0],
            )
        except Exception as e:  # noqa: BLE001 - reported, and the other checks still run
            row.update(ok=False, error=f"{type(e).__name__}: {e}")
        ok &= emit(out, **row)
    env = dict(os.environ, **MLP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += [
        "-m",
        "pipec.runtime.job.launch",
        "gpipe",
        "-D",
        "p=1",
        "-D",
        "m=2",
        "--model",
        str(ROOT / "examples" / "mlp.py"),
    ]
    code, text, secs = run_cmd([*cmd, "--backend", "nccl", "--steps", "3", "--check", "--cuda-graphs"], env)
    good = code == 0 and "CUDA graphs:" in text
    return emit(out, check="cuda_graphs_job", seconds=round(secs, 2), ok=good, output=text[-1500:]) and ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="pipec-gpu-"))
    ap.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run on a machine without a GPU"
    )
    sidebyside.smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # a dry run on the CPU, the local check on 1F1B alone: the format (tests)
        args.device = "cpu"
        SCHEDULES[:] = ["1f1b"]
    import torch

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.jsonl"), "w") as out:
        cuda = torch.cuda.is_available()
        name = torch.cuda.get_device_name(0) if cuda else None
        ok = emit(
            out, check="environment", torch=torch.__version__, cuda=cuda, gpu=name, ok=cuda or args.device == "cpu"
        )
        if not ok:
            return 1
        with tempfile.TemporaryDirectory() as tmp:
            ok &= local_schedules(args.device, out)
            ok &= one_rank_job(args.device, out)
            ok &= profile_gpt(args.device, tmp, out)
            ok &= cuda_graphs(args.device, out)
        emit(out, check="summary", ok=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
