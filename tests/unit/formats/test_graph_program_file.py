"""Program files of a stage graph (issue 42): format version 2, in both forms.

A Program with a graph is written as version 2: the head carries its edges, each rank its `other` column
(the JSON form's sixth column, the text form's last operand of a transfer). A chain Program is still
version 1. Both readers read both versions, and a damaged version 2 file is E501, never a traceback.
The Program here is built by hand (three stages on three ranks, the skip 0 -> 2 beside the chain), so
these tests do not lean on the lowering or the dry run of graphs."""

from __future__ import annotations

import json

import numpy as np
import pytest

import pipec
from pipec.errors import PipecError
from pipec.formats import program_file as pf
from pipec.ir.graph import StageGraph
from pipec.ir.opcodes import BY_NAME
from pipec.ir.program import Instr, Program, RankProgram

# Per rank, `NAME operands... [other] [&]`, as the lowering of 1f1b-like F then B over 0->1, 0->2, 1->2
# gives it (two micro-batches).
LISTING = [
    """FWD 0 0 | SEND_ACT 0 0 1 1 | SEND_ACT 0 0 2 2 | FWD 1 0 | SEND_ACT 1 0 1 1 | SEND_ACT 1 0 2 2 &
    | RECV_GRAD 0 0 2 2 | RECV_GRAD 0 0 1 1 | RECV_GRAD 1 0 2 2 | BWD 0 0 | RECV_GRAD 1 0 1 1 | BWD 1 0
    | REDUCE_GRAD 0 | STEP 0""",
    """RECV_ACT 0 1 0 0 | RECV_ACT 1 1 0 0 | FWD 0 1 | SEND_ACT 0 1 2 2 | FWD 1 1 | SEND_ACT 1 1 2 2 &
    | RECV_GRAD 0 1 2 2 | BWD 0 1 | SEND_GRAD 0 1 0 0 | RECV_GRAD 1 1 2 2 | BWD 1 1 | SEND_GRAD 1 1 0 0
    | REDUCE_GRAD 1 | STEP 1""",
    """RECV_ACT 0 2 0 0 | RECV_ACT 1 2 0 0 | RECV_ACT 0 2 1 1 | RECV_ACT 1 2 1 1 | FWD 0 2 | FWD 1 2 | BWD 0 2
    | SEND_GRAD 0 2 0 0 | SEND_GRAD 0 2 1 1 | BWD 1 2 | SEND_GRAD 1 2 0 0 | SEND_GRAD 1 2 1 1
    | REDUCE_GRAD 2 | STEP 2""",
]


def _instr(line: str) -> Instr:
    words = line.split()
    group = words[-1] == "&"
    words = words[:-1] if group else words
    operands = BY_NAME[words[0]].operands
    vals = dict(zip(operands, map(int, words[1:])))
    other = int(words[1 + len(operands)]) if len(words) > 1 + len(operands) else -1
    return Instr(words[0], vals.get("mb", -1), vals.get("stage", -1), vals.get("peer", -1), group, other)


def _rank(listing: str) -> RankProgram:
    instrs = [_instr(x) for x in listing.split("|")]
    rp = RankProgram.from_instructions(instrs)
    other = np.array([i.other for i in instrs], dtype=np.int64)
    return RankProgram(rp.op, rp.mb, rp.stage, rp.peer, rp.group, other)


def graph_program() -> Program:
    return Program(
        name="skip",
        params=(("p", 3), ("m", 2)),
        num_stages=3,
        num_ranks=3,
        num_microbatches=2,
        split_backward=False,
        placement=(0, 1, 2),
        ranks=tuple(_rank(x) for x in LISTING),
        graph=StageGraph.of(3, [(0, 1), (0, 2), (1, 2)]),
    )


@pytest.fixture(scope="module")
def prog() -> Program:
    return graph_program()


def test_a_graph_program_round_trips_in_both_forms(prog):
    text, js = pf.to_text(prog), pf.to_json(prog)
    assert pf.from_text(text, "p.txt") == prog
    assert pf.from_json(js, "p.json") == prog
    back = pf.from_text(text)
    assert back.graph == prog.graph and back.graph.edges == ((0, 1), (0, 2), (1, 2))
    assert [rp.other.tolist() for rp in back.ranks] == [rp.other.tolist() for rp in prog.ranks]
    # and each form's reading writes the same file again
    assert pf.to_text(pf.from_json(js)) == text and pf.to_json(pf.from_text(text)) == js


def test_the_text_form_is_version_2_with_edges_and_other_on_transfers_only(prog):
    lines = pf.to_text(prog).splitlines()
    assert lines[0] == "pipec-program 2"
    assert "edges [[0,1],[0,2],[1,2]]" in lines
    assert "SEND_ACT 0 0 2 2" in lines  # stage 0 sends micro-batch 0 to rank 2 over the edge 0 -> 2
    assert "RECV_GRAD 0 1 2 2" in lines  # stage 1 receives its output's gradient from stage 2
    assert "FWD 0 0" in lines and "REDUCE_GRAD 0" in lines  # non-transfers unchanged: no `other`
    assert lines[lines.index("rank 0") + 1 :][: len(LISTING[0].split("|"))] == [
        " ".join(x.split()) for x in LISTING[0].split("|")
    ]


def test_the_json_form_is_version_2_with_an_other_column(prog):
    doc = json.loads(pf.to_json(prog))
    assert doc["version"] == 2 and doc["edges"] == [[0, 1], [0, 2], [1, 2]]
    rank0 = doc["ranks"][0]
    assert rank0["columns"] == ["op", "mb", "stage", "peer", "group", "other"]
    assert [row[5] for row in rank0["instructions"]] == prog.ranks[0].other.tolist()
    assert rank0["instructions"][0] == [0, 0, 0, -1, False, -1]  # FWD 0 0
    assert rank0["instructions"][2] == [4, 0, 0, 2, False, 2]  # SEND_ACT 0 0 2 2


def test_write_and_read_program_take_a_graph_program_in_both_forms(prog, tmp_path):
    for name in ("g.json", "g.txt"):
        pipec.write_program(prog, str(tmp_path / name))
        assert pipec.read_program(str(tmp_path / name)) == prog


def test_a_rank_without_an_other_column_is_written_with_minus_ones(prog):
    """A hand-built graph Program whose rank has no transfers may hold `other=None`: written as -1s."""
    rp = prog.ranks[0]
    bare = RankProgram(rp.op[:1], rp.mb[:1], rp.stage[:1], rp.peer[:1], rp.group[:1])
    one = Program("one", (), 1, 1, 1, False, (0,), (bare,), graph=StageGraph.of(1, []))
    doc = json.loads(pf.to_json(one))
    assert doc["ranks"][0]["instructions"] == [[0, 0, 0, -1, False, -1]]
    assert pf.to_text(one).splitlines()[:5][-1] == "edges []"


def test_a_chain_program_is_still_version_1_without_edges_or_other():
    chain = pipec.compile("1f1b", p=2, m=3)
    assert chain.graph is None
    text, doc = pf.to_text(chain), json.loads(pf.to_json(chain))
    assert text.startswith("pipec-program 1\n") and "edges" not in text
    assert doc["version"] == 1 and "edges" not in doc
    assert doc["ranks"][0]["columns"] == ["op", "mb", "stage", "peer", "group"]
    assert pf.from_text(text) == chain and pf.from_text(text).ranks[0].other is None


def _refused(text: str, path: str) -> str:
    with pytest.raises(PipecError) as e:
        pf.parse_program(text, path)
    assert e.value.code == "E501", e.value
    assert "this is not a valid Program file" in str(e.value)
    return str(e.value)


def _json_doc(prog) -> dict:
    return json.loads(pf.to_json(prog))


def _json_damaged(prog, change) -> str:
    doc = _json_doc(prog)
    change(doc)
    return json.dumps(doc)


JSON_DAMAGE = {
    "no edges": (lambda d: d.pop("edges"), "a version 2 Program needs `edges`"),
    "edge back": (lambda d: d.update(edges=[[0, 1], [1, 2], [2, 0]]), "edge 2 -> 0 goes back"),
    "edge out of range": (lambda d: d.update(edges=[[0, 1], [1, 2], [1, 7]]), "edge 1 -> 7 names a stage outside"),
    "edge twice": (lambda d: d.update(edges=[[0, 1], [1, 2], [0, 1]]), "edge 0 -> 1 is declared twice"),
    "stage without outputs": (lambda d: d.update(edges=[[1, 2]]), "stage 0 has no outputs"),
    "edges not pairs": (lambda d: d.update(edges=[[0, 1, 2]]), "`edges` must be a list of"),
    "edges of bools": (lambda d: d.update(edges=[[False, True], [True, 2]]), "`edges` must be a list of"),
    "edges not a list": (lambda d: d.update(edges={"0": 1}), "`edges` must be a list of"),
    "no other column": (
        lambda d: [
            r.update(columns=r["columns"][:5], instructions=[x[:5] for x in r["instructions"]]) for r in d["ranks"]
        ],
        "a version 2 Program's columns must be ['op', 'mb', 'stage', 'peer', 'group', 'other']",
    ),
    "rows of five": (
        lambda d: d["ranks"][1].update(instructions=[x[:5] for x in d["ranks"][1]["instructions"]]),
        "each instruction must be a row of six integers [op, mb, stage, peer, group, other]",
    ),
    "other on a FWD": (
        lambda d: d["ranks"][0]["instructions"][0].__setitem__(5, 1),
        "rank 0, instruction #0: `other` is 1 on FWD, which is not a transfer",
    ),
    "other as a float": (lambda d: d["ranks"][0]["instructions"][1].__setitem__(5, 1.5), "six integers"),
    "edges in version 1": (lambda d: d.update(version=1), "`edges` (a stage graph) needs format version 2, not 1"),
    "version 4": (
        lambda d: d.update(version=4),
        "program format version 4 is not supported (this pipec reads 1, 2 and 3)",
    ),
}


@pytest.mark.parametrize("case", sorted(JSON_DAMAGE))
def test_a_damaged_version_2_json_program_is_E501(prog, case):
    change, said = JSON_DAMAGE[case]
    assert said in _refused(_json_damaged(prog, change), "g.json")


def _text_damaged(prog, old: str, new: str) -> str:
    text = pf.to_text(prog)
    assert old in text, old
    return text.replace(old, new, 1)


TEXT_DAMAGE = {
    "no edges line": (
        "edges [[0,1],[0,2],[1,2]]\n",
        "",
        5,
        "a version 2 Program needs an `edges [[from, to], ...]` line",
    ),
    "edge back": ("edges [[0,1],", "edges [[1,0],", 5, "edge 1 -> 0 goes back"),
    "edge out of range": ("[1,2]]", "[1,3]]", 5, "edge 1 -> 3 names a stage outside 0..2"),
    "stage without outputs": ("edges [[0,1],[0,2],[1,2]]", "edges [[0,2]]", 5, "stage 1 has no outputs"),
    "edges not JSON": ("edges [[0,1],[0,2],[1,2]]", "edges 0->1 0->2", 5, "malformed program text"),
    "edges without a value": ("edges [[0,1],[0,2],[1,2]]", "edges", 5, "expected `edges VALUE`"),
    "transfer without other": (
        "SEND_ACT 0 0 2 2\n",
        "SEND_ACT 0 0 2\n",
        9,
        "`SEND_ACT` takes 4 number(s): mb, stage, peer, other",
    ),
    "other on a FWD": ("FWD 1 0\n", "FWD 1 0 1\n", 10, "`FWD` is not a transfer: it names no stage at the other end"),
    "other on a STEP": ("STEP 0\n", "STEP 0 2\n", 20, "`STEP` is not a transfer"),
    "edges in version 1": (
        "pipec-program 2\n",
        "pipec-program 1\n",
        5,
        "`edges` (a stage graph) needs format version 2, not 1",
    ),
    "version 4": ("pipec-program 2\n", "pipec-program 4\n", 1, "(this pipec reads 1, 2 and 3)"),
}


@pytest.mark.parametrize("case", sorted(TEXT_DAMAGE))
def test_a_damaged_version_2_text_program_is_E501_at_its_line(prog, case):
    old, new, line, said = TEXT_DAMAGE[case]
    text = _text_damaged(prog, old, new)
    with pytest.raises(PipecError) as e:
        pf.from_text(text, "g.txt")
    assert e.value.code == "E501" and said in str(e.value), e.value
    assert e.value.span is not None and e.value.span.line == line, e.value


def test_a_transfer_naming_no_edge_of_the_graph_is_E502_at_its_line(prog):
    """Well formed but wrong: SEND_ACT 0 0 2 naming stage 1 at the other end (rank 2 owns stage 2, and the
    edge 0 -> 1 leads to rank 1): validate's E502, located by the text reader."""
    text = _text_damaged(prog, "SEND_ACT 0 0 2 2\n", "SEND_ACT 0 0 2 1\n")
    with pytest.raises(PipecError) as e:
        pf.from_text(text, "g.txt")
    assert e.value.code == "E502" and e.value.span.line == 9, e.value
    assert "SEND_ACT 0 0 2 1" in str(e.value)


def test_a_program_file_of_a_graph_read_through_pipec_check_is_refused_cleanly(prog, tmp_path):
    """What the CLI prints for a damaged version 2 file: the E501 diagnostic, no traceback."""
    from cli_helpers import run_cli

    path = tmp_path / "g.txt"
    path.write_text(_text_damaged(prog, "edges [[0,1],", "edges [[1,0],"))
    rc, out, err = run_cli("check", str(path))
    assert rc == 1 and "error[E501]" in err and "goes back" in err and "Traceback" not in err
