"""Issue 42's first "Done when" line: both example models of examples/ (the U-Net with long skips, two encoders
fanning into a decoder) on 1F1B, interleaved 1F1B (v=2), ZB-H1 and ZB-V over 4 processes train exactly like the
single-process float64 reference accumulating over the same micro-batches: the loss and every parameter's
gradient at each of 3 steps, every parameter after them, to 1e-10 (relative).

The schedules are the files a user of the examples writes: the library's schedule with the model's `edge` lines
added (examples/unet-zb-h1.pipe, ...; 1F1B is examples/unet.pipe and examples/two_encoders.pipe, the latter a
1F1B over the graph's depth). `test_example_schedules_are_the_library_plus_edges` holds each shipped file to
its library schedule, so they cannot drift apart.

Every cell runs in --local mode by default (cheap); over 4 processes two cells run by default (the U-Net on
1F1B over shared memory, the two encoders on ZB-V over gloo: a remote skip, a fan-in, split backward, two
stages a rank); the whole grid of 8 is behind `-m slow`. Also by default: the U-Net on interleaved 1F1B under
PP x DP 2x2 with FSDP2 (`test_unet_interleaved_fsdp_2x2`) against the reference over the global batch.

    .venv/bin/python -m pytest -q -p no:cacheprovider -m slow -n 0 tests/runtime/test_graph_grid.py
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
from repo import ROOT

torch = pytest.importorskip("torch")

from test_graph_runtime import TOL, model, reference_of, run_checked  # noqa: E402

import pipec  # noqa: E402
from pipec.runtime import LocalPipeline, StageOptions, Transport  # noqa: E402

EXAMPLES = ROOT / "examples"
MODELS = ("unet", "two_encoders")
# schedule -> (its file for a model, its parameters over 4 processes)
SCHEDULES = {
    "1f1b": ("{model}.pipe", dict(p=4, m=4)),
    "interleaved-1f1b": ("{model}-interleaved-1f1b.pipe", dict(p=4, v=2, m=4)),
    "zb-h1": ("{model}-zb-h1.pipe", dict(p=4, m=4)),
    "zb-v": ("{model}-zb-v.pipe", dict(p=4, m=8)),
}
GRID = [(name, sched) for name in MODELS for sched in SCHEDULES]
DEFAULT = {("unet", "1f1b"): "auto", ("two_encoders", "zb-v"): "gloo"}  # the cells run by default, their transport


def schedule_file(name: str, sched: str) -> Path:
    return EXAMPLES / SCHEDULES[sched][0].format(model=name)


def computes(prog) -> list[list[tuple[str, int, int]]]:
    """Each rank's compute instructions, in order."""
    return [[(i.op, i.mb, i.stage) for i in r.instructions() if i.op in ("FWD", "BWD", "WGRAD")] for r in prog.ranks]


# ---- the shipped schedules are the library's plus the model's edges ---------------------------------------------
def _body(text: str) -> str:
    """A schedule file from its `schedule` line on (the leading comment block dropped), its name blanked."""
    body = text[re.search(r"^schedule ", text, re.M).start() :]
    return re.sub(r'^schedule "[^"]+"', 'schedule ""', body, count=1, flags=re.M)


@pytest.mark.parametrize("name, sched", [c for c in GRID if c[1] != "1f1b"], ids=lambda c: str(c))
def test_example_schedules_are_the_library_plus_edges(name, sched):
    """Each examples/<model>-<schedule>.pipe is schedules/<schedule>.pipe with `edge` lines added right after
    its `place` line and nothing else changed, and compiles to the library's rank programs on the model's
    graph (the same instruction streams as the library compiled with those edges: the edges are all that
    differs)."""
    shipped = schedule_file(name, sched).read_text()
    lines = _body(shipped).splitlines()
    edges = [k for k, line in enumerate(lines) if line.lstrip().startswith("edge ")]
    assert edges, "no edge declaration"
    place = next(k for k, line in enumerate(lines) if line.lstrip().startswith("place "))
    assert edges == list(range(place + 1, place + 1 + len(edges))), "the edges follow the placement"
    without = "\n".join(line for k, line in enumerate(lines) if k not in edges) + "\n"
    assert without == _body((ROOT / "schedules" / f"{sched}.pipe").read_text())
    params = SCHEDULES[sched][1]
    prog, lib = pipec.compile(str(schedule_file(name, sched)), **params), pipec.compile(sched, **params)
    assert prog.graph is not None and not prog.graph.is_chain
    assert prog.placement == lib.placement
    assert computes(prog) == computes(lib)


def test_example_graphs_are_the_models():
    """The edges in the shipped files are the models' own: the U-Net's chain plus skips s -> S-1-s, the two
    encoders both into stage 2 and a chain after it, for every schedule's stage count."""
    for sched, (_, params) in SCHEDULES.items():
        u = pipec.compile(str(schedule_file("unet", sched)), **params).graph
        S = u.num_stages
        assert sorted(u.edges) == sorted(
            [(s, s + 1) for s in range(S - 1)] + [(s, S - 1 - s) for s in range(S // 2 - 1)]
        )
        t = pipec.compile(str(schedule_file("two_encoders", sched)), **params).graph
        assert sorted(t.edges) == [(0, 2), (1, 2)] + [(s, s + 1) for s in range(2, S - 1)], sched


# ---- every cell in --local mode -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, sched", GRID, ids=lambda c: str(c))
def test_local_grid(name, sched):
    torch.set_num_threads(1)
    m = model(name)
    prog = pipec.compile(str(schedule_file(name, sched)), **SCHEDULES[sched][1])
    pipe = LocalPipeline(prog, m.build_stage, m.loss_fn, options=StageOptions(optimizer=m.optimizer, dtype=m.dtype))
    worst = run_checked(pipe, reference_of(prog, m), m)
    assert worst["loss"] <= TOL and worst["grad"] <= TOL and worst["param"] <= TOL, worst


# ---- over 4 processes -----------------------------------------------------------------------------------------------
def _rank(case: tuple, rank: int, out: str) -> None:
    """One rank of a 4-process job: the cell's schedule and model through Runner, checked against the reference."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    name, path, params, p2p = case
    m = model(name)
    prog = pipec.compile(path, **params)
    dist.init_process_group("gloo")
    runner = pipec.runtime.Runner(
        prog,
        m.build_stage,
        m.loss_fn,
        options=StageOptions(optimizer=m.optimizer, dtype=m.dtype),
        transport=Transport(timeout=60, p2p=p2p),
    )
    worst = run_checked(runner, reference_of(prog, m), m)
    worst["stages"] = sorted(runner.stages)
    worst["transport"] = type(runner.executor.comm).__name__
    worst["last"] = runner.has_last
    Path(out).write_text(json.dumps(worst))
    dist.destroy_process_group()


def run_cell(name: str, sched: str, p2p: str, tmp_path: Path) -> list[dict]:
    """The cell over 4 processes; asserts every rank's errors within TOL and returns the ranks' results."""
    from runtime_harness import json_ranks

    params = SCHEDULES[sched][1]
    case = (name, str(schedule_file(name, sched)), params, p2p)
    res = json_ranks(functools.partial(_rank, case), 4, tmp_path, timeout=240.0)
    stages = pipec.compile(case[1], **params).num_stages
    assert sorted(s for r in res for s in r["stages"]) == list(range(stages))
    want = {"auto": "ShmComm", "gloo": "DistComm"}[p2p]
    assert {r["transport"] for r in res} == {want}
    for r in res:
        assert r["grad"] <= TOL and r["param"] <= TOL, r
    (last,) = [r for r in res if r["last"]]
    assert last["loss"] <= TOL, last
    print(
        f"{name} {sched}: max rel err loss {last['loss']:.1e} grad {max(r['grad'] for r in res):.1e} "
        f"param {max(r['param'] for r in res):.1e}"
    )
    return res


@pytest.mark.parametrize(
    "name, sched",
    [c if c in DEFAULT else pytest.param(*c, marks=pytest.mark.slow) for c in GRID],
    ids=lambda c: str(c),
)  # slow cells' default twins: the same cell in test_local_grid, and the DEFAULT cells over 4 processes
def test_four_processes(name, sched, tmp_path):
    run_cell(name, sched, DEFAULT.get((name, sched), "gloo"), tmp_path)


# ---- PP x DP: 2 pipeline ranks x 2 FSDP2 replicas -------------------------------------------------------------------
def _fsdp_rank(case: tuple, rank: int, out: str) -> None:
    """One of 4 processes on a ("pp", "dp") = (2, 2) mesh: the Program compiled with fsdp data parallelism
    (UNSHARD/RESHARD windows, REDUCE_GRAD's reduce-scatter), checked against the reference over the whole
    global batch (both replicas' micro-batches)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipec.ir.dataparallel import DataParallel

    torch.set_num_threads(1)
    name, path, params = case
    m = model(name)
    prog = pipec.compile(path, **params, data_parallel=DataParallel(2, "fsdp"))
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    kw = dict(optimizer=m.optimizer, dtype=m.dtype)
    runner = pipec.runtime.Runner(
        prog, m.build_stage, m.loss_fn, options=StageOptions(**kw), transport=Transport(timeout=60, mesh=mesh)
    )
    ref = pipec.runtime.Reference(
        m.build_stage, m.loss_fn, prog.num_stages, prog.num_microbatches, replicas=2, graph=prog.graph, **kw
    )
    worst = run_checked(runner, ref, m)
    worst["stages"] = sorted(runner.stages)
    worst["pp"], worst["dp"] = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    worst["last"] = runner.has_last
    # every parameter is split on dim 0 over the 2 replicas (FSDP2's Shard(0)), but those of 1 row (the head)
    worst["sharded"] = all(
        p.to_local().numel() < p.numel()
        for st in runner.stages.values()
        for p in st.module.parameters()
        if p.shape[0] > 1
    )
    worst["unshards"] = sum(i.op == "UNSHARD" for i in prog.ranks[worst["pp"]].instructions())
    Path(out).write_text(json.dumps(worst))
    dist.destroy_process_group()


def test_unet_interleaved_fsdp_2x2(tmp_path):
    """The U-Net on interleaved 1F1B (p=2, v=2: stages 0 and 2 on pipeline rank 0, 1 and 3 on rank 1, the
    skip 0 -> 3 between the ranks) x 2 FSDP2 replicas: every parameter sharded over the replicas, each
    replica on its half of the batch, equal to the single-process reference over the global batch.
    The CLI's form: pipec run examples/unet-interleaved-1f1b.pipe -D p=2 -D v=2 -D m=4 --model
    examples/unet.py --nproc 4 --dp 2 --dp-kind fsdp --check"""
    from runtime_harness import json_ranks

    params = dict(p=2, v=2, m=4)
    case = ("unet", str(schedule_file("unet", "interleaved-1f1b")), params)
    res = json_ranks(functools.partial(_fsdp_rank, case), 4, tmp_path, timeout=240.0)
    assert sorted((r["pp"], r["dp"]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["pp"]: tuple(r["stages"]) for r in res} == {0: (0, 2), 1: (1, 3)}
    assert all(r["sharded"] and r["unshards"] > 0 for r in res), [(r["sharded"], r["unshards"]) for r in res]
    for r in res:
        assert r["grad"] <= TOL and r["param"] <= TOL, r
    last = [r for r in res if r["last"]]
    assert len(last) == 2 and all(r["loss"] <= TOL for r in last), last
    print(
        f"unet interleaved fsdp 2x2: max rel err loss {max(r['loss'] for r in last):.1e} "
        f"grad {max(r['grad'] for r in res):.1e} param {max(r['param'] for r in res):.1e}"
    )
