"""The facade's file calls (docs/api.md): `write_program` and `read_program`, `write_trace` and `read_trace`
round-trip exactly, and a path or value they cannot take is E903, never an OSError or a TypeError."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

import pipec


@pytest.mark.parametrize("name", ["p.json", "p.txt"])
def test_write_program_then_read_program_gives_the_same_program(tmp_path: Path, name: str) -> None:
    prog = pipec.compile("zb-h1", p=2, m=4)
    pipec.write_program(prog, tmp_path / name)
    text = (tmp_path / name).read_text()
    assert text.lstrip().startswith("{") == name.endswith(".json")
    assert pipec.read_program(tmp_path / name) == prog


def test_write_trace_then_read_trace_gives_the_same_timeline(tmp_path: Path) -> None:
    sim = pipec.simulate("1f1b", p=2, m=4, cost="F=1,B=2")
    pipec.write_trace(sim.timeline, tmp_path / "t.json")
    back, tl = pipec.read_trace(tmp_path / "t.json"), sim.timeline
    for f in dataclasses.fields(tl):
        a, b = getattr(back, f.name), getattr(tl, f.name)
        if isinstance(b, np.ndarray):
            assert np.array_equal(a, b, equal_nan=True), f.name
        elif f.name in ("num_ranks", "schedule", "params", "origin"):
            assert a == b, f.name


def test_an_unwritable_path_is_e903_and_the_old_file_is_kept(tmp_path: Path) -> None:
    prog = pipec.compile("gpipe", p=2, m=2)
    with pytest.raises(pipec.PipecError, match=r"E903.*cannot write") as e:
        pipec.write_program(prog, tmp_path / "no" / "such" / "p.json")
    assert e.value.code == "E903"
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "p.txt").write_text("before")
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):  # root writes anywhere: a file in place of the folder instead
            target = tmp_path / "file" / "p.txt"
            (tmp_path / "file").write_text("a file, not a folder")
        else:
            target = folder / "p.txt"
        with pytest.raises(pipec.PipecError, match="E903"):
            pipec.write_program(prog, target)
    finally:
        folder.chmod(0o700)
    assert (folder / "p.txt").read_text() == "before"


@pytest.mark.parametrize(
    ("program", "fmt", "message"),
    [("not a program", None, "takes a Program"), (None, "yaml", "format must be 'json' or 'text'")],
)
def test_a_value_write_program_cannot_take_is_e903(tmp_path: Path, program, fmt, message: str) -> None:
    prog = pipec.compile("gpipe", p=2, m=2) if program is None else program
    with pytest.raises(pipec.PipecError, match=message) as e:
        pipec.write_program(prog, tmp_path / "p.json", format=fmt)
    assert e.value.code == "E903" and not (tmp_path / "p.json").exists()
