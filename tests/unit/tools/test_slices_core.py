"""Token slices and sequence lengths in the IR (docs/terapipe.md): the language's declarations and
`F(i, slice: j)`, the slice rules in the checks and in `validate`, the Program formats, and the one machine
model's per-unit costs and memory."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipec.driver import build, schedule_of
from pipec.errors import PipecError, Source
from pipec.formats.program_file import from_json, from_text, to_json, to_text
from pipec.ir.schedule import Slicing
from pipec.passes.compiler import compile_schedule
from pipec.sim.costs import cost_model
from pipec.sim.memory import rank_memory
from pipec.sim.simulate import simulate, stats

GPIPE = """
schedule "tp" (p: int = 2, m: int = 2, n: int = 3) {{
    stages p
    slices n
    {decls}
    ops F, B
    rank r {{
        for i in 0 .. m {{ for j in 0 .. n {{ F(i, slice: j) }} }}
        for i in 0 .. m {{ for j in 0 .. n {{ {bwd} }} }}
    }}
}}
"""


def sliced(decls: str = "seqlen 12", bwd: str = "B(i, slice: n - 1 - j)", **params: object):
    return build(Source("tp.pipe", GPIPE.format(decls=decls, bwd=bwd)), tuple(params.items()))


def fails(text: str, code: str, params: tuple = ()) -> str:
    with pytest.raises(PipecError) as info:
        build(Source("t.pipe", text), params)
    d = info.value.diagnostics[0]
    assert d.code == code, d.format()
    return d.format()


def test_ops_are_units_of_micro_batch_and_slice():
    s = sliced(m=2, n=3)
    assert s.num_microbatches == 6 and s.num_sequences == 2
    assert s.slicing == Slicing(2, 3, 12, (4, 4, 4), (12, 12))
    assert s.ranks[0].mb.tolist() == [0, 1, 2, 3, 4, 5, 2, 1, 0, 5, 4, 3]
    assert s.op_text("F", 4, 1) == "F(1, slice 1, stage 1)"
    assert s.head()["microbatches"] == 2 and s.head()["slicing"]["tokens"] == [4, 4, 4]


def test_uneven_seqlen_is_cut_as_evenly_as_it_goes_and_tokens_are_taken_as_given():
    assert sliced("seqlen 14").slicing.tokens == (5, 5, 4)
    assert sliced("tokens j -> 2 + j").slicing.tokens == (2, 3, 4)
    assert sliced("tokens j -> 2 + j").slicing.seqlen == 9
    assert sliced("").slicing.tokens == (1, 1, 1)


def test_the_causal_order_of_forwards_and_backwards_is_checked_with_the_rule_named():
    with pytest.raises(PipecError) as info:
        sliced(bwd="B(i, slice: j)")
    text = info.value.diagnostics[0].format()
    assert "error[E304]" in text and "B(0, slice 0, stage 0) on rank 0 needs B(0, slice 1, stage 0)" in text
    assert "slice 0's backward needs the gradients of its keys and values from slice 1's backward" in text
    text = fails(
        GPIPE.format(decls="", bwd="B(i, slice: n - 1 - j)").replace("F(i, slice: j)", "F(i, slice: n - 1 - j)"), "E304"
    )
    assert "F(0, slice 2, stage 0) on rank 0 needs F(0, slice 1, stage 0)" in text
    assert "attends to the keys and values of slice 1" in text


@pytest.mark.parametrize(
    ("decls", "code", "says"),
    [
        ("seqlen 10\n    tokens j -> 3", "E214", "the 3 slices hold 9 tokens, but the sequence has 10"),
        ("tokens j -> j", "E214", "slice 0 has 0 tokens"),
        ("seqlen 2", "E214", "3 slices of a sequence of 2 tokens"),
        ("length i -> 12 + i", "E215", "variable lengths and slices do not go together"),
    ],
)
def test_slices_that_do_not_cover_the_sequence(decls: str, code: str, says: str):
    assert says in fails(GPIPE.format(decls=decls, bwd="B(i, slice: n - 1 - j)"), code)


def test_ops_of_a_sliced_schedule_name_their_slice_and_slices_need_a_declaration():
    text = GPIPE.format(decls="", bwd="B(i)")
    assert "say which, `B(i, slice: j)`" in fails(text, "E105")
    plain = 'schedule "t" (p: int = 2, m: int = 2) {\n stages p\n rank r { F(0, slice: 0) }\n}'
    assert "declares no `slices`" in fails(plain, "E105")
    plain = 'schedule "t" (p: int = 2, m: int = 2) {\n stages p\n tokens j -> 4\n rank r { F(0) }\n}'
    assert "declare `slices n` too" in fails(plain, "E106")
    out = GPIPE.format(decls="", bwd="B(i, slice: n - 1 - j)").replace("F(i, slice: j)", "F(i, slice: j + 1)")
    assert "slice 3 is out of range 0..2" in fails(out, "E209")
    rc = GPIPE.format(decls="", bwd="RECOMPUTE(i)  B(i, slice: n - 1 - j)")
    assert "not supported" in fails(rc, "E105")


def test_an_order_block_is_refused_with_slices():
    text = 'schedule "t" (p: int = 2, m: int = 2) {\n stages p\n slices 2\n order r { prefer F, B }\n}'
    assert "write a `rank` block" in fails(text, "E106")


def test_variable_length_micro_batches_weigh_by_their_tokens():
    text = """
schedule "v" (p: int = 2, m: int = 3) {
    stages p
    length i -> 100 * (i + 1)
    cost attn = 0.5
    ops F, B
    rank r {
        for i in 0 .. m { F(i) }
        for i in 0 .. m { B(i) }
    }
}
"""
    s = build(Source("v.pipe", text))
    assert s.slicing.lengths == (100, 200, 300) and s.slicing.seqlen == 300 and s.num_microbatches == 3
    w = cost_model(s).unit_weight[0]
    L = 300
    expect = [0.5 * n / L + 0.5 * n * (n + 1) / (L * (L + 1)) for n in (100, 200, 300)]
    assert np.allclose(w, expect)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=8), st.floats(0, 1))
def test_the_slices_of_a_sequence_weigh_one_sequence_whatever_the_cut(tokens: list[int], attn: float):
    sl = Slicing(2, len(tokens), sum(tokens), tuple(tokens), (sum(tokens),) * 2)
    w = sl.weight(attn)
    assert len(w) == 2 * len(tokens)
    assert np.isclose(w[: len(tokens)].sum(), 1.0) and np.isclose(w[len(tokens) :].sum(), 1.0)
    assert np.isclose(sl.share()[: len(tokens)].sum(), 1.0)
    if attn > 1e-6 and len(tokens) > 1 and len(set(tokens)) == 1:  # equal slices: later ones attend to more
        assert (np.diff(w[: len(tokens)]) > 0).all()


def test_the_simulator_times_each_unit_by_its_weight():
    one = sliced("seqlen 12", n=1, m=1, p=1)
    # p = 1: no pipelining, so the step is the sum of the units' times: one whole sequence, F + B + W.
    assert stats(simulate(compile_schedule(one).program, cost_model(one))).makespan == pytest.approx(3.0)
    s = sliced("seqlen 12\n    cost attn = 0.7", n=3, m=1, p=1)
    assert stats(simulate(compile_schedule(s).program, cost_model(s))).makespan == pytest.approx(3.0)
    fixed = sliced("seqlen 12\n    cost op_fixed = 0.1", n=3, m=1, p=1)
    span = stats(simulate(compile_schedule(fixed).program, cost_model(fixed))).makespan
    assert span == pytest.approx(6 * 0.1 + (1 - 0.1) + (2 - 0.1))  # each of the 6 ops pays its fixed part
    # Pipelined slices beat the unsliced sequence at p = 4: the point of TeraPipe.
    whole = sliced("seqlen 16", n=1, m=1, p=4)
    cut = sliced("seqlen 16", n=4, m=1, p=4)
    t_whole = stats(simulate(compile_schedule(whole).program, cost_model(whole))).makespan
    t_cut = stats(simulate(compile_schedule(cut).program, cost_model(cut))).makespan
    assert t_cut < 0.6 * t_whole


def test_messages_carry_their_units_share_of_the_bytes():
    s = sliced(
        "tokens j -> if j == 0 then 1 else if j == 1 then 2 else 4\n    cost act_bytes = 700\n    cost comm = 0",
        n=3,
        m=1,
        p=2,
    )
    cm = cost_model(s)
    size, _, _ = cm.wire(
        np.zeros(3, np.int64), np.zeros(3, np.int64), np.zeros(3, np.int64), np.ones(3, np.int64), np.arange(3)
    )
    assert size.tolist() == pytest.approx([100.0, 200.0, 400.0])


def test_a_unit_holds_its_share_of_the_activations():
    s = sliced("tokens j -> 1 + 2 * j", n=3, m=1, p=2)
    peaks = [r.peak for r in rank_memory(s)]
    # act defaults to p / S = 1 per sequence: all three slices live at once before the first B.
    assert peaks == pytest.approx([1.0, 1.0])
    half = sliced("tokens j -> 1 + 2 * j", bwd="B(i, slice: n - 1 - j)", n=3, m=2, p=2)
    assert [r.peak for r in rank_memory(half)] == pytest.approx([2.0, 2.0])


def test_the_program_carries_the_slicing_through_both_formats_and_back_to_a_schedule():
    s = sliced("tokens j -> 3 + j", n=3, m=2)
    prog = compile_schedule(s).program
    assert prog.slicing == s.slicing and prog.num_sequences == 2
    assert from_json(to_json(prog)) == prog and from_text(to_text(prog)) == prog
    assert schedule_of(prog).slicing == s.slicing
    unsliced = GPIPE.replace("slices n", "").replace("for j in 0 .. n {{ F(i, slice: j) }}", "F(i)")
    unsliced = unsliced.replace("for j in 0 .. n {{ {bwd} }}", "B(i)").format(decls="")
    plain = compile_schedule(build(Source("g.pipe", unsliced))).program
    assert plain.slicing is None and '"slicing"' not in to_json(plain) and "slicing" not in to_text(plain)


def test_validate_refuses_a_program_that_breaks_the_slice_order_or_the_cover():
    prog = compile_schedule(sliced(n=3, m=1)).program
    rp = prog.ranks[1]
    bwd = np.flatnonzero(rp.op == 1)  # BWD
    mb = rp.mb.copy()
    mb[bwd[0]], mb[bwd[1]] = mb[bwd[1]], mb[bwd[0]]
    bad = dataclasses.replace(prog, ranks=(prog.ranks[0], dataclasses.replace(rp, mb=mb)))
    with pytest.raises(PipecError) as info:
        from_text(to_text(bad))
    assert (
        "the slice after it: slice 1's backward needs the gradients of its keys and values"
        in info.value.diagnostics[0].format()
    )
    short = dataclasses.replace(prog, slicing=dataclasses.replace(prog.slicing, seqlen=13))
    with pytest.raises(PipecError) as info:
        from_json(to_json(short))
    assert "must cover the 13 of a sequence" in info.value.diagnostics[0].format()
