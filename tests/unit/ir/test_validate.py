"""`validate(program)`: each structural rule of the instruction table refuses the Program that breaks it,
every library Program passes, and the readers and the dry run call it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repo import ROOT

from pipec.api import load
from pipec.errors import PipecError
from pipec.formats.program_file import from_json, from_text, to_json, to_text
from pipec.ir.opcodes import BY_NAME, GROUP_MAX, OPCODES, TABLE
from pipec.ir.program import Program, RankProgram
from pipec.ir.validate import validate
from pipec.passes.dryrun import dry_run
from pipec.passes.lower import lower


def _prog(name: str = "1f1b", **params: int) -> Program:
    return lower(load(name, **(params or {"p": 2, "m": 3})))


def _edit(prog: Program, rank: int, **cols: np.ndarray) -> Program:
    ranks = list(prog.ranks)
    ranks[rank] = dataclasses.replace(ranks[rank], **cols)
    return dataclasses.replace(prog, ranks=tuple(ranks))


def _drop(prog: Program, rank: int, j: int) -> Program:
    rp = prog.ranks[rank]
    keep = np.arange(len(rp)) != j
    return _edit(prog, rank, **{f: getattr(rp, f)[keep] for f in ("op", "mb", "stage", "peer", "group")})


def _find(prog: Program, rank: int, op: str) -> int:
    return int(np.flatnonzero(prog.ranks[rank].op == OPCODES.index(op))[0])


def _message(prog: Program) -> str:
    with pytest.raises(PipecError) as info:
        validate(prog)
    assert info.value.code == "E502"
    return str(info.value)


def test_library_programs_are_valid():
    for name, params in [
        ("1f1b", {"p": 4, "m": 8}),
        ("zb-v", {"p": 4, "m": 8}),
        ("dualpipe-v", {"p": 4, "m": 10}),
        ("interleaved-1f1b", {"p": 4, "v": 2, "m": 8}),
    ]:
        assert validate(_prog(name, **params)) is None


def test_a_missing_step_is_refused():
    prog = _prog()
    assert "stage 1 has 0 STEP" in _message(_drop(prog, 1, _find(prog, 1, "STEP")))


def test_a_missing_backward_is_refused():
    prog = _prog()
    assert "never happens" in _message(_drop(prog, 0, _find(prog, 0, "BWD")))


@pytest.mark.parametrize(
    "name,params", [("1f1b", {"p": 2, "m": 3}), ("zb-v", {"p": 2, "m": 4}), ("dualpipe-v", {"p": 4, "m": 8})]
)
def test_the_forward_only_program_is_valid_and_proven(name, params):
    from pipec.passes.lower import forward_program

    prog = _prog(name, **params)
    fwd = forward_program(prog)
    assert fwd.forward_only and dry_run(fwd).completed
    ops = {OPCODES[o] for rp in fwd.ranks for o in rp.op.tolist()}
    assert ops <= {"FWD", "SEND_ACT", "RECV_ACT"}
    for r, rp in enumerate(fwd.ranks):  # each rank's FWDs in the training Program's order
        train = prog.ranks[r]
        is_f = train.op == OPCODES.index("FWD")
        assert np.array_equal(rp.mb[rp.op == OPCODES.index("FWD")], train.mb[is_f])
    # the training Program's backward, gradients and steps do not belong in it
    with pytest.raises(PipecError, match=r"has 1 STEP instructions; it needs none \(the program is forward only"):
        validate(dataclasses.replace(prog, forward_only=True))
    steps = [np.isin(rp.op, [OPCODES.index("STEP"), OPCODES.index("REDUCE_GRAD")]) for rp in prog.ranks]
    no_steps = dataclasses.replace(
        prog,
        forward_only=True,
        ranks=tuple(
            RankProgram(*(getattr(rp, f)[~k] for f in ("op", "mb", "stage", "peer", "group")))
            for rp, k in zip(prog.ranks, steps)
        ),
    )
    with pytest.raises(PipecError, match="a backward in a forward-only program"):
        validate(no_steps)
    with pytest.raises(PipecError, match="0 STEP instructions; it needs exactly one"):  # a training Program's rules
        validate(dataclasses.replace(fwd, forward_only=False))


def test_an_op_twice_is_refused():
    prog = _prog()
    rp = prog.ranks[0]
    j = _find(prog, 0, "FWD")
    twice = _edit(prog, 0, mb=np.where(np.arange(len(rp)) == j + 2, rp.mb[j], rp.mb))  # FWD 1 0 becomes FWD 0 0
    assert rp.op[j + 2] == rp.op[j]
    assert "already executed" in _message(twice)


def test_a_wrong_peer_is_refused():
    prog = _prog("1f1b", p=3, m=3)
    rp = prog.ranks[0]
    j = _find(prog, 0, "SEND_ACT")
    bad = _edit(prog, 0, peer=np.where(np.arange(len(rp)) == j, 2, rp.peer))
    assert "the peer must be rank 1 (the owner of stage 1)" in _message(bad)


def test_a_stage_on_another_rank_is_refused():
    prog = _prog()
    rp = prog.ranks[0]
    j = _find(prog, 0, "FWD")
    bad = _edit(prog, 0, stage=np.where(np.arange(len(rp)) == j, 1, rp.stage))
    assert "stage 1 is placed on rank 1" in _message(bad)


def test_a_group_of_three_is_refused():
    prog = _prog()
    rp = prog.ranks[0]
    j = int(np.flatnonzero(rp.group)[0])  # a batched exchange: SEND_ACT 1 0 1 & RECV_GRAD 0 0 1
    assert str(rp.instructions()[j]) == "SEND_ACT 1 0 1 &"
    bad = _edit(prog, 0, group=np.where(np.arange(len(rp)) == j + 1, True, rp.group))
    assert f"at most {GROUP_MAX}" in _message(bad)


def test_a_compute_cannot_group_with_a_transfer():
    prog = _prog()
    rp = prog.ranks[0]
    j = _find(prog, 0, "FWD")
    assert OPCODES[rp.op[j + 1]] == "SEND_ACT"
    assert "cannot be grouped" in _message(_edit(prog, 0, group=np.where(np.arange(len(rp)) == j, True, rp.group)))


def test_a_message_never_received_is_refused():
    prog = _prog()
    assert "is never received" in _message(_drop(prog, 1, _find(prog, 1, "RECV_ACT")))


def test_an_unknown_opcode_and_bad_operands_are_refused():
    prog = _prog()
    rp = prog.ranks[0]
    assert "no such opcode" in _message(_edit(prog, 0, op=np.where(np.arange(len(rp)) == 0, 99, rp.op)))
    assert "micro-batch outside" in _message(_edit(prog, 0, mb=np.where(np.arange(len(rp)) == 0, 7, rp.mb)))
    step = _find(prog, 0, "STEP")
    assert "takes no peer" in _message(_edit(prog, 0, peer=np.where(np.arange(len(rp)) == step, 1, rp.peer)))


def test_a_bad_header_is_refused():
    prog = _prog()
    assert "placement" in _message(dataclasses.replace(prog, placement=(0,)))
    assert "not one of the 2 ranks" in _message(dataclasses.replace(prog, placement=(0, 5)))
    assert "micro-batches" in _message(dataclasses.replace(prog, num_microbatches=0))


def test_step_before_the_last_compute_is_refused():
    prog = _prog()
    rp = prog.ranks[0]
    step = _find(prog, 0, "STEP")
    order = np.r_[step, np.delete(np.arange(len(rp)), step)]
    moved = _edit(prog, 0, **{f: getattr(rp, f)[order] for f in ("op", "mb", "stage", "peer", "group")})
    assert "before its last compute" in _message(moved)


def test_the_text_reader_points_at_the_line():
    text = to_text(_prog()).replace("SEND_ACT 0 0 1", "SEND_ACT 0 0 0", 1)
    with pytest.raises(PipecError) as info:
        from_text(text, "x.txt")
    assert info.value.code == "E502"
    assert text.splitlines()[info.value.span.line - 1] == "SEND_ACT 0 0 0"


def test_the_json_reader_and_the_dry_run_validate():
    prog = _prog()
    bad = _drop(prog, 1, _find(prog, 1, "STEP"))
    for call in (lambda: from_json(to_json(bad)), lambda: dry_run(bad)):
        with pytest.raises(PipecError) as info:
            call()
        assert info.value.code == "E502"


def test_every_opcode_reads_back_from_its_text():
    """The text form writes the operands the table lists, and reads them back."""
    for code, row in enumerate(TABLE):
        rp = RankProgram(*(np.array([v], dtype=np.int64) for v in (code, 1, 2, 3)), np.array([False]))
        words = str(rp.instructions()[0]).split()
        assert words[0] == row.name and len(words) == 1 + len(BY_NAME[row.name].operands)


def test_operands_are_listed_in_the_order_the_writers_use():
    """The vectorised text writer lays out mb, stage, peer in that order: every row lists a subset so."""
    for row in TABLE:
        assert list(row.operands) == [x for x in ("mb", "stage", "peer") if x in row.operands]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_single_deletion_is_refused(data):
    """Deleting any one instruction from a valid Program makes it invalid (every instruction is needed)."""
    prog = _prog("zb-h1", p=3, m=4)
    r = data.draw(st.integers(0, prog.num_ranks - 1))
    j = data.draw(st.integers(0, len(prog.ranks[r]) - 1))
    with pytest.raises(PipecError) as info:
        validate(_drop(prog, r, j))
    assert info.value.code == "E502"


def test_the_docs_list_every_opcode_as_the_table_declares_it():
    """docs/program.md's instruction list is the table's, row by row (operands and meaning)."""

    doc = (ROOT / "docs" / "program.md").read_text()
    rows = [line for line in doc.split("## Instructions")[1].split("\n## ")[0].splitlines() if line.startswith("| `")]
    listed = [(cells[1].strip("` ").split()[0], cells[3].strip()) for cells in (r.split("|") for r in rows)]
    assert listed == [(row.name, row.doc) for row in TABLE]
    for r in rows:
        words = r.split("|")[1].strip("` ").split()
        assert len(words) == 1 + len(BY_NAME[words[0]].operands)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_one_pass_over_all_ranks_never_passes_what_the_walk_over_ranks_refuses(data):
    """`_plainly_sound` (one pass over every rank's instructions at once) decides plain Programs without
    the walk over ranks; it must say False wherever `_rank_problems` finds anything, for any corruption of
    one or two instructions: an opcode, an operand or a group flag changed, an instruction dropped, two
    near ones swapped."""
    from pipec.ir.validate import _plainly_sound, _rank_problems

    name, params = data.draw(
        st.sampled_from(
            [
                ("1f1b", {"p": 3, "m": 4}),
                ("zb-h1", {"p": 3, "m": 4}),
                ("interleaved-1f1b", {"p": 2, "v": 2, "m": 4}),
                ("dualpipe-v", {"p": 2, "m": 4}),
                ("gpipe", {"p": 2, "m": 2}),
            ]
        )
    )
    prog = _prog(name, **params)
    assert _plainly_sound(prog) and not _rank_problems(prog)
    for _ in range(data.draw(st.integers(1, 2))):
        r = data.draw(st.integers(0, prog.num_ranks - 1))
        rp = prog.ranks[r]
        j = data.draw(st.integers(0, len(rp) - 1))
        col = data.draw(st.sampled_from(["op", "mb", "stage", "peer", "group", "drop", "swap", "swap"]))
        if col == "drop":
            prog = _drop(prog, r, j)
            continue
        if col == "swap":  # two instructions of the rank change places (the tail's REDUCE_GRADs and STEPs too)
            k = data.draw(st.integers(max(j - 3, 0), min(j + 3, len(rp) - 1)))
            order = np.arange(len(rp))
            order[[j, k]] = order[[k, j]]
            prog = _edit(prog, r, **{f: getattr(rp, f)[order] for f in ("op", "mb", "stage", "peer", "group")})
            continue
        values = getattr(rp, col).copy()
        if col == "group":
            values[j] = not values[j]
        else:
            values[j] = data.draw(st.integers(-2, len(TABLE) + 1 if col == "op" else 6))
        prog = _edit(prog, r, **{col: values})
    if _rank_problems(prog):
        assert not _plainly_sound(prog)
