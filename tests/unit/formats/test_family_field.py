"""Program files with an order family (format version 3, docs/program.md; pipec.formats.family_field): written
only when a Program's family reorders some rank, read back equal in both forms, re-proven on reading (E502),
malformed fields E501 at their line; a Program without a family or plan is written as before."""

from __future__ import annotations

import json
import re

import pytest
from repo import ROOT

import pipec
from pipec.errors import PipecError
from pipec.formats import program_file as pf

ANY = """\
schedule "1f1b-any" (p: int = 4, m: int = 8) {
    stages p
    ops F, B, W
    rank r {
        let warm = min(p - 1 - r, m)
        for i in 0 .. warm      { F(i) }
        for i in 0 .. m - warm  { F(i + warm)  B(i) }
        for i in m - warm .. m  { B(i) }
        any { for i in 0 .. m { W(i) } }
    }
}
"""


def _compile(tmp_path, family: str | None = None, text: str | None = None):
    if text is None:
        text = (ROOT / "schedules" / "1f1b.pipe").read_text()
        text = re.sub(r"(rank r \{\n)", r"\1        " + family + "\n", text, count=1)
    path = tmp_path / "f.pipe"
    path.write_text(text)
    return pipec.compile(str(path), p=4, m=8)


@pytest.fixture(params=["window", "any"])
def prog(request, tmp_path):
    if request.param == "window":
        return _compile(tmp_path, "window 3 prefer depth")
    return _compile(tmp_path, text=ANY)


def test_a_family_reads_back_equal_in_both_forms(prog):
    assert prog.family is not None and not prog.family.is_static
    for write, read in ((pf.to_json, pf.from_json), (pf.to_text, pf.from_text)):
        text = write(prog)
        assert text.startswith('{"format":"pipec-program","version":3') or text.startswith("pipec-program 3\n")
        back = read(text)
        assert back == prog and back.family == prog.family and back.buffers is None
        assert back.family.nccl == prog.family.nccl and back.family.describe() == prog.family.describe()


def test_an_any_group_is_its_own_segment(tmp_path):
    prog = _compile(tmp_path, text=ANY)
    doc = json.loads(pf.to_json(prog))["family"]
    assert doc["num_ranks"] == 4 and doc["nccl"] is None  # W is local: NCCL can run it
    for r in range(4):
        *_, (lo, hi, k) = doc["ranks"][str(r)]["segments"]
        assert (lo, hi, k) == (16, 24, 8)  # the m = 8 W ops after the 16 F and B ops, in any order


def test_a_family_with_a_buffer_plan_keeps_both(tmp_path):
    path = tmp_path / "f.pipe"
    path.write_text(ANY)
    prog = pipec.compile(str(path), p=4, m=8, buffers=True)
    back = pf.from_text(pf.to_text(prog))
    assert back.buffers == prog.buffers and back.family == prog.family


def test_a_program_without_a_family_keeps_its_version_and_bytes(tmp_path):
    plain = pipec.compile("1f1b", p=4, m=8)
    static = _compile(tmp_path, "window 1")  # a family that reorders nothing is none
    assert pf.to_json(static) == pf.to_json(plain) and pf.to_text(static) == pf.to_text(plain)
    assert pf.to_text(plain).startswith("pipec-program 1\n") and "family" not in pf.to_text(plain)


def _text_with(prog, edit) -> str:
    lines = pf.to_text(prog).split("\n")
    at = next(i for i, ln in enumerate(lines) if ln.startswith("family "))
    doc = json.loads(lines[at][len("family ") :])
    edit(doc)
    lines[at] = "family " + json.dumps(doc)
    return "\n".join(lines), at + 1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["ranks"]["0"].update(prefer="fastest"), "prefer must be one of order, depth, breadth"),
        (lambda d: d["ranks"]["0"]["segments"][0].__setitem__(0, 1), "segments must cover its ops in order"),
        (lambda d: d["ranks"]["0"]["segments"][0].__setitem__(2, 0), "window k must be an integer from 1"),
        (lambda d: d.update(num_ranks=3), "`family` is for 3 ranks; the Program has 4"),
        (lambda d: d["ranks"].update({"9": d["ranks"]["0"]}), "keyed by rank numbers 0 to 3"),
        (lambda d: d.pop("nccl"), "`family` must hold num_ranks, ranks and nccl"),
    ],
)
def test_a_malformed_family_is_E501_at_its_line(tmp_path, edit, message):
    text, line = _text_with(_compile(tmp_path, "window 3 prefer depth"), edit)
    with pytest.raises(PipecError) as e:
        pf.from_text(text, "p.txt")
    assert e.value.code == "E501" and message in str(e.value)
    assert e.value.span.line == line


def test_a_family_that_does_not_hold_is_E502_at_its_line(tmp_path):
    prog = _compile(tmp_path, "window 3 prefer depth")
    assert prog.family.nccl  # a window over F and B reorders the channels to the neighbours

    def unsafe(d):
        d["nccl"] = None  # claims NCCL can run it: a run would hang

    text, line = _text_with(prog, unsafe)
    with pytest.raises(PipecError) as e:
        pf.from_text(text, "p.txt")
    assert e.value.code == "E502" and "says NCCL can run it" in str(e.value) and e.value.span.line == line

    def short(d):
        d["ranks"]["1"]["segments"][-1][1] -= 1  # covers one op fewer than the rank has

    text, line = _text_with(prog, short)
    with pytest.raises(PipecError) as e:
        pf.from_text(text, "p.txt")
    assert e.value.code == "E502" and "rank 1's order family covers 15 ops, but the rank has 16" in str(e.value)
    doc = json.loads(pf.to_json(prog))
    doc["family"]["nccl"] = None
    with pytest.raises(PipecError) as e:
        pf.from_json(json.dumps(doc), "p.json")
    assert e.value.code == "E502"


def test_a_family_needs_version_3(tmp_path):
    text = pf.to_text(_compile(tmp_path, "window 3")).replace("pipec-program 3\n", "pipec-program 1\n", 1)
    with pytest.raises(PipecError) as e:
        pf.from_text(text, "p.txt")
    assert e.value.code == "E501" and "needs format version 3, not 1" in str(e.value)
    plain = pf.to_text(pipec.compile("1f1b", p=4, m=8)).replace("pipec-program 1\n", "pipec-program 3\n", 1)
    with pytest.raises(PipecError, match="needs `buffers`, its buffer plan, or `family`"):
        pf.from_text(plain, "p.txt")


def test_programs_that_differ_only_in_their_family_are_not_equal(tmp_path):
    """Equality sees the order family: the same instructions with a family that reorders and without one are
    two Programs (a runner would run them differently); a static family is no family."""
    from dataclasses import replace

    from pipec.ir.family import OrderFamily

    prog = _compile(tmp_path, "window 2")
    assert prog.family is not None and not prog.family.is_static
    assert replace(prog, family=None) != prog
    assert replace(prog, family=None) == replace(prog, family=OrderFamily((None,) * prog.num_ranks))
    assert pf.from_json(pf.to_json(prog)) == prog
    # a rank whose family is static is a rank without one (the file reads it back as none)
    from pipec.ir.family import RankFamily

    n = prog.family.ranks[0].num_ops
    static, none = list(prog.family.ranks), list(prog.family.ranks)
    static[0], none[0] = RankFamily(((0, n, 1),)), None
    a, b = (
        replace(prog, family=replace(prog.family, ranks=tuple(static))),
        replace(prog, family=replace(prog.family, ranks=tuple(none))),
    )
    assert a.family.ranks != b.family.ranks and a == b and a != prog
