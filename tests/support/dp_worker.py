"""A multi-process worker for tests/runtime/test_dp_runtime.py: pipelines x data-parallel replicas on gloo.

Each config is NAME:k=v,...:KIND[:OPT,OPT...]: the schedule compiled with the lowering's data parallelism
(pipec.ir.dataparallel.DataParallel: REDUCE_GRAD after each stage's last compute, fsdp windows), options
`g1` (max_gathered=1: Belady windows, stages gathered and freed several times a step) and `p0` (no
prefetch); or with `hand`, today's lowering (REDUCE_GRAD and STEP at the tail) with `dp` and `dp_kind`
set and, for fsdp, UNSHARD/RESHARD windows inserted by `with_windows` (around each run of a stage's
computes, the UNSHARD one window early: gathered and freed between F and B and between B and W).
`block` shards per block; `pair` passes the mesh's two sub-meshes to the Runner instead of the 2-D
mesh. Per config it writes the relative errors against the single-process float64 reference over the
whole global batch: the loss and gradients of every step and the parameters after the last.

    main([OUT_DIR, STEPS, DP, CONFIG, ...])   (in a forked rank, tests/support/runtime_harness.py)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from datetime import timedelta

from repo import ROOT


def with_windows(prog):
    """UNSHARD s / RESHARD s around every maximal run of stage s's computes on each rank (transfers may sit
    inside a run); each UNSHARD is placed right after the previous run's last compute (a prefetch of one
    window), each RESHARD right after its run's last compute."""
    from pipec.ir.opcodes import IS_COMPUTE
    from pipec.ir.program import Instr, RankProgram

    ranks = []
    for rp in prog.ranks:
        ins = rp.instructions()
        runs = []  # (stage, first compute index, last compute index)
        for j, i in enumerate(ins):
            if IS_COMPUTE[rp.op[j]]:
                if runs and runs[-1][0] == i.stage:
                    runs[-1][2] = j
                else:
                    runs.append([i.stage, j, j])
        before: dict[int, list[Instr]] = {}
        after: dict[int, list[Instr]] = {}
        for k, (s, a, b) in enumerate(runs):
            at = runs[k - 1][2] if k else -1  # after the previous run, or at the start
            (after.setdefault(at, []) if at >= 0 else before.setdefault(a, [])).append(Instr("UNSHARD", -1, s, -1))
            after.setdefault(b, []).append(Instr("RESHARD", -1, s, -1))
        out = []
        for j, i in enumerate(ins):
            out += before.get(j, [])
            out.append(i)
            # RESHARD of the run that ends here before the next run's UNSHARD
            out += sorted(after.get(j, []), key=lambda x: x.op != "RESHARD")
        ranks.append(RankProgram.from_instructions(out))
    return dataclasses.replace(prog, ranks=tuple(ranks))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out_dir, steps, dp, configs = argv[0], int(argv[1]), int(argv[2]), argv[3:]
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    from pipec.api import load
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime import Reference, Runner, StageOptions, Transport, load_model
    from pipec.runtime.reference import compare, rel_err

    model = load_model(str(ROOT / "examples" / "mlp.py"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = bad_inputs(model, dp) if configs == ["BAD"] else {}
    for spec in configs if configs != ["BAD"] else []:
        name, kv, kind, *rest = spec.split(":")
        opts = set(rest[0].split(",")) if rest else set()
        unit = "block" if "block" in opts else "stage"
        how = "pair" if "pair" in opts else "2d"
        params = {k: int(v) for k, v in (item.split("=") for item in kv.split(","))}
        if "hand" in opts:  # today's lowering (collectives at the tail), windows inserted here
            prog = compile_schedule(load(name, **params)).program
            prog = dataclasses.replace(prog, dp=dp, dp_kind=kind)
            if kind == "fsdp":
                prog = with_windows(prog)
        else:  # the lowering's placement (pipec.ir.dataparallel): g1 = at most one stage gathered, p0 = no prefetch
            from pipec.ir.dataparallel import DataParallel

            opt = DataParallel(dp, kind, 0 if "p0" in opts else 1, 1 if "g1" in opts else None)
            prog = compile_schedule(load(name, **params), None, opt).program
        res_prog = {"unshards": sum(i.op == "UNSHARD" for r in prog.ranks for i in r.instructions())}
        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
        arg = mesh if how == "2d" else (mesh["pp"], mesh["dp"])
        kw = dict(optimizer=model.optimizer, dtype=model.dtype)
        t0 = time.perf_counter()
        transport = Transport(timeout=30, mesh=arg, dp_unit=unit)
        runner = Runner(prog, model.build_stage, model.loss_fn, options=StageOptions(**kw), transport=transport)
        ref = Reference(model.build_stage, model.loss_fn, prog.num_stages, prog.num_microbatches, replicas=dp, **kw)
        res: dict[str, object] = {"stages": sorted(runner.stages), "pp": mesh.get_local_rank("pp"), **res_prog}
        res["dp"] = mesh.get_local_rank("dp")
        res["loss_err"], res["grad_err"], res["grads"] = [], [], 0
        res["sharded"] = any(
            p.to_local().numel() < p.numel() for p in runner.stages[min(runner.stages)].module.parameters()
        )
        for step in range(steps):
            x, y = model.batch(step)
            if step == 1 and runner.last_specs is not None:  # the rows of this replica's micro-batches
                res["mb_rows"] = [spec[0].shape[0] for spec in runner.last_specs]
            out = runner.step(x, y)
            ref_loss = ref.step(x, y)
            res["loss_err"].append(rel_err(out.loss, ref_loss) if out.loss is not None else None)
            grads = compare(runner.named_gradients(), ref.named_gradients())
            res["grad_err"].append(max(grads.values()))
            res["grads"] = len(grads)
        res["param_err"] = max(compare(runner.named_parameters(), ref.named_parameters()).values())
        res["seconds"] = time.perf_counter() - t0
        results[spec] = res
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def bad_inputs(model, dp: int) -> dict[str, str]:
    """On a (1, dp) mesh: each bad input's message from the Runner's constructor (before any step), or
    "no error"."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from pipec.api import load
    from pipec.ir.program import Instr, RankProgram
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime import PipelineError, Runner, StageOptions, Transport

    mesh = init_device_mesh("cpu", (1, dp), mesh_dim_names=("pp", "dp"))
    shared = torch.nn.Linear(8, 8)

    def tied_stages(stage: int, num_stages: int) -> torch.nn.Module:  # the same Linear in both stages
        return torch.nn.Sequential(shared, torch.nn.Linear(8, 8 if stage < num_stages - 1 else 1))

    def tied_blocks(stage: int, num_stages: int) -> torch.nn.Module:  # one Linear twice in a stage
        inner = torch.nn.Linear(8, 8)
        return torch.nn.Sequential(inner, torch.nn.Sequential(inner), torch.nn.Linear(8, 1))

    def prog(name: str, kind: str, d: int = dp, **params):
        return dataclasses.replace(compile_schedule(load(name, **params)).program, dp=d, dp_kind=kind)

    ddp = prog("1f1b", "ddp", p=1, m=2)
    unshard = RankProgram.from_instructions([Instr("UNSHARD", -1, 0, -1), *ddp.ranks[0].instructions()])
    cases = {
        "tied_stages": (prog("zb-v", "fsdp", p=1, m=2), tied_stages, "stage"),
        "tied_blocks": (prog("1f1b", "fsdp", p=1, m=2), tied_blocks, "block"),
        "dp_mismatch": (prog("1f1b", "ddp", d=2 * dp, p=1, m=2), model.build_stage, "stage"),
        "pp_mismatch": (prog("1f1b", "ddp", p=2, m=2), model.build_stage, "stage"),
        "unshard_in_ddp": (dataclasses.replace(ddp, ranks=(unshard,)), model.build_stage, "stage"),
    }
    out = {}
    for name, (program, build, unit) in cases.items():
        try:
            Runner(
                program,
                build,
                model.loss_fn,
                options=StageOptions(dtype=torch.float64),
                transport=Transport(mesh=mesh, dp_unit=unit),
            )
            out[name] = "no error"
        except PipelineError as e:
            out[name] = str(e)
    return out


def rank_main(argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """A forked rank (tests/support/runtime_harness.py's fork server): environment, output files, then main."""
    os.environ.update(env)
    os.chdir(ROOT)
    fo, fe = os.open(out, os.O_WRONLY | os.O_CREAT), os.open(err, os.O_WRONLY | os.O_CREAT)
    os.dup2(fo, 1)
    os.dup2(fe, 2)
    code = 1
    try:
        main(argv)
        code = 0
    except BaseException:  # noqa: BLE001 - the test reads the traceback from the rank's stderr
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
