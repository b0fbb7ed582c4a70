"""`window k [prefer NAME]` and `any { ... }` (docs/language.md, section 20): the family they make and
their located diagnostics; the proof's own (E429 channels on NCCL, E430 memory, E428 strict deadlock)."""

from __future__ import annotations

import pytest

from pipec.driver import build
from pipec.errors import PipecError, Source
from pipec.frontend import library
from pipec.passes.compiler import compile_schedule
from pipec.passes.family import family_memory, prove_family
from pipec.sim.memory import rank_memory

BASE = """\
schedule "t" (p: int = 2, m: int = 4) {{
    stages p
    ops F, B{w}
{decls}    rank r {{
{body}
    }}
}}
"""

ONE_F_ONE_B = """\
        let warm = min(p - 1 - r, m)
        for i in 0 .. warm      { F(i) }
        for i in 0 .. m - warm  { F(i + warm)  B(i) }
        for i in m - warm .. m  { B(i) }"""


def _build(body: str, w: str = "", decls: str = "", **params):
    text = BASE.format(w=w, decls=decls, body=body)
    return build(Source("t.pipe", text), {k: str(v) for k, v in params.items()})


def _error(body: str, **kw):
    with pytest.raises(PipecError) as info:
        _build(body, **kw)
    return info.value.diagnostics[0]


def test_a_window_gives_every_rank_one_segment():
    sched = _build("        window 2 prefer depth\n" + ONE_F_ONE_B)
    assert [f.segments for f in sched.family.ranks] == [((0, 8, 2),), ((0, 8, 2),)]
    assert sched.family.ranks[0].prefer == "depth"
    assert sched.family.ranks[0].span.line == 5
    assert sched.family.describe() == {
        "0": {"segments": [[0, 8, 2]], "prefer": "depth"},
        "1": {"segments": [[0, 8, 2]], "prefer": "depth"},
    }


def test_any_groups_are_segments_and_the_rest_keeps_its_window():
    body = "        window 1\n        F(0)\n        any { F(1)  F(2) }\n        F(3)\n        for i in 0 .. m { B(i) }"
    sched = _build(body)
    assert sched.family.ranks[0].segments == ((0, 1, 1), (1, 3, 2), (3, 8, 1))
    assert not sched.family.ranks[0].forced(1, 2) and sched.family.ranks[0].forced(0, 1)


def test_a_window_only_on_some_ranks():
    sched = _build("        if r == 1 { window 3 }\n" + ONE_F_ONE_B)
    assert sched.family.of(0) is None and sched.family.of(1).segments == ((0, 8, 3),)


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb-h1", "interleaved-1f1b"])
def test_schedules_without_a_family_stay_static(name):
    sched = build(library.read(name), {})
    assert sched.family is None


def test_window_one_is_the_static_order():
    assert _build("        window 1\n" + ONE_F_ONE_B).family is None


@pytest.mark.parametrize(
    ("body", "code", "line", "words"),
    [
        ("        window 9\n" + ONE_F_ONE_B, "E218", 5, "at most rank 0's stream of 8 ops"),
        ("        window 0\n" + ONE_F_ONE_B, "E218", 5, "at least 1"),
        ("        window 2\n        window 2\n" + ONE_F_ONE_B, "E218", 6, "given twice"),
        ("        window 2 prefer fastest\n" + ONE_F_ONE_B, "E219", 5, "unknown `prefer` policy `fastest`"),
        ("        any { any { F(0) } }\n" + ONE_F_ONE_B, "E219", 5, "inside another"),
        (
            "        window 2\n        F(0) & F(1)\n        for i in 2 .. m { F(i) }\n        for i in 0 .. m { B(i) }",
            "E219",
            5,
            "overlapped pairs",
        ),
        ("        window true\n" + ONE_F_ONE_B, "E103", 5, "`window`"),
    ],
)
def test_bad_families_are_located(body, code, line, words):
    d = _error(body)
    assert d.code == code, d.format()
    assert d.span.line == line and words in d.message, d.format()


def test_a_window_outside_a_rank_block():
    text = BASE.format(w="", decls="    window 2\n", body=ONE_F_ONE_B)
    with pytest.raises(PipecError) as info:
        build(Source("t.pipe", text), {})
    d = info.value.diagnostics[0]
    assert (d.code, d.span.line) == ("E109", 4) and "`window`" in d.message


def test_nccl_refuses_a_channel_reordered_gloo_takes_it():
    sched = _build("        window 2\n" + ONE_F_ONE_B)
    with pytest.raises(PipecError) as info:
        prove_family(sched, "nccl")
    d = info.value.diagnostics[0]
    assert d.code == "E429" and d.span.line == 5
    assert "rank 0 may run `F(1, stage 0)` before `F(0, stage 0)`" in d.message and "ranks 0 and 1" in d.message
    c = compile_schedule(sched)  # by key: accepted (an executor of ready ops never stalls); NCCL's reason kept
    assert c.program.family.nccl == d.message


def test_nccl_takes_a_family_that_moves_only_local_ops():
    # The W passes at the end in any order: W sends nothing, so no channel changes order.
    sched = _build(ONE_F_ONE_B + "\n        any { for i in 0 .. m { W(i) } }", w=", W")
    assert sched.family.of(0).segments == ((0, 8, 1), (8, 12, 4))
    prove_family(sched, "nccl", strict=True)
    c = compile_schedule(sched)
    assert c.program.family == sched.family and c.program.family.nccl is None


def test_worst_case_memory_is_the_family_s_and_over_the_limit_is_E430():
    sched = _build("        window 3\n" + ONE_F_ONE_B)
    static = [r.peak for r in rank_memory(sched)]
    worst = [r.peak for r in family_memory(sched)]
    assert static == [2.0, 1.0] and worst == [3.0, 2.0]
    limited = _build("        window 3\n" + ONE_F_ONE_B, decls="    memory limit = 2\n")
    with pytest.raises(PipecError) as info:
        prove_family(limited, "gloo")
    d = info.value.diagnostics[0]
    assert d.code == "E430" and "rank 0" in d.message and d.notes[0].startswith("a member reaching it: F0 F1 F2")


def test_strict_refusal_prints_the_deadlocking_member():
    sched = _build("        window 2\n" + ONE_F_ONE_B)
    with pytest.raises(PipecError) as info:
        prove_family(sched, "gloo", strict=True)
    d = info.value.diagnostics[0]
    assert d.code == "E428" and d.span.line == 5
    assert "rank 0 may run F0 B0 F1 F2 B1 F3 B2 B3" in d.notes
