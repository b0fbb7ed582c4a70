"""Interop with torch.distributed.pipelining (torch 2.13) and torchtitan: the schedule CSV both ways.

(1) round trip: export then import gives the same per-rank orders, for every library schedule over a
small grid, in both CSV formats and through the generated `.pipe`; (2) torch loads what pipec writes
and its own validator and lowering accept it; (3) torch's own schedules, written by torch, import as
pipec's library orders (test_library compares the orders themselves; here they go through the CSV);
(4) diagnostics for malformed, deadlocking and untranslatable input; (5) the command line; (6) end to
end: a pipec schedule torch does not ship runs under torch's `_PipelineScheduleRuntime` on gloo with
4 processes and matches a single-process float64 reference, and a torch CSV runs on pipec's runtime.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch_pipelining_worker as worker
from cli_helpers import run_cli
from hypothesis import event, given, settings
from library_cases import TORCH, grid_ms, orders, param_names, try_load
from repo import ROOT
from strategies import random_schedules
from torch.distributed.pipelining import schedules as ts
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.stage import PipelineStage

from pipec.api import load
from pipec.driver import build
from pipec.driver import simulation as simulate
from pipec.errors import PipecError, Source
from pipec.formats.torch_actions import TORCH_VERSION
from pipec.formats.torch_csv_reader import read_csv, to_pipe
from pipec.formats.torch_csv_writer import comms_rows, export_csv
from pipec.frontend import library
from pipec.ir.schedule import Schedule
from pipec.passes.compiler import compile_schedule
from pipec.sim.cost_files import normalize


def test_targets_the_installed_torch():
    assert torch.__version__.startswith(TORCH_VERSION + "."), "re-check the CSV format against this torch"


# ---------------------------------------------------------------- helpers


def same(a: Schedule, b: Schedule) -> None:
    """Equal as schedules: sizes, placement, kinds and every rank's order with its pairs."""
    assert (a.num_ranks, a.num_stages, a.num_microbatches) == (b.num_ranks, b.num_stages, b.num_microbatches)
    assert a.placement == b.placement and a.kinds == b.kinds
    assert orders(a) == orders(b)


def csv(text: str, name: str = "t.csv") -> Source:
    return Source(name, text)


def grid(name: str):
    """A small grid per schedule: p = 1..4, a few m around p and 2p, v = 1..2 where it applies."""
    v_values = (1, 2) if "v" in param_names(name) else (None,)
    for p in range(1, 5):
        for m in sorted({1, p, p + 1, 2 * p, 2 * p + 1}):
            for v in v_values:
                params = dict(p=p, m=m) | ({} if v is None else dict(v=v))
                s = try_load(name, **params)
                if s is not None:
                    yield s


@functools.cache
def _stage_mock(p: int, S: int):
    st = mock.create_autospec(PipelineStage, instance=True)
    st.group_rank, st.group_size, st.submod, st.num_stages = 0, p, None, S
    return st


def torch_runtime(p: int, S: int, m: int) -> ts._PipelineScheduleRuntime:
    """torch's runtime schedule with mock stages (rank 0's view), enough to load and lower a CSV."""
    return ts._PipelineScheduleRuntime([_stage_mock(p, S)], m)


def torch_load(text: str, p: int, S: int, m: int, fmt: str, tmp_path: Path) -> ts._PipelineScheduleRuntime:
    path = tmp_path / f"{fmt}.csv"
    path.write_text(text)
    rt = torch_runtime(p, S, m)
    rt._load_csv(str(path), format=fmt)
    return rt


def torch_simulate(rt: ts._PipelineScheduleRuntime) -> None:
    """torch's own dry run of a compute+comms order (it knows neither FSDP/grad actions nor pairs, so
    those are dropped or flattened first); raises when the order does not progress."""
    flat = {}
    for r, row in rt.pipeline_order_with_comms.items():
        flat[r] = []
        for a in row:
            if a is None or a.computation_type in (ts.UNSHARD, ts.RESHARD, ts.REDUCE_GRAD):
                continue
            flat[r] += list(a.sub_actions) if a.sub_actions else [a]
    ts._simulate_comms_compute(flat, lambda s: rt.stage_index_to_group_rank[s], rt._num_stages)


def torch_csv_text(rows) -> str:
    """What torch's `_dump_csv` writes (csv.writer: None as an empty cell, `str(action)`)."""
    return "".join(",".join("" if a is None else str(a) for a in row) + "\r\n" for row in rows)


# ---------------------------------------------------------------- (1) round trip

# Token slices have no torch form: the writer refuses them (E615, tests/features/test_terapipe_schedule.py).
TORCH_FORM = [n for n in library.names() if load(n).slicing is None]


@pytest.mark.parametrize("name", TORCH_FORM)
def test_round_trip(name):
    """export -> import gives the same schedule, compute-only and compute+comms; the imported CSV as
    a generated .pipe evaluates to the same schedule again."""
    count = 0
    for s in grid(name):
        compiled = compile_schedule(s)
        for program in (None, compiled.program):
            if s.memops:  # torch has no memory ops: refused (E614), or written without them when asked
                with pytest.raises(PipecError, match="E614"):
                    export_csv(s, program)
            back = read_csv(csv(export_csv(s, program, drop_memops=bool(s.memops))))
            same(back, s)
        pipe = to_pipe(back, "t.csv")
        same(build(Source("t.pipe", pipe)), s)
        count += 1
    assert count >= 5, name


@settings(max_examples=80, deadline=None)
@given(random_schedules().filter(lambda rs: len(set(rs.placement)) == rs.p))
def test_round_trip_random_schedules(rs):
    """Any valid schedule with a stage on every rank (random placement, random dependency-respecting
    orders): export then import gives it back in both formats, and torch lowers and dry-runs the
    compute-only file, unless the last stage runs its forwards out of order (E611)."""
    s = build(Source("random.pipe", rs.text()))
    program = compile_schedule(s).program
    last = [i for k, i, st in rs.orders[rs.placement[-1]] if k == "F" and st == len(rs.placement) - 1]
    expected = "E611" if last != sorted(last) else None
    event(f"export refused: {expected}" if expected else "exported")
    try:
        texts = [export_csv(s), export_csv(s, program)]
    except PipecError as e:
        assert e.code == expected
        return
    assert expected is None
    for text in texts:
        same(read_csv(csv(text)), s)
    imported = read_csv(csv(texts[0]))
    written = build(Source("t.pipe", to_pipe(imported)))
    same(written, s)
    # ... and the written file simulates as the CSV does, on the same network (links, message sizes).
    links = [normalize({"latency": "2ms", "bandwidth": "1Gbps", "act_bytes": "1MiB", "comm": 0.01})]
    assert simulate(written, links).stats.makespan == simulate(imported, links).stats.makespan
    rt = torch_runtime(s.num_ranks, s.num_stages, s.num_microbatches)
    rt._prepare_schedule_with_comms(
        {r: [ts._Action.from_str(a) for a in row.split(",")] for r, row in enumerate(texts[0].splitlines())}
    )
    torch_simulate(rt)


def test_generated_pipe_reads_well():
    """Loops where the orders repeat, one branch per rank, the sizes fixed by a `require`."""
    s = read_csv(csv(export_csv(try_load("1f1b", p=4, m=8)), "runs/1f1b.csv"))
    text = to_pipe(s, "runs/1f1b.csv")
    assert "# Imported by `pipec import` from the torch.distributed.pipelining schedule CSV `runs/1f1b.csv`" in text
    assert 'schedule "1f1b" (p: int = 4, m: int = 8) {' in text
    assert "    place s -> s\n    ops F, B\n" in text
    assert "        } elif r == 3 {\n            for i in 0 .. 8 { F(i)  B(i) }\n        }" in text
    assert len(text.splitlines()) < 35
    dual = read_csv(csv(export_csv(try_load("dualpipe-v", p=4, m=8))))
    text = to_pipe(dual)
    assert "place s -> if s < p then s else 2 * p - 1 - s" in text
    assert "F(i + 4, stage: 4) & B(i, stage: 3)  W(i, stage: 3)" in text
    with pytest.raises(PipecError) as info:
        build(Source("t.pipe", text), {"m": 9})
    assert info.value.code == "E202"


def test_generated_pipe_keeps_a_misplaced_op_misplaced():
    """A CSV that runs a stage on two ranks becomes a .pipe that names the stage, so checking the .pipe
    reports the same E301 as checking the CSV."""
    s = read_csv(csv("0F0,0B0,1F0,1B0\n2F0,2B0,1F0\n"), check=False)
    pipe = to_pipe(s)
    assert "F(0, stage: 1)" in pipe.split("elif r == 1")[1]
    with pytest.raises(PipecError) as info:
        build(Source("t.pipe", pipe))
    assert info.value.code == "E301"


def test_placements_without_a_formula():
    text = "0F0,0B0\n1F0,1B0\n2F0,2B0\n1F0,1B0\n"  # stage 1 on rank 1 and rank 3: E301
    with pytest.raises(PipecError) as info:
        read_csv(csv(text))
    assert info.value.code == "E301" and (info.value.span.line, info.value.span.col) == (4, 1)
    text = "0F0,1F0,3F0,3B0,1B0,0B0\n2F0,2B0\n"  # runs of stages, not a formula pipec names
    s = read_csv(csv(text))
    assert s.placement == (0, 0, 1, 0)
    pipe = to_pipe(s)
    assert "place s -> if s < 2 then 0 else if s < 3 then 1 else 0" in pipe
    same(build(Source("t.pipe", pipe)), s)


# ---------------------------------------------------------------- (2) torch reads what pipec writes


@pytest.mark.parametrize("name", TORCH_FORM)
def test_torch_loads_export(name, tmp_path):
    """torch's `_load_csv` (its `_validate_schedule` inside) accepts both formats; from the compute-only
    file torch's own lowering (`_add_send_recv`) succeeds, and torch's dry run of both completes."""
    for s in list(grid(name))[::3]:
        compiled = compile_schedule(s)
        p, S, m = s.num_ranks, s.num_stages, s.num_microbatches
        drop = bool(s.memops)  # torch has no memory ops (E614 without the flag; test_round_trip)
        rt = torch_load(export_csv(s, drop_memops=drop), p, S, m, "compute_only", tmp_path)
        assert rt.stage_index_to_group_rank == dict(enumerate(s.placement))
        torch_simulate(rt)
        rt = torch_load(export_csv(s, compiled.program, drop_memops=drop), p, S, m, "compute_comms", tmp_path)
        torch_simulate(rt)
        ours = read_csv(csv(torch_csv_text(rt.pipeline_order_with_comms.values())))  # torch's reading, written
        same(ours, s)


def test_comms_format_details():
    """Sends name the sending stage, receives the receiving stage; each stage is unsharded before its
    first use and reduced then resharded at the end; STEP (the optimizer) has no torch action."""
    s = try_load("1f1b", p=2, m=2)
    text = export_csv(s, compile_schedule(s).program)
    rows = [line.split(",") for line in text.splitlines()]
    assert rows[0] == "0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD".split()
    assert rows[1][:4] == ["1RECV_F0", "1RECV_F1", "1UNSHARD", "1F0"]
    assert rows[1][-2:] == ["1REDUCE_GRAD", "1RESHARD"]
    assert "1SEND_B0" in rows[1]


def test_full_backward_inside_a_pair():
    """In a split schedule our `F & B` followed by that B's W is torch's `(F;B)OVERLAP_F_B`, as torch's
    DualPipeV writes it; a B whose W comes later is `I`, outside a pair as well."""
    text = export_csv(try_load("dualpipe-v", p=4, m=8))
    assert "(0F7;7B3)OVERLAP_F_B" in text.splitlines()[0]
    assert ",7I4,7W4," in text.splitlines()[0]
    assert "7B4" not in text.splitlines()[0].replace("(", ",").replace(";", ",").replace(")", ",").split(",")[19:]


# ---------------------------------------------------------------- (3) torch's own CSVs


def torch_rows(cls, p: int, m: int, v: int, fmt: str):
    """torch's schedule written by torch: `_dump_csv` for runtime schedules, the pipeline order (what
    `_dump_csv` would write) for the single-stage ones, which have no `_dump_csv`."""
    if issubclass(cls, ts.PipelineScheduleSingle):
        assert fmt == "compute_only"
        return get_schedule_ops(cls, p, m)
    sched = cls([_stage_mock(p, p * v)] * v, m)
    order = sched.pipeline_order if fmt == "compute_only" else sched.pipeline_order_with_comms
    return [order[r] for r in range(p)]


@pytest.mark.parametrize("name, cls, local, split", TORCH, ids=[t[0] for t in TORCH])
def test_torch_csv_imports_as_the_library(name, cls, local, split, tmp_path):
    """torch's CSV of its own schedule, read by pipec, is pipec's library schedule op for op; where torch
    lowers it (runtime schedules), its compute+comms CSV passes pipec's checks of sends and receives."""
    compared = 0
    for p in range(1, 7):
        for m in grid_ms(p)[::2]:
            for v in (1, 2) if local == "v" else (local,):
                params = dict(p=p, m=m) | ({"v": v} if local == "v" else {})
                ours = try_load(name, **params)
                if ours is None:
                    continue
                try:
                    rows = torch_rows(cls, p, m, v, "compute_only")
                except ValueError:
                    continue  # torch refuses these parameters (test_library says which and why)
                path = tmp_path / "torch.csv"
                path.write_text(torch_csv_text(rows))
                same(build(library.read(str(path)), {"m": m}), ours)
                if not issubclass(cls, ts.PipelineScheduleSingle):
                    comms = torch_csv_text(torch_rows(cls, p, m, v, "compute_comms"))
                    same(read_csv(csv(comms), {"m": m}), ours)
                compared += 1
    assert compared >= 8


def test_torch_1f1b_csv_is_refused_at_the_bad_cell():
    """torch 2.13's 1F1B order runs forwards 1..m on the last rank (see test_library); its CSV, read
    with the intended m, fails at the first out-of-range cell, and without m, as missing micro-batch
    m on every other stage. torch's own `_validate_schedule` refuses it too."""
    rows = get_schedule_ops("1F1B", 4, 8)
    text = torch_csv_text(rows)
    with pytest.raises(PipecError) as info:
        read_csv(csv(text), {"m": 8})
    d = info.value.diagnostics[0]
    assert d.code == "E209" and (d.span.line, d.span.col) == (4, 57)
    assert d.format().splitlines()[0] == "t.csv:4:57: error[E209]: micro-batch 8 is out of range 0..7"
    with pytest.raises(PipecError) as info:
        read_csv(csv(text))
    assert info.value.code == "E303" and "F(8, stage 0) is never emitted" in str(info.value)
    fixed = text.replace("3F1,3B0", "3F0,3B0").replace("3F8", "3F1")  # not the fix: F1 is now late
    with pytest.raises(PipecError):
        read_csv(csv(fixed), {"m": 8})


# ---------------------------------------------------------------- (4) diagnostics

CASES = [
    # (code, CSV text, params, line, col)
    ("E601", "0F0,0B0\n1F0,1F0x,1B0\n", {}, 2, 5),
    ("E601", "0F0,0B0\n1F0, 1OVERLAP_F_B\n", {}, 2, 6),
    ("E602", "0F0,0B\n1F0,1B0\n", {}, 1, 5),
    ("E602", "0F0,0B0,0REDUCE_GRAD3\n", {}, 1, 9),
    ("E602", "0F99999999999,0B0\n", {}, 1, 1),
    ("E603", "0F0,0F1,(0B0;0B1;0F2)OVERLAP_F_B,0B2\n", {}, 1, 9),
    ("E603", "0F0,(0B0;0SEND_F1)OVERLAP_F_B\n", {}, 1, 5),
    ("E606", "0F0,0B0\n1RECV_F0\n", {}, 2, 1),
    ("E606", "0F0,0SEND_F0,,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n", {}, 1, 14),
    ("E608", "0F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n", {}, 1, 1),
    ("E608", "0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1B0,1SEND_B0\n", {}, 2, 1),
    ("E608", "0SEND_F0,0F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n", {}, 1, 1),
    ("E608", "0F0,0SEND_F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n", {}, 1, 14),
    ("E608", "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0,1SEND_F0\n", {}, 2, 27),
    (
        "E404",
        "0F0,0F1,0SEND_F1,0SEND_F0,0RECV_B0,0B0,0RECV_B1,0B1\n1RECV_F0,1RECV_F1,1F0,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n",
        {},
        1,
        9,
    ),
    ("E608", "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1SEND_B0,1B0\n", {}, 2, 14),
    ("E607", "0F0,0B0\n", {"p": 2}, None, None),
    ("E607", "0F0,0B0\n", {"v": 2}, None, None),
    ("E607", "0F0,0B0\n", {"m": 0}, None, None),
    ("E604", "0F0,0B0\n2F0,2B0\n", {}, None, None),
    ("E605", "", {}, None, None),
    ("E606", "0F0,0B0\n\n", {}, None, None),
    ("E301", "0F0,0B0,1F0\n1B0\n", {}, 2, 1),  # a stage belongs to the first rank that runs it
    ("E302", "0F0,0F0,0B0\n", {}, 1, 5),
    ("E303", "0F0,0F1,0B0\n", {}, None, None),
    ("E303", "0F0,0B0,0F9999999\n", {}, None, None),  # found without arrays over 20 million ops
    ("E303", "0F0,0B0\n", {"m": 9999999}, None, None),
    ("E304", "0B0,0F0\n", {}, 1, 1),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_diagnostics(case):
    code, text, params, line, col = case
    with pytest.raises(PipecError) as info:
        read_csv(csv(text), params)
    d = info.value.diagnostics[0]
    out = d.format()
    assert d.code == code, out
    if line is None:
        assert d.span is None and out.startswith(f"t.csv: error[{code}]: "), out
        return
    assert (d.span.line, d.span.col) == (line, col), out
    first, src, caret = out.splitlines()[:3]
    assert first.startswith(f"t.csv:{line}:{col}: error[{code}]: ")
    assert src.endswith(" | " + text.splitlines()[line - 1])
    assert caret.index("^") == src.index(" | ") + 3 + col - 1


def test_deadlock_is_explained_with_csv_lines():
    with pytest.raises(PipecError) as info:
        compile_schedule(read_csv(csv("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n")))
    out = info.value.diagnostics[0].format()
    assert out.splitlines()[0] == "t.csv:1:5: error[E401]: deadlock: ranks 0 -> 1 -> 0 wait on each other"
    assert "rank 1 waits at `F(1, stage 1)` (line 2) for the activation of `F(1, stage 0)` from rank 0" in out


def test_deadlock_of_the_comms_is_explained():
    """pipec's own placement of interleaved 1F1B's transfers with one send on rank 2 moved later: every
    message still has its ends in the same order, but under rendezvous sends three ranks wait in a
    cycle. (torch's runtime issues sends asynchronously, so gloo would pass; NCCL may hang.)"""
    s = try_load("interleaved-1f1b", p=3, v=2, m=3)
    rows = export_csv(s, compile_schedule(s).program).splitlines()
    cells = rows[2].split(",")
    cells.remove("2SEND_F2")
    cells.insert(cells.index("5SEND_B0") + 1, "2SEND_F2")
    rows[2] = ",".join(cells)
    with pytest.raises(PipecError) as info:
        read_csv(csv("\n".join(rows) + "\n"))
    d = info.value.diagnostics[0]
    assert d.code == "E609" and (d.span.line, d.span.col) == (1, 111)
    assert d.notes == (
        "rank 0 blocks at `3F2` (1:111) waiting for the activation of micro-batch 2 from stage 2, sent by rank 2",
        "rank 1 blocks at `4F2` (2:138) waiting for the activation of micro-batch 2 from stage 3, sent by rank 0",
        "rank 2 blocks at `5SEND_B0` (3:111) until rank 1 posts the matching receive",
    )


EXPORT_CASES = [
    # (code, schedule text, line, col): what torch cannot run as pipec means it
    (
        "E610",
        'schedule "t" (p: int = 1, m: int = 2) {\n    stages 1\n    rank r {\n'
        "        F(0) & F(1)\n        B(0)  B(1)\n    }\n}\n",
        4,
        9,
    ),
    (
        "E611",
        'schedule "t" (p: int = 1, m: int = 2) {\n    stages 1\n    rank r {\n'
        "        F(1)  F(0)\n        B(0)  B(1)\n    }\n}\n",
        4,
        9,
    ),
    (
        "E612",
        'schedule "t" (p: int = 2, m: int = 2) {\n    stages 1\n    place s -> 0\n    rank r {\n'
        "        if r == 0 { F(0)  F(1)  B(0)  B(1) }\n    }\n}\n",
        3,
        5,
    ),
]


@pytest.mark.parametrize("case", EXPORT_CASES, ids=[c[0] for c in EXPORT_CASES])
def test_export_diagnostics(case):
    code, text, line, col = case
    s = build(Source("t.pipe", text))
    for program in (None, compile_schedule(s).program):
        with pytest.raises(PipecError) as info:
            export_csv(s, program)
        d = info.value.diagnostics[0]
        assert d.code == code and (d.span.line, d.span.col) == (line, col), d.format()


def test_export_E613_when_unbatching_could_deadlock(monkeypatch):
    """Unbatching pipec's exchanges keeps each channel's order, and the strict dry run of the result
    has passed for every schedule tried; if it ever failed, export says so instead of writing."""
    from pipec.passes import dryrun

    s = try_load("1f1b", p=2, m=2)
    program = compile_schedule(s).program
    stuck = dryrun.DryRun(False, (dryrun.Wait(0, 1, program.ranks[0].instructions()[1], "match", 1, "x"),))
    monkeypatch.setattr(dryrun, "dry_run", lambda prog: stuck)
    with pytest.raises(PipecError) as info:
        comms_rows(s, program)
    assert info.value.code == "E613" and "rank 0 blocks at `SEND_ACT 0 0 1`" in str(info.value)


# ---------------------------------------------------------------- (5) the command line


def test_cli_export_import_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli("export", "zb-h1", "-D", "p=4", "-D", "m=8", "--to", "torch-csv", "-o", "zb.csv")
    assert rc == 0 and out.startswith("wrote 4 ranks of zb-h1 to zb.csv (torch compute-only CSV)\n"), err
    assert (tmp_path / "zb.csv").read_text().splitlines()[3].startswith("3F0,3I0,3F1,3I1,")
    rc, out, err = run_cli("export", "zb-h1", "-D", "p=4", "-D", "m=8", "--comms", "-o", "zbc.csv")
    assert rc == 0 and "compute+comms" in out
    rc, out, err = run_cli("import", "zb.csv", "-o", "zb.pipe")
    assert rc == 0 and out == "wrote zb.pipe: 4 stages on 4 ranks, 8 micro-batches, 96 ops\nzb.csv: OK\n", err
    for path in ("zb.pipe", "zb.csv", "zbc.csv"):
        rc, out, err = run_cli("check", path)
        assert rc == 0 and out.endswith("(p=4 m=8): 4 stages, 4 ranks, 96 ops: OK\n"), (path, err)
    rc, out, _ = run_cli("show", "zb.csv", "--ranks", "3")
    assert out.splitlines()[2:4] == ["Step 00 F0", "Step 01 B0"]
    rc, out, err = run_cli("simulate", "zb.csv", "1f1b", "-D", "p=4", "-D", "m=8")
    assert rc == 0 and "zb " in out and "1f1b" in out, err
    rc, out, _ = run_cli("compile", "zbc.csv")
    assert rc == 0 and "SEND_ACT" in out
    rc, out, _ = run_cli("export", "zb.pipe")  # to standard output by default
    assert rc == 0 and out == (tmp_path / "zb.csv").read_text()


def test_cli_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dl.csv").write_text("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n")
    rc, out, err = run_cli("import", "dl.csv", "-o", "dl.pipe")
    assert rc == 1 and out.startswith("wrote dl.pipe") and "error[E401]" in err  # written, then checked
    rc, _, err = run_cli("check", "dl.pipe")
    assert rc == 1 and err.startswith("dl.pipe:12:37: error[E401]: deadlock: ranks 0 -> 1 -> 0")
    (tmp_path / "bad.csv").write_text("0F0,0B0\n1F0,1F0x,1B0\n")
    rc, out, err = run_cli("import", "bad.csv", "-o", "bad.pipe")
    assert rc == 1 and err.startswith("bad.csv:2:5: error[E601]") and not (tmp_path / "bad.pipe").exists()
    rc, _, err = run_cli("check", "missing.csv")
    assert rc == 1 and "error[E000]" in err  # a missing input file is an input error (docs/errors.md)
    rc, _, err = run_cli("import", "1f1b")
    assert rc == 2 and "expected a .csv file" in err
    rc, _, err = run_cli("export", "1f1b", "--to", "megatron")
    assert rc == 2
    rc, out, err = run_cli("export", "examples/extra_warmup_1f1b.pipe".replace("examples", str(ROOT / "examples")))
    assert rc == 0 and "no place for cost, memory declarations" in err


def test_docs_examples(tmp_path, monkeypatch):
    """docs/interop.md: the Python block runs; the deadlock shown is what `pipec check` prints; the
    generated .pipe shown is what `pipec import` writes for zb-h1 with p=2, m=3."""
    text = (ROOT / "docs" / "interop.md").read_text()
    monkeypatch.chdir(tmp_path)
    exec(re.findall(r"```python\n(.*?)```", text, re.S)[-1], {})
    (tmp_path / "dl.csv").write_text("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n")
    shown = re.search(r"```console\n\$ pipec check dl.csv\n(.*?)```", text, re.S).group(1)
    assert run_cli("check", "dl.csv")[2] == shown
    run_cli("export", "zb-h1", "-D", "p=2", "-D", "m=3", "-o", "zb2.csv")
    rc, out, _ = run_cli("import", "zb2.csv")
    assert rc == 0 and out == re.search(r"```pipe\n(.*?)```", text, re.S).group(1)


def _doc_diagnostics():
    text = (ROOT / "docs" / "interop.md").read_text().split("\n## Diagnostics\n", 1)[1]
    for part in re.split(r"(?m)^### ", text)[1:]:
        code = part[:4]
        shown = re.search(r"```console\n\$ (.*?)\n(.*?)```", part, re.S)
        source = re.search(r"```(csv|pipe)\n(.*?)```", part, re.S)
        if shown:
            name, body = ("t." + source.group(1), source.group(2)) if source else ("t.csv", "")
            yield pytest.param(name, body, shown.group(1), shown.group(2), id=code)


@pytest.mark.parametrize("name, body, command, shown", list(_doc_diagnostics()))
def test_docs_diagnostics(name, body, command, shown, tmp_path, monkeypatch):
    """Every example in docs/interop.md's diagnostics prints exactly what the docs show."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(body)
    argv = command.split()
    assert argv[0] == "pipec"
    rc, out, err = run_cli(*argv[1:])
    assert rc == 1 and out == "" and err == shown


def test_import_pipec_does_not_import_torch():
    code = (
        "import sys, pipec, pipec.api, pipec.cli.app, pipec.formats.torch_csv_reader, pipec.formats.torch_csv_writer\n"
        "from pipec.api import load\n"
        "from pipec.formats.torch_csv_reader import read_csv, to_pipe\n"
        "from pipec.formats.torch_csv_writer import export_csv\n"
        "from pipec.errors import Source\n"
        "s = load('zb-v', p=2, m=4)\n"
        "to_pipe(read_csv(Source('x.csv', export_csv(s))))\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---------------------------------------------------------------- (6) end to end


def test_pipec_schedules_run_on_torch_runtime(tmp_path):
    """Schedules torch does not ship as classes (ZB-H1 and ZB-H2 on one stage per rank), and ZB-V and
    DualPipeV as pipec writes them, run under torch's `_PipelineScheduleRuntime` on gloo with 4
    processes from pipec's CSVs (both formats); every gradient equals a single-process float64
    reference."""
    cases = [
        ("zb-h1", dict(p=4, m=8), "compute_only"),
        ("zb-h1", dict(p=4, m=8), "compute_comms"),
        ("zb-h2", dict(p=4, m=8), "compute_comms"),
        ("zb-v", dict(p=4, m=8), "compute_comms"),
        ("dualpipe-v", dict(p=4, m=8), "compute_only"),
    ]
    args = []
    for k, (name, params, fmt) in enumerate(cases):
        s = try_load(name, **params)
        program = compile_schedule(s).program if fmt == "compute_comms" else None
        path = tmp_path / f"case{k}.csv"
        path.write_text(export_csv(s, program))
        args.append(f"{path}:{fmt}")
    start = time.monotonic()
    codes = worker.launch(str(tmp_path), args, 4, timeout=120)
    assert codes == [0, 0, 0, 0], f"exit codes {codes} (the ranks' errors are in the captured stderr)"
    assert time.monotonic() - start < 120
    for k, arg in enumerate(args):
        num_stages = try_load(cases[k][0], **cases[k][1]).num_stages
        ref = worker.reference_grads(num_stages, cases[k][1]["m"])
        got = {}
        for r in range(4):
            got |= torch.load(tmp_path / f"case{k}.rank{r}.pt")
        assert got.keys() == ref.keys(), arg
        for key, g in ref.items():
            err = (got[key] - g).abs().max().item() / g.abs().max().item()
            assert err <= 1e-10, f"{cases[k]}: {key} rel err {err}"


def test_torch_csvs_run_on_pipec_runtime():
    """torch's own CSVs (DualPipeV compute-only, with its overlapped pairs; interleaved 1F1B
    compute+comms), imported into pipec, lowered by pipec and run on pipec's runtime (every rank in
    this process): loss, every gradient and the parameters after an optimizer step equal the
    single-process float64 reference."""
    from pipec.runtime import LocalPipeline, Reference, StageOptions
    from pipec.runtime.reference import compare, rel_err

    torch.set_num_threads(1)

    def build_stage(s: int, num_stages: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(worker.WIDTH, worker.WIDTH), torch.nn.Tanh())

    kw = dict(dtype=torch.float64, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    for cls, fmt in ((ts.ScheduleDualPipeV, "compute_only"), (ts.ScheduleInterleaved1F1B, "compute_comms")):
        text = torch_csv_text(torch_rows(cls, 2, 4, 2, fmt))
        sched = read_csv(csv(text, f"{cls.__name__}.csv"))
        assert sched.num_stages == 4 and sched.num_microbatches == 4
        prog = compile_schedule(sched).program
        pipe = LocalPipeline(prog, build_stage, worker.loss_fn, options=StageOptions(**kw))
        ref = Reference(build_stage, worker.loss_fn, prog.num_stages, prog.num_microbatches, **kw)
        x, y = worker.batch()
        out = pipe.step(x, y)
        assert rel_err(out.loss, ref.step(x, y)) <= 1e-10
        grads = compare(pipe.named_gradients(), ref.named_gradients())
        assert len(grads) == 8 and max(grads.values()) <= 1e-10, (cls.__name__, grads)
        assert max(compare(pipe.named_parameters(), ref.named_parameters()).values()) <= 1e-10
