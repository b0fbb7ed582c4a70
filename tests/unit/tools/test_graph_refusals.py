"""The exporters and tools that can express only the chain refuse a stage graph with E217 (issue 42): the
torch CSV writer, torchtitan, `pipec partition`, `pipec plan`, `pipec synth` and `pipec slice`, each naming
the limit it hits, at the first `edge` declaration (or the Program file), never writing a chain. The text
views (`pipec show`: the grid, its JSON, the timeline) take a graph: they draw each rank's own ops."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from cli_helpers import run_cli
from repo import ROOT
from tables import random_layer_table

import pipec
from pipec.driver import build
from pipec.errors import PipecError, Source

# Three stages on three ranks: the chain 0 -> 1 -> 2 and the skip 0 -> 2.
GRAPH = """\
schedule "t" (p: int = 3, m: int = 2) {
    stages p
    edge s -> if s < p - 1 then s + 1 else -1
    edge s -> if s == 0 then p - 1 else -1
    ops F, B
    rank r {
        for i in 0 .. m { F(i) }
        for i in 0 .. m { B(i) }
    }
}
"""
# The same with token slices (for `pipec slice`).
SLICED = GRAPH.replace("    stages p\n", "    stages p\n    slices 2\n    seqlen 100\n").replace(
    "for i in 0 .. m { F(i) }\n        for i in 0 .. m { B(i) }",
    "for i in 0 .. m { F(i, slice: 0)  F(i, slice: 1) }\n        for i in 0 .. m { B(i, slice: 1)  B(i, slice: 0) }",
)
EDGE_LINE = 3  # the first `edge` declaration of GRAPH


@pytest.fixture
def files(tmp_path: Path) -> SimpleNamespace:
    """GRAPH as a .pipe file and as a compiled Program file; SLICED as a .pipe file."""
    pipe = tmp_path / "t.pipe"
    pipe.write_text(GRAPH)
    sliced = tmp_path / "sliced.pipe"
    sliced.write_text(SLICED)
    program = tmp_path / "t.txt"
    pipec.write_program(pipec.compile(str(pipe)), str(program))
    assert program.read_text().startswith("pipec-program 2\n")
    return SimpleNamespace(pipe=str(pipe), program=str(program), sliced=str(sliced), dir=tmp_path)


def _sched(text: str = GRAPH):
    sched = build(Source("t.pipe", text), {})
    assert sched.graph is not None and sched.graph.edges == ((0, 1), (0, 2), (1, 2))
    return sched


def _e217(call, *words: str, line: int | None = EDGE_LINE) -> str:
    """`call()` raises E217 whose message holds `words`, at the first `edge` declaration (or no line)."""
    with pytest.raises(PipecError) as e:
        call()
    d = e.value.diagnostics[0]
    assert d.code == "E217", d.format()
    assert "cannot take a stage graph yet" in d.message, d.format()
    for w in words:
        assert w in d.format(), (w, d.format())
    assert "0->1, 0->2, 1->2" in d.format()  # the note names the graph's edges
    assert (d.span.line if d.span else None) == line, d.format()
    return d.format()


def _cli_e217(*argv: str, words: tuple[str, ...] = (), where: str | None = None) -> str:
    rc, out, err = run_cli(*argv)
    assert rc == 1, (rc, out, err)
    assert "error[E217]" in err and "cannot take a stage graph yet" in err, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    if where is not None:
        assert err.startswith(where), err
    return err


# ---- torch CSV and torchtitan ------------------------------------------------


def test_the_torch_csv_writer_refuses_a_graph_schedule_in_both_formats():
    from pipec.formats.torch_csv_writer import export_csv

    sched = _sched()
    _e217(lambda: export_csv(sched), "the torch CSV writer", "next stage only")
    program = pipec.compile(sched)
    _e217(lambda: export_csv(sched, program), "the torch CSV writer")


def test_the_torch_csv_writer_refuses_a_graph_program_even_with_a_chain_schedule():
    """The Program's graph is enough (a Schedule rebuilt from a Program's computes may have lost it)."""
    import dataclasses

    from pipec.formats.torch_csv_writer import export_csv

    sched = _sched()
    program = pipec.compile(sched)
    bare = dataclasses.replace(sched, graph=None)
    _e217(lambda: export_csv(bare, program), "the torch CSV writer")


def test_torchtitan_refuses_a_graph_schedule_before_anything_else():
    from pipec.formats.torchtitan import export_torchtitan

    sched = _sched()
    _e217(lambda: export_torchtitan(sched, "out.csv"), "the torchtitan export")
    _e217(lambda: export_torchtitan(sched, "out.csv", comms=True), "the torchtitan export")  # before E621


@pytest.mark.parametrize(
    "argv",
    [
        ["--to", "torch-csv"],
        ["--to", "torch-csv", "--comms"],
        ["--to", "torchtitan", "-o", "OUT"],
    ],
)
def test_pipec_export_refuses_a_graph_schedule_and_program_file_and_writes_nothing(files, argv):
    out = files.dir / "OUT"
    argv = [str(out) if a == "OUT" else a for a in argv]
    _cli_e217("export", files.pipe, *argv, words=("next stage only",), where=f"{files.pipe}:{EDGE_LINE}:5:")
    _cli_e217("export", files.program, *argv, where=f"{files.program}: error[E217]")
    assert not list(files.dir.glob("OUT*"))


def test_a_chain_schedule_still_exports():
    rc, out, err = run_cli("export", "1f1b", "-D", "p=2", "-D", "m=2", "--to", "torch-csv")
    assert rc == 0 and "error" not in err and out.splitlines()[0].startswith("0F0,"), (rc, out, err)


# ---- partition and plan ------------------------------------------------------------


def test_the_partition_problem_refuses_a_graph_schedule():
    from pipec.partition import partition

    sched = _sched()
    table = random_layer_table(np.random.default_rng(0), 6)
    program = pipec.compile(sched)
    _e217(lambda: partition(sched, program, table), "the partition search", "consecutive stages")


def test_pipec_partition_refuses_before_reading_the_layer_table(files):
    missing = str(files.dir / "no-such-table.json")  # E217 comes first: nothing is read or profiled
    _cli_e217("partition", files.pipe, "--layers-cost", missing, words=("pipec partition", "consecutive stages"))
    _cli_e217("partition", files.program, "--layers-cost", missing, where=f"{files.program}: error[E217]")


def test_pipec_plan_refuses_a_graph_candidate_schedule(files):
    """`pipec plan`'s candidates are built by its builder; a graph schedule among them is E217 (which the
    plan lists among the schedules it skipped), never planned as a chain."""
    from pipec.planner.search import _Builder
    from pipec.planner.space import Candidate

    builder = _Builder(SimpleNamespace(p=3))
    _e217(lambda: builder.schedule(Candidate(files.pipe, 2)), "pipec plan", "consecutive stages")
    _e217(lambda: builder.schedule(Candidate(files.pipe, 2)), "pipec plan")  # the cached refusal too


# ---- synth and slice -----------------------------------------------------------------


def test_synth_refuses_a_graph_schedule_to_compare_with_or_take_a_limit_from(files):
    from pipec import synth

    spec = synth.Spec(p=3, m=2, split=False)
    _e217(lambda: synth.library_comparison(spec, [files.pipe]), "pipec synth", "chain schedules")
    _e217(lambda: synth.peak_of(spec, files.pipe), "pipec synth")


@pytest.mark.parametrize("flag", ["--compare", "--memory-limit-of"])
def test_pipec_synth_refuses_a_graph_schedule_before_searching(files, flag):
    err = _cli_e217("synth", "-p", "3", "-m", "2", "--no-solver", flag, files.pipe, words=("pipec synth",))
    assert "heuristic" not in err  # refused before the search ran


def test_slicing_refuses_a_graph_schedule(files):
    from pipec.slicing import slice_costs, slice_schedule

    sched = _sched(SLICED)
    _e217(lambda: slice_costs(sched, [{"attn": 1.0}]), "pipec slice", "TeraPipe's dynamic program", line=EDGE_LINE + 2)
    source = Source(files.sliced, SLICED)
    _e217(lambda: slice_schedule(source, {}, [{"attn": 1.0}]), "pipec slice", line=EDGE_LINE + 2)


def test_pipec_slice_refuses_a_graph_schedule_with_or_without_slices(files):
    _cli_e217("slice", files.sliced, "--cost", "attn=1", words=("TeraPipe",), where=f"{files.sliced}:5:5:")
    _cli_e217("slice", files.pipe, where=f"{files.pipe}:{EDGE_LINE}:5:")  # E217, not E807 (no slices)


# ---- the text views take a graph ---------------------------------------------------


@pytest.mark.parametrize("which", ["pipe", "program"])
def test_pipec_show_draws_a_graph_schedule_and_its_program_file(files, which):
    path = getattr(files, which)
    rc, out, err = run_cli("show", path)
    assert (rc, err) == (0, ""), err
    assert out.splitlines()[1].split() == ["Rank", "0", "Rank", "1", "Rank", "2"]
    assert out.splitlines()[2].split() == ["Step", "00", "F0", "F0", "F0"]
    rc, out, err = run_cli("show", path, "--json")
    assert rc == 0 and '"cells": ["F0", "F1", "B0", "B1"]' in out, err
    rc, out, err = run_cli("show", path, "--timeline", "--width", "60")
    assert rc == 0 and "Traceback" not in err and re.search(r"makespan \d", out), err


def test_a_program_files_schedule_keeps_its_graph(files):
    """The CLI's schedule of a Program file carries the Program's graph, so the tools above see it."""
    from pipec.cli.args import program_schedule

    prog = pipec.read_program(files.program)
    assert program_schedule(prog, files.program).graph == prog.graph
    chain = pipec.compile("1f1b", p=2, m=2)
    assert program_schedule(chain, None).graph is None


# ---- docs/errors.md's example ---------------------------------------------------------


def test_the_documented_E217_example_prints_what_docs_errors_md_says(tmp_path, monkeypatch):
    body = (ROOT / "docs" / "errors.md").read_text().split("### E217")[1].split("\n### ")[0]
    console = re.search(r"```console\n\$ pipec (.*?)\n(.*?)```", body, flags=re.S)
    pipe = re.search(r"```pipe\n(.*?)```", body, flags=re.S)
    assert console and pipe, body
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.pipe").write_text(pipe.group(1))
    rc, out, err = run_cli(*console.group(1).split())
    assert rc == 1 and err == console.group(2), err
    assert not (tmp_path / "out.csv").exists()
