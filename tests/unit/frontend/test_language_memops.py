"""Memory ops written in the language (issue 19, "recomputation and offload as ops", front end):
`RECOMPUTE(i)`, `OFFLOAD(i)` and `RELOAD(i)` in a rank block, the `recompute:` attribute of a forward and
its default placement, the checks E310/E311 (with E208/E209/E301/E308 for their stages and micro-batches),
the writer's round trip, the grid's marks, and the library's three memory-op schedules.

What a placed memory op means (`MemOp.before`: the ops of the rank emitted before it) is checked here
against the statements; lowering, memory and simulation of memory ops are other tests' business.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipec.api import load
from pipec.driver import build
from pipec.errors import PipecError, Source
from pipec.formats.torch_csv_reader import to_pipe
from pipec.frontend.load import compile_source
from pipec.ir.schedule import MemOp
from pipec.passes.checks import check_schedule
from pipec.view.grid import cells, format_grid

ONE_STAGE = """\
schedule "t" (p: int = 2, m: int = 3) {
    stages p
    place s -> s
    ops F, B
    rank r {
BODY
    }
}
"""

# Two ranks, two chunks each (stage c * p + r): GPipe over chunk 0 then chunk 1.
TWO_CHUNKS = """\
schedule "t" (p: int = 2, m: int = 2) {
    stages 2 * p
    place s -> s % p
    ops F, B
    rank r {
BODY
    }
}
"""

GPIPE = "        for i in 0 .. m { F(i) }\n        for i in 0 .. m { B(i) }"


def one_stage(body: str, **params: object):
    return build(Source("t.pipe", ONE_STAGE.replace("BODY", body)), params)


def two_chunks(body: str, **params: object):
    return build(Source("t.pipe", TWO_CHUNKS.replace("BODY", body)), params)


def placed(sched, rank: int) -> list[tuple[str, int, int, int]]:
    return [(x.op, x.mb, x.stage, x.before) for x in sched.memops[rank]]


def all_placed(sched) -> list[list[tuple[str, int, int, int]]]:
    return [placed(sched, r) for r in range(sched.num_ranks)] if sched.memops else []


def error_of(fn, *args, **kwargs):
    with pytest.raises(PipecError) as e:
        fn(*args, **kwargs)
    return e.value.diagnostics[0]


def index_of(sched, rank: int, kind: str, mb: int, stage: int) -> int:
    return next(j for j, o in enumerate(sched.ops(rank)) if (o.kind, o.mb, o.stage) == (kind, mb, stage))


# ---------------------------------------------------------------- statements


def test_before_counts_the_ops_emitted_so_far():
    s = one_stage(
        "        for i in 0 .. m { F(i)  OFFLOAD(i) }\n"
        "        RELOAD(0)  RELOAD(mb: 1)  RECOMPUTE(1)\n"
        "        for i in 0 .. m { if i > 1 { RELOAD(i) }  B(i) }"
    )
    for r in range(2):
        assert placed(s, r) == [
            ("OFFLOAD", 0, r, 1),
            ("OFFLOAD", 1, r, 2),
            ("OFFLOAD", 2, r, 3),
            ("RELOAD", 0, r, 3),
            ("RELOAD", 1, r, 3),
            ("RECOMPUTE", 1, r, 3),
            ("RELOAD", 2, r, 5),
        ]
    assert all(isinstance(x, MemOp) and x.span is not None for row in s.memops for x in row)
    assert s.memops[0][3].span.line == 7  # the statement that placed it


def test_stage_named_on_a_rank_of_several():
    s = two_chunks(
        "        for i in 0 .. m { F(i, stage: r) }\n"
        "        for i in 0 .. m { F(i, stage: p + r)  RECOMPUTE(i, stage: p + r) }\n"
        "        for i in 0 .. m { B(i, stage: p + r) }\n"
        "        for i in 0 .. m { RECOMPUTE(mb: i, stage: r)  B(i, stage: r) }"
    )
    assert placed(s, 1) == [
        ("RECOMPUTE", 0, 3, 3),
        ("RECOMPUTE", 1, 3, 4),
        ("RECOMPUTE", 0, 1, 6),
        ("RECOMPUTE", 1, 1, 7),
    ]


def test_memory_ops_from_functions_and_values():
    s = one_stage(
        "        def back(i) = RELOAD(i)\n"
        "        def away(i) { OFFLOAD(i) }\n"
        "        for i in 0 .. m { F(i)  away(i) }\n"
        "        for i in 0 .. m { back(i)  B(i) }"
    )
    assert [x[0] for x in placed(s, 0)] == ["OFFLOAD"] * 3 + ["RELOAD"] * 3


def test_a_schedule_without_memory_ops_keeps_the_plain_path():
    text = ONE_STAGE.replace("BODY", GPIPE)
    compiled = compile_source(Source("t.pipe", text))
    assert not compiled.memops and not compiled.recompute_sids
    assert "_mem" not in compiled.code and "_RC" not in compiled.code
    assert build(Source("t.pipe", text)).memops == ()
    # `recompute: false` is no recompute either.
    off = ONE_STAGE.replace("BODY", GPIPE.replace("F(i)", "F(i, recompute: false)"))
    assert not compile_source(Source("t.pipe", off)).recompute_sids
    assert build(Source("t.pipe", off)).memops == ()


# ---------------------------------------------------------------- recompute: and its default place


def test_recompute_attribute_places_a_recompute_just_before_the_backward():
    s = one_stage(
        "        let warm = min(p - 1 - r, m)\n"
        "        for i in 0 .. warm      { F(i, recompute: true) }\n"
        "        for i in 0 .. m - warm  { F(i + warm, recompute: true)  B(i) }\n"
        "        for i in m - warm .. m  { B(i) }"
    )
    for r in range(2):
        assert placed(s, r) == [("RECOMPUTE", i, r, index_of(s, r, "B", i, r)) for i in range(3)]
        assert s.memops[r][0].span.line == (7 if r == 0 else 8)  # the forward's statement


def test_recompute_attribute_on_next_forward_forms_and_op_values():
    s = two_chunks(
        "        def f0() = F(stage: r, recompute: true)\n"
        "        repeat m { f0() }\n"
        "        repeat m { F(stage: p + r, recompute: done(F, p + r) == 1) }\n"
        "        for i in 0 .. m { B(i, stage: p + r) }\n"
        "        for i in 0 .. m { B(i, stage: r) }"
    )
    for r in range(2):
        want = [("RECOMPUTE", 1, 2 + r, index_of(s, r, "B", 1, 2 + r))]
        want += [("RECOMPUTE", i, r, index_of(s, r, "B", i, r)) for i in range(2)]
        assert placed(s, r) == want


def test_recompute_attribute_is_conditional():
    s = one_stage("        for i in 0 .. m { F(i, recompute: i % 2 == 0) }\n        for i in 0 .. m { B(i) }")
    assert [x[1] for x in placed(s, 0)] == [0, 2]


def test_a_placed_recompute_replaces_the_default_one():
    s = one_stage(
        "        for i in 0 .. m { F(i, recompute: true) }\n        RECOMPUTE(2)\n        for i in 0 .. m { B(i) }"
    )
    assert placed(s, 0) == [("RECOMPUTE", 2, 0, 3), ("RECOMPUTE", 0, 0, 3), ("RECOMPUTE", 1, 0, 4)]


def test_default_recompute_goes_after_the_blocks_own_memory_ops_there():
    s = one_stage(
        "        for i in 0 .. m { F(i, recompute: true)  OFFLOAD(i) }\n        for i in 0 .. m { RELOAD(i)  B(i) }"
    )
    assert placed(s, 0)[3:5] == [("RELOAD", 0, 0, 3), ("RECOMPUTE", 0, 0, 3)]


# ---------------------------------------------------------------- diagnostics


@pytest.mark.parametrize(
    "body, code, line, col, says",
    [
        ("RECOMPUTE(0)\n" + GPIPE, "E310", 6, 9, "comes before F(0, stage 0)"),
        (GPIPE + "\nRECOMPUTE(1)", "E310", 8, 9, "comes after B(1, stage 0)"),
        ("OFFLOAD(0)  RELOAD(0)\n" + GPIPE, "E310", 6, 9, "OFFLOAD(0, stage 0) on rank 0 comes before F(0"),
        ("F(0)  RELOAD(0)  OFFLOAD(0)  F(1)  F(2)  B(0)  B(1)  B(2)", "E310", 6, 15, "comes before its OFFLOAD"),
        (
            "for i in 0 .. m { F(i)  OFFLOAD(i) }\nfor i in 0 .. m { B(i)  RELOAD(i) }",
            "E310",
            7,
            33,
            "RELOAD(0, stage 0) on rank 0 comes after B(0",
        ),
        (
            "for i in 0 .. m { F(i, recompute: true)  OFFLOAD(i) }\nRECOMPUTE(0)  RELOAD(0)\n"
            "for i in 1 .. m { RELOAD(i) }\nfor i in 0 .. m { B(i) }",
            "E310",
            7,
            23,
            "comes after RECOMPUTE(0, stage 0)",
        ),
        ("for i in 0 .. m { F(i)  OFFLOAD(i) }\nfor i in 0 .. m { B(i) }", "E311", 6, 33, "has no RELOAD"),
        ("for i in 0 .. m { F(i) }\nRELOAD(1)\nfor i in 0 .. m { B(i) }", "E311", 7, 9, "has no OFFLOAD"),
        (
            "for i in 0 .. m { F(i)  RECOMPUTE(i) }\nRECOMPUTE(0)\nfor i in 0 .. m { B(i) }",
            "E311",
            7,
            9,
            "placed twice on rank 0 (first at line 6)",
        ),
        ("for i in 0 .. m { F(i) }\nRECOMPUTE(0, stage: 0)\nfor i in 0 .. m { B(i) }", "E301", 7, 9, "on rank 1"),
        ("for i in 0 .. m { F(i) }\nRECOMPUTE(0, stage: 7)\nfor i in 0 .. m { B(i) }", "E208", 7, 9, "stage 7"),
        ("for i in 0 .. m { F(i) }\nRECOMPUTE(5)\nfor i in 0 .. m { B(i) }", "E209", 7, 9, "micro-batch 5"),
        ("for i in 0 .. m { F(i) }\nfor i in 0 .. m { B(i, recompute: true) }", "E105", 7, 32, "on a forward"),
        ("for i in 0 .. m { F(i)  OFFLOAD(i, rank: r) }", "E105", 6, 44, "no argument `rank`"),
        ("for i in 0 .. m { F(i, recompute: 1) }", "E103", 6, 43, "`recompute:` needs bool"),
        ("for i in 0 .. m { F(i) }\nRECOMPUTE()", "E102", 7, 9, "needs the micro-batch"),
        ("for i in 0 .. m { F(i) & RECOMPUTE(i) }", "E111", 6, 34, "cannot be overlapped"),
        ("let x = OFFLOAD\n" + GPIPE, "E103", 6, 17, "is a memory op"),
        ("let RELOAD = 1\n" + GPIPE, "E104", 6, 9, "built-in name"),
        ("if RECOMPUTE(0) == RECOMPUTE(1) { F(0) }", "E103", 6, 25, "cannot be compared"),
    ],
)
def test_located_diagnostics(body, code, line, col, says):
    text = "\n".join("        " + x if not x.startswith("        ") else x for x in body.splitlines())
    d = error_of(one_stage, text)
    assert (d.code, d.span.line, d.span.col) == (code, line, col), d.format()
    assert says in d.message, d.format()
    first, shown, caret = d.format().splitlines()[:3]
    assert first.startswith(f"t.pipe:{line}:{col}: error[{code}]:")
    assert shown.endswith(ONE_STAGE.replace("BODY", text).splitlines()[line - 1].lstrip()) or "..." in shown
    assert caret.strip().startswith("^")


def test_ambiguous_stage_is_E308():
    d = error_of(
        two_chunks,
        "        for i in 0 .. m { F(i, stage: r)  RECOMPUTE(i) }\n"
        "        for i in 0 .. m { F(i, stage: p + r) }\n"
        "        for i in 0 .. m { B(i, stage: p + r) }\n"
        "        for i in 0 .. m { B(i, stage: r) }",
    )
    assert (d.code, d.span.line, d.span.col) == ("E308", 6, 43)
    assert "RECOMPUTE(i, stage: s)" in d.message


def test_a_memory_op_outside_the_rank_block_is_E109():
    text = ONE_STAGE.replace("    ops F, B\n", "    ops F, B\n    RECOMPUTE(0)\n").replace("BODY", GPIPE)
    d = error_of(build, Source("t.pipe", text))
    assert (d.code, d.span.line) == ("E109", 5)


def test_checks_hold_for_schedules_built_otherwise():
    """A Schedule from `pipec import` or `pipec synth` goes through the same rules (no span: no caret)."""
    s = load("1f1b", p=2, m=2)
    bad = dataclasses.replace(s, memops=((MemOp("RELOAD", 0, 0, 1),), ()))
    with pytest.raises(PipecError) as e:
        check_schedule(bad)
    assert e.value.code == "E311"
    late = dataclasses.replace(s, memops=((MemOp("RECOMPUTE", 0, 0, len(s.ranks[0])),), ()))
    with pytest.raises(PipecError) as e:
        check_schedule(late)
    assert e.value.code == "E310"


# ---------------------------------------------------------------- the writer and the grid


@pytest.mark.parametrize(
    "name, params",
    [("1f1b-offload", dict(p=4, m=8, k=2, ahead=2)), ("zb-v-recompute", dict(p=3, m=6)), ("1f1b-recompute", {})],
)
def test_written_schedule_evaluates_to_the_same_memory_ops(name, params):
    s = load(name, **params)
    back = build(Source("w.pipe", to_pipe(s)))
    assert all_placed(back) == all_placed(s) and all_placed(s)
    assert [[str(o) for o in back.ops(r)] for r in range(s.num_ranks)] == [
        [str(o) for o in s.ops(r)] for r in range(s.num_ranks)
    ]
    assert "RECOMPUTE(" in to_pipe(s) or "OFFLOAD(" in to_pipe(s)


def test_grid_marks_memory_ops_in_the_cell_they_lead():
    s = one_stage("        for i in 0 .. m { F(i)  OFFLOAD(i) }\n        for i in 0 .. m { RELOAD(i)  B(i) }", m=2)
    assert cells(s, 0) == ["F0", "O0+F1", "O1+L0+B0", "L1+B1"]
    s = two_chunks(
        "        for i in 0 .. m { F(i, stage: r) }\n"
        "        for i in 0 .. m { F(i, stage: p + r, recompute: true) }\n"
        "        for i in 0 .. m { B(i, stage: p + r) }\n"
        "        for i in 0 .. m { B(i, stage: r) }"
    )
    assert cells(s, 1)[4:6] == ["R0.3+B0.3", "R1.3+B1.3"]
    assert "R0.3+B0.3" in format_grid(s).splitlines()[5]
    # After the rank's last op (only a hand-built Schedule has one there): a cell of its own.
    end = dataclasses.replace(s, memops=(s.memops[0], s.memops[1] + (MemOp("OFFLOAD", 1, 1, 8),)))
    assert cells(end, 1)[-1] == "O1.1"


# ---------------------------------------------------------------- the library


def test_1f1b_recompute_recomputes_every_forward_just_before_its_backward():
    s = load("1f1b-recompute", p=4, m=8)
    plain = load("1f1b", p=4, m=8)
    for r in range(4):
        assert [str(o) for o in s.ops(r)] == [str(o) for o in plain.ops(r)]
        assert placed(s, r) == sorted(
            (("RECOMPUTE", i, r, index_of(s, r, "B", i, r)) for i in range(8)), key=lambda x: x[3]
        )


def test_zb_v_recompute_recomputes_each_chunk_before_its_input_gradient():
    s = load("zb-v-recompute", p=4, m=8)
    plain = load("zb-v", p=4, m=8)
    for r in range(4):
        assert [str(o) for o in s.ops(r)] == [str(o) for o in plain.ops(r)]
        got = {(x.mb, x.stage): x.before for x in s.memops[r]}
        assert got == {(i, c): index_of(s, r, "B", i, c) for i in range(8) for c in (r, 7 - r)}


@pytest.mark.parametrize("k, ahead", [(4, 1), (2, 2), (1, 1)])
def test_1f1b_offload_offloads_exactly_the_far_forwards_and_reloads_ahead(k, ahead):
    p, m = 4, 8
    s = load("1f1b-offload", p=p, m=m, k=k, ahead=ahead)
    plain = load("1f1b", p=p, m=m)
    offloaded = 0
    for r in range(p):
        assert [str(o) for o in s.ops(r)] == [str(o) for o in plain.ops(r)]
        off = {x.mb: x.before for x in s.memops[r] if x.op == "OFFLOAD"} if s.memops else {}
        rel = {x.mb: x.before for x in s.memops[r] if x.op == "RELOAD"} if s.memops else {}
        for i in range(m):
            f, b = index_of(s, r, "F", i, r), index_of(s, r, "B", i, r)
            if b - f > k:
                assert off[i] == f + 1 and rel[i] == b - ahead, (r, i)
                offloaded += 1
            else:
                assert i not in off and i not in rel, (r, i)
    assert offloaded > 0
