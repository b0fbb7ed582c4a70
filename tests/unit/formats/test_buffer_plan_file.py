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


def test_compile_buffers_recv_ahead_plans_longer_receive_lives(tmp_path):
    """`pipec compile --buffers --recv-ahead N` carries a plan for receives posted N ahead (gloo's runtime):
    each received tensor is born earlier, so the plan holds more slots; `pipec check --memory` says it."""
    from cli_helpers import run_cli

    docs = {}
    for ahead in (0, 4):
        out = tmp_path / f"a{ahead}.json"
        rc, _, err = run_cli(
            "compile", "1f1b", "-D", "p=4", "-D", "m=8", "--buffers", "--recv-ahead", str(ahead), "-o", str(out)
        )
        assert rc == 0, err
        docs[ahead] = json.loads(out.read_text())
        assert docs[ahead]["buffers"]["ahead"] == ahead
        assert pf.from_json(out.read_text()).buffers.ahead == ahead
    plans = {a: pipec.read_program(str(tmp_path / f"a{a}.json")).buffers for a in docs}
    for r in range(4):  # every rank receives: its receives live longer, so it needs more slots and bytes
        assert plans[4].ranks[r].slots > plans[0].ranks[r].slots
        assert plans[4].ranks[r].amount() > plans[0].ranks[r].amount()
    rc, text, _ = run_cli("check", str(tmp_path / "a4.json"), "--memory")
    assert rc == 0 and "buffer plan (the Program's), receives posted 4 ahead:" in text
    rc, text, _ = run_cli("check", "1f1b", "-D", "p=4", "-D", "m=8", "--memory", "--recv-ahead", "2")
    assert rc == 0 and "buffer plan, receives posted 2 ahead:" in text
    rc, _, err = run_cli("compile", "1f1b", "-D", "p=4", "-D", "m=8", "--buffers", "--recv-ahead", "-1")
    assert rc == 2 and "--recv-ahead" in err
    # nothing is dropped: without --buffers or --memory the flag is misuse
    rc, _, err = run_cli("compile", "1f1b", "-D", "p=4", "-D", "m=8", "--recv-ahead", "4")
    assert rc == 2 and "give --buffers too" in err
    rc, _, err = run_cli("check", "1f1b", "-D", "p=4", "-D", "m=8", "--recv-ahead", "4")
    assert rc == 2 and "give --memory too" in err


def test_a_program_file_s_plan_is_kept_unless_another_recv_ahead_is_asked_for(tmp_path):
    """A Program file carrying a plan for 0 receives ahead: `--buffers` alone keeps it; `--recv-ahead 4` plans
    again for 4 (the file written says 4), and `pipec check --memory --recv-ahead 4` shows the plan made here,
    saying the Program's is for 0. The API does the same."""
    from cli_helpers import run_cli

    carried = tmp_path / "p0.json"
    assert run_cli("compile", "1f1b", "-D", "p=4", "-D", "m=8", "--buffers", "-o", str(carried))[0] == 0
    for extra, ahead in (((), 0), (("--recv-ahead", "0"), 0), (("--recv-ahead", "4"), 4)):
        out = tmp_path / "again.json"
        rc, _, err = run_cli("compile", str(carried), "--buffers", *extra, "-o", str(out))
        assert rc == 0, err
        assert json.loads(out.read_text())["buffers"]["ahead"] == ahead, extra
    rc, text, _ = run_cli("check", str(carried), "--memory", "--recv-ahead", "4")
    assert (
        rc == 0 and "buffer plan (made here: the Program's is for 0 receives posted ahead), receives posted 4" in text
    )
    rc, text, _ = run_cli("check", str(carried), "--memory")
    assert rc == 0 and "buffer plan (the Program's):" in text
    prog = pipec.read_program(str(carried))
    assert pipec.compile(prog, buffers=True).buffers is prog.buffers
    assert pipec.compile(prog, buffers=True, recv_ahead=4).buffers.ahead == 4


def test_the_api_plans_for_receives_posted_ahead_and_wants_buffers_for_it():
    assert pipec.compile("1f1b", p=4, m=8, buffers=True, recv_ahead=3).buffers.ahead == 3
    assert pipec.compile("1f1b", p=4, m=8, buffers=True).buffers.ahead == 0
    with pytest.raises(ValueError, match="give buffers=True too"):
        pipec.compile("1f1b", p=4, m=8, recv_ahead=3)
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="recv_ahead must be an integer >= 0"):
            pipec.compile("1f1b", p=4, m=8, buffers=True, recv_ahead=bad)
