"""Program files with a buffer plan (format version 3, docs/program.md): written only when a Program carries a plan,
read back equal in both forms (with and without a stage graph), proven on reading (E502), malformed plans E501;
a Program without a plan is written as before (version 1, or 2 with a graph)."""

from __future__ import annotations

import json

import pytest

import pipec
from pipec.errors import PipecError
from pipec.formats import program_file as pf


@pytest.fixture(scope="module")
def planned():
    return pipec.compile("zb-v", p=2, m=4, buffers=True)


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "1f1b-offload", "terapipe", "dualpipe-v"])
def test_a_plan_reads_back_equal_in_both_forms(name):
    prog = pipec.compile(name, p=2, m=4, buffers=True)
    for write, read in ((pf.to_json, pf.from_json), (pf.to_text, pf.from_text)):
        text = write(prog)
        assert text.startswith('{"format":"pipec-program","version":3') or text.startswith("pipec-program 3\n")
        back = read(text)
        assert back == prog and back.buffers == prog.buffers


def test_a_program_without_a_plan_keeps_its_version_and_bytes():
    prog = pipec.compile("zb-v", p=2, m=4)
    assert pf.to_text(prog).startswith("pipec-program 1\n") and "buffers" not in pf.to_text(prog)
    assert pf.to_json(pipec.compile("zb-v", p=2, m=4, buffers=True)) != pf.to_json(prog)


def test_a_graph_program_with_a_plan_is_version_3_with_its_edges(tmp_path):
    skips = "\n    edge s -> if s < p - 1 then s + 1 else -1\n    edge s -> if s < p / 2 - 1 then p - 1 - s else -1"
    src = pipec.load("1f1b", p=4, m=4).source.text.replace("    stages p", "    stages p" + skips, 1)
    path = tmp_path / "g.pipe"
    path.write_text(src)
    plain = pipec.compile(str(path), p=4, m=4)
    assert plain.graph is not None and pf.to_text(plain).startswith("pipec-program 2\n")
    prog = pipec.compile(str(path), p=4, m=4, buffers=True)
    text = pf.to_text(prog)
    assert text.startswith("pipec-program 3\n") and "\nedges " in text
    assert pf.from_text(text) == prog and pf.from_json(pf.to_json(prog)) == prog


def test_a_plan_that_does_not_hold_is_E502_on_reading(planned):
    doc = json.loads(pf.to_json(planned))
    rank = doc["buffers"]["ranks"][1]
    pool = next(k for k, p in enumerate(rank["pools"]) if p[5] > 1)
    for row in rank["tensors"]:
        if row[0] == pool:
            row[2] = 0
    with pytest.raises(PipecError) as e:
        pf.from_json(json.dumps(doc), "p.json")
    assert e.value.code == "E502" and "buffer plan does not hold on rank 1" in str(e.value)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d.update(version=1), "`buffers` (a buffer plan) needs format version 3, not 1"),
        (lambda d: d.pop("buffers"), "a version 3 Program needs `buffers`"),
        (lambda d: d["buffers"]["ranks"].pop(), "`buffers` needs one entry per rank (2)"),
        (lambda d: d["buffers"]["ranks"][0]["pools"][0].__setitem__(0, "weights"), "unknown tensor kind 'weights'"),
        (lambda d: d["buffers"]["ranks"][0]["tensors"][0].__setitem__(0, 99), "out of range"),
        (lambda d: d["buffers"]["ranks"][0]["tensors"][0].__setitem__(2, 1.5), "three integers"),
        (lambda d: d["buffers"]["ranks"][0]["pools"][0].__setitem__(6, -1), "finite number >= 0"),
    ],
)
def test_a_malformed_plan_is_E501(planned, damage, message):
    doc = json.loads(pf.to_json(planned))
    damage(doc)
    with pytest.raises(PipecError) as e:
        pf.from_json(json.dumps(doc), "p.json")
    assert e.value.code == "E501" and message in str(e.value), str(e.value)


def test_buffers_in_a_version_1_text_file_is_E501(planned):
    text = pf.to_text(planned).replace("pipec-program 3\n", "pipec-program 1\n", 1)
    with pytest.raises(PipecError) as e:
        pf.from_text(text, "p.txt")
    assert e.value.code == "E501" and "needs format version 3, not 1" in str(e.value)
