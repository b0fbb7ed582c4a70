"""The schedule language, construct by construct: exact op orders of small programs, and the errors.

Each test states one rule of docs/language.md. Programs are tiny on purpose: the
assertion is the whole emitted order (or the exact diagnostic code and place),
so a change of meaning shows up as a failing test, not as a different schedule
that still happens to check clean.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo import ROOT

from pipec.driver import build
from pipec.errors import PipecError, Source
from pipec.ir.schedule import Schedule

# ---- helpers ----------------------------------------------------------------------------------------------------

HEADER = "(p: int = 1, m: int = 2)"


def program(body: str, header: str = HEADER, name: str = "t") -> str:
    return f'schedule "{name}" {header} {{\n{body}\n}}'


def make(body: str, header: str = HEADER, params=(), check: bool = True, **kw) -> Schedule:
    """Build a schedule from its body (the text inside `schedule "t" (...) { ... }`)."""
    return build(Source("t.pipe", program(body, header)), params, check=check, **kw)


def seq(s: Schedule, r: int = 0) -> list[str]:
    """Rank r's ops as `F0` (one stage on the rank) or `F0.3` (micro-batch 0 on stage 3)."""
    multi = len(s.stages_of(r)) > 1
    return [f"{o.kind}{o.mb}" + (f".{o.stage}" if multi else "") for o in s.ops(r)]


def rank_seq(stmts: str, header: str = HEADER, params=(), check: bool = False) -> list[str]:
    """Rank 0's ops of a one-stage schedule whose rank block is `stmts` (unchecked by default)."""
    return seq(make(f"stages 1\nrank r {{\n{stmts}\n}}", header, params, check=check))


def fails(body: str, code: str, header: str = HEADER, params=(), check: bool = True, **kw):
    """Assert that building fails with `code`; return the diagnostic."""
    with pytest.raises(PipecError) as info:
        make(body, header, params, check=check, **kw)
    d = info.value.diagnostics[0]
    assert d.code == code, d.format()
    return d


def holds(expr: str, header: str = HEADER, params=()) -> bool:
    """True when `require expr` passes at the top of a schedule (raises the diagnostic otherwise)."""
    make(f"require {expr}\nstages 1\nrank r {{ F(0) B(0) F(1) B(1) }}", header, params)
    return True


ONE_STAGE_DONE = "F(0) B(0) F(1) B(1)"  # a complete rank 0 body for the default header (p=1, m=2)


# ---- lexical structure ----------------------------------------------------------------------------------------


def test_comments_semicolons_and_line_breaks_do_not_change_the_program():
    plain = "stages 1\nrank r {\nF(0)\nB(0)\nF(1)\nB(1)\n}"
    dense = "stages 1; rank r { F(0) B(0); F(1); B(1) ; }"
    commented = (
        "# a comment line\n"
        "stages 1   # trailing comment\n"
        "rank r {   # F(9) inside a comment is not an op\n"
        "    F(0); B(0)  # two statements on one line\n"
        "    ;;F(1)\n"
        "    B(1)\n"
        "}"
    )
    assert seq(make(plain)) == seq(make(dense)) == seq(make(commented)) == ["F0", "B0", "F1", "B1"]


def test_hash_inside_a_string_is_not_a_comment():
    assert holds('"a#b" == "a#b"', '(p: int = 1, m: int = 2, tag: str = "a#b")')
    s = make(f"stages 1\nrank r {{ {ONE_STAGE_DONE} }}", '(p: int = 1, m: int = 2, tag: str = "x # y")')
    assert s.param("tag") == "x # y"


@pytest.mark.parametrize(
    "literal, expected",
    [("7", 7), ("007", 7), ("1.5", 1.5), ("1e3", 1000.0), ("2.5E-1", 0.25)],
)
def test_number_literals(literal, expected):
    s = make(f"let x = {literal}\nrequire x == {expected!r}\nstages 1\nrank r {{ {ONE_STAGE_DONE} }}")
    assert s.num_ops == 4


def test_a_float_literal_has_float_type():
    # `1e3` is a float even though its value is whole: `x // 1` is then float, and an int parameter rejects it.
    fails("", "E103", "(p: int = 1, m: int = 1e3)")


def test_argument_names_are_ordinary_names():
    # `mb` and `stage` name arguments of op calls, and can still name values.
    ops = rank_seq("let mb = 0\nlet stage = 0\nF(mb, stage: stage)  B(mb: mb, stage: stage)")
    assert ops == ["F0", "B0"]


def test_unexpected_character_is_E002_at_its_column():
    d = fails("stages 1 $", "E002")
    assert (d.span.line, d.span.col) == (2, 10)


def test_syntax_error_is_E001_with_expected_tokens():
    d = fails("stages 1\nrank r { F(0) B(0 }", "E001")
    assert d.span.line == 3
    assert "expected" in d.message


# ---- parameters ---------------------------------------------------------------------------------------------------


def test_parameter_defaults_and_inferred_types():
    s = make(
        "stages p\nrank r { F(0) B(0) }",
        '(p = 2, m = 1, x = 0.5, flag = true, mode = "eager", n: float = 3)',
    )
    assert s.params == (("p", 2), ("m", 1), ("x", 0.5), ("flag", True), ("mode", "eager"), ("n", 3.0))
    assert type(s.param("n")) is float  # an int default of a float parameter is converted


def test_a_default_may_use_earlier_parameters_and_follows_their_overrides():
    header = "(p: int = 2, m: int = 2 * p, v = m // 2 + 1)"
    body = "stages p\nrank r { for i in 0 .. m { F(i) } for i in 0 .. m { B(i) } }"
    assert make(body, header).params == (("p", 2), ("m", 4), ("v", 3))
    assert make(body, header, [("p", "3")]).params == (("p", 3), ("m", 6), ("v", 4))
    assert make(body, header, [("p", "3"), ("m", "5")]).params == (("p", 3), ("m", 5), ("v", 3))


def test_a_default_cannot_use_a_later_parameter():
    d = fails("stages 1\nrank r { F(0) B(0) }", "E101", "(m: int = p, p: int = 1)")
    assert d.message == "unknown name `p`"


def test_D_overrides_are_parsed_by_the_declared_type():
    header = '(p: int = 1, m: int = 1, x: float = 1.5, flag: bool = false, mode: str = "lazy")'
    body = "stages 1\nrank r { F(0) B(0) }"
    s = make(body, header, [("p", "1"), ("x", "2"), ("flag", "true"), ("mode", "eager"), ("m", "1")])
    assert s.params == (("p", 1), ("m", 1), ("x", 2.0), ("flag", True), ("mode", "eager"))
    assert [type(v) for _, v in s.params] == [int, int, float, bool, str]
    assert make(body, header, [("x", "1e-3")]).param("x") == 0.001


@pytest.mark.parametrize(
    "name, raw",
    [("p", "2.0"), ("p", "two"), ("p", "true"), ("x", "fast"), ("flag", "1"), ("flag", "True"), ("flag", "yes")],
)
def test_D_override_of_the_wrong_type_is_E206_at_the_parameter(name, raw):
    header = "(p: int = 1, m: int = 1, x: float = 1.5, flag: bool = false)"
    d = fails("stages 1\nrank r { F(0) B(0) }", "E206", header, [(name, raw)])
    assert d.message.startswith(f"parameter `{name}` must be")
    assert d.span.line == 1


def test_typed_values_from_python_are_checked_like_D_strings():
    header = "(p: int = 1, m: int = 1, flag: bool = false)"
    body = "stages 1\nrank r { F(0) B(0) }"
    assert make(body, header, {"flag": True}).param("flag") is True
    fails(body, "E206", header, {"p": True})  # a bool is not an int
    fails(body, "E206", header, {"flag": 1})


def test_parameter_errors():
    body = "stages 1\nrank r { F(0) B(0) }"
    assert fails(body, "E205", params=[("q", "1")]).message == "unknown parameter `q` (this schedule takes: p, m)"
    assert fails(body, "E204", params=[("m", "1"), ("m", "2")]).message == "parameter `m` given twice"
    assert "has no default" in fails(body, "E203", "(p: int = 1, m: int)").message
    assert make(body, "(p: int = 1, m: int)", [("m", "1")]).param("m") == 1
    assert fails(body, "E103", "(p: int = 1, m: int = 1.5)").message == "default of `m` must be int, got float"
    fails(body, "E104", "(p: int = 1, m: int = 1, p: int = 2)")


def test_an_untyped_parameter_without_default_is_an_int():
    s = make("stages 1\nrank r { F(0) B(0) }", "(p, m)", [("p", "1"), ("m", "1")])
    assert s.params == (("p", 1), ("m", 1))


def test_str_and_bool_parameters_drive_choices():
    body = (
        'stages 1\nrank r {\n  if mode == "gpipe" { F(0) F(1) B(0) B(1) }\n'
        "  elif interleave { F(0) B(0) F(1) B(1) }\n  else { F(0) F(1) B(1) B(0) }\n}"
    )
    header = '(p: int = 1, m: int = 2, mode: str = "gpipe", interleave: bool = false)'
    assert seq(make(body, header)) == ["F0", "F1", "B0", "B1"]
    assert seq(make(body, header, [("mode", "x"), ("interleave", "true")])) == ["F0", "B0", "F1", "B1"]
    assert seq(make(body, header, [("mode", "x")])) == ["F0", "F1", "B1", "B0"]


# ---- expressions ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr",
    [
        # precedence: unary minus > * // % / > + - > comparison > not > and > or > if-then-else
        "1 + 2 * 3 == 7",
        "-2 * 3 == -6",
        "- 2 * - 3 == 6",
        "2 - 3 - 4 == -5",  # left-associative
        "24 // 4 // 2 == 3",
        "7 // 2 * 2 == 6",
        "7 % 4 * 2 == 6",
        "(1 + 2) * 3 == 9",
        "not 1 == 2",
        "not false and false == false",
        "true or false and false",  # and binds tighter than or
        "not (true and false)",
        "if 1 < 2 then true else false",
        "(if 1 > 2 then 10 else 20) + 1 == 21",
        "(if false then 1 else if false then 2 else 3 + 1) == 4",  # else branch extends to the right
        # arithmetic: / is always float, // and % floor like Python, ints mix with floats into floats
        "7 / 2 == 3.5",
        "6 / 3 == 2.0",
        "-7 // 2 == -4",
        "-7 % 2 == 1",
        "7 % -2 == -1",
        "7.5 // 2 == 3.0",
        "1 + 0.5 == 1.5",
        "1 == 1.0",
        # builtins
        "min(3) == 3",
        "min(4, 2, 3) == 2",
        "max(1, 2.5) == 2.5",
        "abs(-3) == 3",
        "abs(2 - 5.5) == 3.5",
        # strings and op kinds compare with == and !=
        '"a" == "a"',
        '"a" != "b"',
        "F == F",
        "F != B",
    ],
)
def test_expression_rules(expr):
    assert holds(expr)


def test_a_false_require_is_E202_with_message_and_parameter_values():
    d = fails('require 1 + 1 == 3, "arithmetic is broken"\nstages 1\nrank r { F(0) B(0) }', "E202")
    assert d.message == "requirement failed: arithmetic is broken"
    assert d.notes == ("with p=1, m=2",)
    assert (d.span.line, d.span.col) == (2, 1)
    assert fails("require false\nstages 1\nrank r { F(0) B(0) }", "E202").message == "requirement failed"


def test_and_or_and_if_then_else_evaluate_lazily():
    assert holds("true or 1 // 0 == 1")
    assert holds("not (false and 1 // 0 == 1)")
    assert holds("(if true then 1 else 1 // 0) == 1")


@pytest.mark.parametrize("expr, col", [("1 / 0", 11), ("1 // (1 - 1)", 11), ("5 % 0", 11), ("5.0 % 0.0", 13)])
def test_division_by_zero_is_E201_at_the_operator(expr, col):
    d = fails(f"let x = {expr}\nstages 1\nrank r {{ F(0) B(0) }}", "E201")
    assert (d.span.line, d.span.col) == (2, col)


@pytest.mark.parametrize(
    "expr",
    ["1 + true", "not 1", '"a" < "b"', '"a" == 1', "min(true)", "F + 1", "abs(F)", "true == 1", "-false"],
)
def test_ill_typed_expressions_are_E103(expr):
    fails(f"let x = {expr}\nstages 1\nrank r {{ F(0) B(0) }}", "E103")


@pytest.mark.parametrize("cond", ["1", "p", '"yes"'])
def test_conditions_must_be_bool(cond):
    fails(f"stages 1\nrank r {{ if {cond} {{ F(0) }} }}", "E103")
    fails(f"require {cond}\nstages 1\nrank r {{ F(0) B(0) }}", "E103")


def test_branches_of_if_then_else_must_agree_in_type():
    fails("let x = if true then 1 else false\nstages 1\nrank r { F(0) B(0) }", "E103")
    assert holds("(if true then 1 else 2.5) == 1")


def test_comparisons_do_not_chain():
    fails("require 1 < 2 < 3\nstages 1\nrank r { F(0) B(0) }", "E001")


def test_an_if_expression_as_an_operand_needs_parentheses():
    fails("let x = 1 + if true then 1 else 2\nstages 1\nrank r { F(0) B(0) }", "E001")


def test_calling_unknown_names_and_misusing_builtins():
    body = "stages 1\nrank r {{ {} }}"
    assert fails(body.format("F(x)"), "E101").message == "unknown name `x`"
    assert fails(body.format("foo(1)"), "E101").message == "unknown function `foo`"
    fails(body.format("F(min)"), "E103")  # a function is not a value
    fails(body.format("F(abs(1, 2))"), "E102")
    fails(body.format("F(min())"), "E102")
    fails(body.format("F(done(F))"), "E102")
    fails(body.format("F(max(1, k: 2))"), "E105")


# ---- hypothesis: integer expressions evaluate like Python ------------------------------------------------------

_PREC = {"if": 0, "cmp": 4, "+": 5, "-": 5, "*": 6, "//": 6, "%": 6, "neg": 7, "lit": 8, "call": 8}

_leaf = st.integers(-30, 30).map(lambda n: ("lit", n))


def _extend(children):
    return st.one_of(
        st.tuples(st.sampled_from(["+", "-", "*", "//", "%"]), children, children),
        st.tuples(st.just("neg"), children),
        st.tuples(st.just("call"), st.sampled_from(["min", "max"]), st.lists(children, min_size=1, max_size=3)),
        st.tuples(
            st.just("if"), st.sampled_from(["<", "<=", "==", "!=", ">", ">="]), children, children, children, children
        ),
    )


int_exprs = st.recursive(_leaf, _extend, max_leaves=14)


def _prec(e) -> int:
    if e[0] == "lit":
        return _PREC["neg"] if e[1] < 0 else _PREC["lit"]  # `-3` is unary minus applied to 3
    return _PREC[e[0]]


def to_pipe(e, minimal: bool) -> str:
    """pipec text: fully parenthesized, or with only the parentheses pipec's precedence needs."""

    def wrap(sub, need: bool) -> str:
        text = to_pipe(sub, minimal)
        return f"({text})" if need or not minimal else text

    tag = e[0]
    if tag == "lit":
        return str(e[1])
    if tag == "neg":
        return "-" + wrap(e[1], _prec(e[1]) < _PREC["neg"])
    if tag == "call":
        return f"{e[1]}({', '.join(to_pipe(a, minimal) for a in e[2])})"
    if tag == "if":
        _, cmp, a, b, then, orelse = e
        cond = f"{wrap(a, _prec(a) < _PREC['+'])} {cmp} {wrap(b, _prec(b) < _PREC['+'])}"
        return f"if {cond} then {to_pipe(then, minimal)} else {to_pipe(orelse, minimal)}"
    op, a, b = e
    p = _PREC[op]
    return f"{wrap(a, _prec(a) < p)} {op} {wrap(b, _prec(b) <= p)}"


def to_python(e) -> str:
    """The same expression as Python source, fully parenthesized."""
    tag = e[0]
    if tag == "lit":
        return f"({e[1]})"
    if tag == "neg":
        return f"(-{to_python(e[1])})"
    if tag == "call":
        args = [to_python(a) for a in e[2]]
        return args[0] if len(args) == 1 else f"{e[1]}({', '.join(args)})"
    if tag == "if":
        _, cmp, a, b, then, orelse = e
        return f"({to_python(then)} if {to_python(a)} {cmp} {to_python(b)} else {to_python(orelse)})"
    op, a, b = e
    return f"({to_python(a)} {op} {to_python(b)})"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(int_exprs)
def test_integer_expressions_evaluate_like_python(e):
    full, minimal = to_pipe(e, minimal=False), to_pipe(e, minimal=True)
    try:
        expected = eval(to_python(e))  # our own generated arithmetic
    except ZeroDivisionError:
        expected = None
    agree = "true" if expected is None else f"x == {expected} and y == {expected}"
    text = program(
        f'let x = {full}\nlet y = {minimal}\nrequire {agree}, "pipec disagrees with Python"\n'
        "stages 1\nrank r { F(0) B(0) }",
        "(p: int = 1, m: int = 1)",
    )
    if expected is None:
        with pytest.raises(PipecError) as info:
            build(Source("t.pipe", text))
        assert info.value.code == "E201"
    else:
        build(Source("t.pipe", text))


def test_the_property_would_notice_a_wrong_value():
    # The property relies on `require` rejecting a wrong value: make sure it does.
    e = ("-", ("lit", -7), ("//", ("lit", 7), ("lit", -2)))
    assert eval(to_python(e)) == -3
    assert to_pipe(e, minimal=True) == "-7 - 7 // -2"
    holds(f"{to_pipe(e, minimal=True)} == -3")
    with pytest.raises(PipecError):
        holds(f"{to_pipe(e, minimal=True)} == -4")


# ---- let, scoping and shadowing ------------------------------------------------------------------------------


def test_let_is_immutable_within_its_block():
    d = fails("stages 1\nrank r {\n  let k = 1\n  let k = 2\n  F(0) }", "E104")
    assert d.message == "`k` is already defined in this block"
    assert d.span.line == 5


def test_inner_blocks_may_shadow_and_the_outer_binding_returns_after_them():
    ops = rank_seq(
        "let k = 1\n"
        "if true { let k = 0\n F(k) }\n"  # inner k
        "F(k)\n"  # outer k again
        "for k in 0 .. 2 { B(k) }\n"  # a loop variable shadows too
        "repeat 1 { let k = 5\n require k == 5 }\n"
        "require k == 1"
    )
    assert ops == ["F0", "F1", "B0", "B1"]


def test_parameters_may_be_shadowed_inside_the_rank_block_but_not_at_top_level():
    s = make("stages p\nrank r { let m = 1\n F(0) B(0) }", "(p: int = 1, m: int = 1)")
    assert seq(s) == ["F0", "B0"]
    fails("let m = 1\nstages p\nrank r { F(0) B(0) }", "E104", "(p: int = 1, m: int = 1)")


def test_top_level_lets_are_visible_in_declarations_and_the_rank_block():
    s = make(
        "let n = p * 2\nstages n\nranks p\nplace s -> s // 2\nrank r { F(0, stage: 2*r) F(0, stage: 2*r + 1) }",
        check=False,
    )
    assert s.num_stages == 2 and s.placement == (0, 0)
    assert seq(s) == ["F0.0", "F0.1"]


def test_a_loop_variable_ends_with_its_loop():
    d = fails("stages 1\nrank r { for i in 0 .. 2 { F(i) }\n B(i) }", "E101")
    assert d.message == "unknown name `i`"


@pytest.mark.parametrize("name", ["F", "B", "W", "min", "max", "abs", "done"])
def test_builtin_names_cannot_be_rebound(name):
    fails(f"stages 1\nrank r {{ let {name} = 1\n F(0) B(0) }}", "E104")


# ---- loops and conditionals ---------------------------------------------------------------------------------------


def test_for_is_half_open_and_empty_when_lo_reaches_hi():
    ops = rank_seq(
        "for i in 0 .. 2 { F(i) }\nfor i in 3 .. 3 { F(99) }\nfor i in 2 .. 0 { F(99) }\nfor i in -2 .. 0 { B(i + 2) }",
        "(p: int = 1, m: int = 2)",
    )
    assert ops == ["F0", "F1", "B0", "B1"]


def test_for_loops_nest_in_order():
    s = make(
        "stages 2\nranks 1\nrank r {\n for s in 0 .. 2 { for i in 0 .. 2 { F(i, stage: s) } }\n"
        " for s in 0 .. 2 { for i in 0 .. 2 { B(i, stage: 1 - s) } } }"
    )
    assert seq(s) == ["F0.0", "F1.0", "F0.1", "F1.1", "B0.1", "B1.1", "B0.0", "B1.0"]


def test_repeat_runs_n_times_and_zero_or_negative_times_is_none():
    ops = rank_seq("repeat 2 { F(stage: 0) }\nrepeat 0 { F(99) }\nrepeat -3 { F(99) }\nrepeat m { B(stage: 0) }")
    assert ops == ["F0", "F1", "B0", "B1"]


def test_if_elif_else_takes_the_first_true_branch_on_each_rank():
    s = make(
        "stages p\nrank r {\n"
        "  if r == 0 { F(0) B(0) }\n"
        "  elif r < 2 { F(0)\n B(0) }\n"
        "  elif r < 3 { F(0) }\n"  # never reached for r == 1: an earlier branch was true
        "  else { F(0) B(0) }\n"
        "}",
        "(p: int = 4, m: int = 1)",
        check=False,
    )
    assert [seq(s, r) for r in range(4)] == [["F0", "B0"], ["F0", "B0"], ["F0"], ["F0", "B0"]]


def test_while_runs_until_its_condition_is_false():
    ops = rank_seq(
        "while done(F, 0) < m { F(stage: 0) }\nwhile done(B, 0) < done(F, 0) { B(stage: 0) }",
        "(p: int = 1, m: int = 3)",
    )
    assert ops == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_a_while_iteration_that_emits_nothing_is_E207():
    d = fails("stages 1\nrank r { while done(F, 0) < 5 { if false { F(stage: 0) } } }", "E207")
    assert "made no progress" in d.message


def test_a_while_that_emits_more_than_the_rank_can_own_is_E207():
    # rank 0 owns 1 stage x 2 kinds x m=2 micro-batches = 4 ops
    d = fails("stages 1\nrank r { while true { F(stage: 0) } }", "E207")
    assert d.message == "`while` loop emitted more ops than this rank can own (4)"


def test_a_runaway_for_loop_is_E207_before_it_runs():
    d = fails("stages 1\nrank r { for i in 0 .. 1000000000 { for j in 0 .. 1000000000 { F(0) } } }", "E207")
    assert "ran too long" in d.message


def test_ops_and_loops_belong_in_the_rank_block_and_declarations_at_top_level():
    assert "inside the `rank r" in fails("F(0)\nstages 1\nrank r { B(0) }", "E109").message
    fails("for i in 0 .. 1 { let x = i }\nstages 1\nrank r { F(0) B(0) }", "E109")
    fails("stages 1\nrank r { stages 2\n F(0) B(0) }", "E109")
    fails("stages 1\nrank r { rank q { F(0) } }", "E109")


# ---- functions ------------------------------------------------------------------------------------------------


def test_expression_functions():
    ops = rank_seq(
        "def twice(x) = 2 * x\ndef pick(a, b) = if a < b then a else b\n"
        "F(twice(0))  F(pick(3, twice(0) + 1))  B(twice(1) - 2)  B(1)"
    )
    assert ops == ["F0", "F1", "B0", "B1"]


def test_block_functions_emit_their_ops_where_called():
    ops = rank_seq(
        "def warm(n) { for i in 0 .. n { F(i) } }\ndef cool(lo, hi) { for i in lo .. hi { B(i) } }\n"
        "warm(2)\ncool(0, 1)\ncool(1, 2)"
    )
    assert ops == ["F0", "F1", "B0", "B1"]


def test_block_functions_defined_at_top_level_may_loop_and_are_called_from_the_rank_block():
    s = make(
        "def phase(kind_is_f, n) {\n  for i in 0 .. n { if kind_is_f { F(i) } else { B(i) } }\n}\n"
        "stages 1\nrank r { phase(true, m)  phase(false, m) }"
    )
    assert seq(s) == ["F0", "F1", "B0", "B1"]


def test_functions_returning_op_values_emit_when_called_as_statements():
    s = make(
        "stages 2\nranks 1\nrank r {\n"
        "  def fwd(k) = F(k % 2, stage: k // 2)\n"
        "  def bwd(k) = B(k % 2, stage: 1 - k // 2)\n"
        "  def either(f, k) = if f then fwd(k) else bwd(k)\n"
        "  for k in 0 .. 4 { either(true, k) }\n"
        "  for k in 0 .. 4 { either(false, k) }\n"
        "}",
        "(p: int = 1, m: int = 2)",
    )
    assert seq(s) == ["F0.0", "F1.0", "F0.1", "F1.1", "B0.1", "B1.1", "B0.0", "B1.0"]


def test_an_op_value_stored_in_a_let_is_not_emitted():
    assert rank_seq("let op = F(1)\nF(0)") == ["F0"]


def test_a_function_sees_only_names_defined_before_it_so_no_recursion():
    assert fails("stages 1\nrank r { def f() = g()\n def g() = 1\n F(0) }", "E101").message == "unknown function `g`"
    assert fails("stages 1\nrank r { def f(x) = f(x)\n F(0) }", "E101").message == "unknown function `f`"
    assert fails("stages 1\nrank r { def f() = k\n let k = 1\n F(0) }", "E101").message == "unknown name `k`"


def test_functions_bind_names_where_they_are_defined_not_where_called():
    ops = rank_seq("let k = 1\ndef f() = k\nif true { let k = 0\n F(f()) F(k) }\nB(f() - 1)")
    assert ops == ["F1", "F0", "B0"]


def test_function_parameters_shadow_outer_names():
    assert rank_seq("def f(m) = m + 1\nF(f(-1))", "(p: int = 1, m: int = 5)") == ["F0"]


def test_function_misuse():
    body = "stages 1\nrank r {{ {} }}"
    fails(body.format("def f(x) = x\n F(f(1, 2))"), "E102")
    fails(body.format("def f(x) = x\n F(f(x: 1))"), "E105")
    fails(body.format("def f(x, x) = x\n F(0)"), "E104")
    fails(body.format("def f() = 1\n let f = 2\n F(0)"), "E104")
    fails(body.format("def f() { F(0) }\n let x = f()"), "E103")  # a block function has no value
    fails(body.format("def f() = 1\n f()"), "E103")  # a statement must emit


def test_function_bodies_are_type_checked_per_call_with_the_caller_in_a_note():
    d = fails("stages 1\nrank r {\n def inc(x) = x + 1\n F(inc(0))\n F(inc(true)) }", "E103")
    assert d.span.line == 4  # the error is in the body...
    assert d.notes[-1] == "in `inc` called at line 6 with (bool)"  # ...and the note names the call


# ---- op calls -------------------------------------------------------------------------------------------------


def test_op_call_forms():
    s = make(
        "stages 2\nranks 1\nrank r {\n"
        "  F(0, stage: 0)  F(mb: 1, stage: 0)  F(stage: 1)  F(stage: 1)\n"
        "  B(stage: 1)  B(1, stage: 1)  B(0, stage: 0)  B(mb: 1, stage: 0)\n}"
    )
    assert seq(s) == ["F0.0", "F1.0", "F0.1", "F1.1", "B0.1", "B1.1", "B0.0", "B1.0"]


def test_the_stage_defaults_to_the_ranks_only_stage():
    s = make("stages p\nrank r { F(0) F() B(0) B() }", "(p: int = 3, m: int = 2)")
    assert [s.ops(r)[0].stage for r in range(3)] == [0, 1, 2]
    assert [seq(s, r) for r in range(3)] == [["F0", "F1", "B0", "B1"]] * 3


def test_a_rank_with_several_stages_must_name_the_stage():
    d = fails("stages 2\nranks 1\nrank r { F(0) }", "E308")
    assert d.message == "rank 0 owns stages [0, 1]: say which, e.g. `F(i, stage: s)`"


def test_next_micro_batch_counts_what_this_rank_emitted_on_that_stage():
    # F(stage: s) is F(done(F, s), stage: s): explicit ops count too, so "next" is a counter, not max + 1.
    ops = rank_seq(
        "require done(F, 0) == 0\nF(stage: 0)\nrequire done(F, 0) == 1 and done(B, 0) == 0\n"
        "F(3)\nrequire done(F, 0) == 2\nF(stage: 0)  F(stage: 0)\nrequire done(F, 0) == 4\n"
        "let k = B\nrepeat 4 { B(stage: 0) }\nrequire done(k, 0) == 4",
        "(p: int = 1, m: int = 4)",
    )
    assert ops == ["F0", "F3", "F2", "F3", "B0", "B1", "B2", "B3"]


def test_done_counts_per_stage_and_per_rank():
    s = make(
        "stages 4\nranks 2\nplace s -> s // 2\nrank r {\n"
        "  let a = 2 * r\n  let b = a + 1\n"
        "  repeat 2 { F(stage: a) }\n"
        '  require done(F, a) == 2 and done(F, b) == 0, "per stage"\n'
        "  while done(F, b) < done(F, a) { F(stage: b) }\n"
        "  while done(B, b) < m { B(stage: b)  B(stage: a) }\n"
        "}",
        "(p: int = 2, m: int = 2)",
    )
    assert seq(s, 0) == ["F0.0", "F1.0", "F0.1", "F1.1", "B0.1", "B0.0", "B1.1", "B1.0"]
    assert seq(s, 1) == ["F0.2", "F1.2", "F0.3", "F1.3", "B0.3", "B0.2", "B1.3", "B1.2"]


@pytest.mark.parametrize(
    "call, code",
    [
        ("F(1, 2)", "E102"),
        ("F(1, micro: 2)", "E105"),
        ("F(1, mb: 1)", "E105"),  # micro-batch twice
        ("F(0, stage: 0, stage: 0)", "E105"),
        ("F(0.5)", "E103"),
        ("F(0, stage: true)", "E103"),
        ("W(0)", "E306"),  # W needs `ops F, B, W`
        ("done(W, 0)", "E306"),
        ("F(0, stage: 7)", "E208"),
        ("F(5)", "E209"),
        ("F(-1)", "E209"),
    ],
)
def test_op_call_errors(call, code):
    fails(f"stages 1\nrank r {{ {call} }}", code)


def test_every_op_exactly_once_on_its_owner_in_dependency_order():
    assert fails("stages 1\nrank r { F(0) F(0) B(0) F(1) B(1) }", "E302").message == (
        "F(0, stage 0) emitted twice on rank 0 (first at line 3)"
    )
    assert fails("stages 1\nrank r { F(0) B(0) F(1) }", "E303").message == (
        "B(1, stage 0) is never emitted; stage 0 is placed on rank 0"
    )
    d = fails("stages 1\nrank r { B(0) F(0) F(1) B(1) }", "E304")
    assert d.message == "B(0, stage 0) on rank 0 needs F(0, stage 0), which comes later (line 3)"
    d = fails("stages p\nrank r { F(0, stage: 1 - r) B(0, stage: 1 - r) }", "E301", "(p: int = 2, m: int = 1)")
    assert d.message == "F(0, stage 1) emitted on rank 0, but stage 1 is placed on rank 1"


def test_split_backward_needs_W_after_B():
    s = make("ops F, B, W\nstages 1\nrank r { F(0) B(0) W(0) }", "(p: int = 1, m: int = 1)")
    assert s.kinds == ("F", "B", "W") and s.split_backward
    assert seq(s) == ["F0", "B0", "W0"]
    fails("ops F, B, W\nstages 1\nrank r { F(0) W(0) B(0) }", "E304", "(p: int = 1, m: int = 1)")
    fails("ops F, B, W\nstages 1\nrank r { F(0) B(0) }", "E307", "(p: int = 1, m: int = 1)")


# ---- overlapped pairs -------------------------------------------------------------------------------------------


def test_an_overlapped_pair_marks_its_first_op_in_paired():
    s = make(
        "stages 2\nranks 1\nrank r {\n  F(0, stage: 0)  F(1, stage: 0)\n"
        "  F(0, stage: 1) & F(1, stage: 1)\n"  # two ops with no dependency between them
        "  B(0, stage: 1)  B(1, stage: 1) & B(0, stage: 0)\n  B(1, stage: 0)\n}"
    )
    assert seq(s) == ["F0.0", "F1.0", "F0.1", "F1.1", "B0.1", "B1.1", "B0.0", "B1.0"]
    assert s.ranks[0].paired.tolist() == [False, False, True, False, False, True, False, False]


def test_pairs_of_function_op_values_and_next_micro_batch_ops():
    s = make(
        "stages p\nrank r {\n  def f(i) = F(i)\n  F(stage: r)\n  f(1) & B(stage: r)\n  B(1)\n}",
        "(p: int = 2, m: int = 2)",
    )
    for r in range(2):
        assert seq(s, r) == ["F0", "F1", "B0", "B1"]
        assert s.ranks[r].paired.tolist() == [False, True, False, False]


def test_the_two_ops_of_a_pair_may_not_depend_on_each_other():
    d = fails("stages 1\nrank r { F(0) & B(0)  F(1) B(1) }", "E304")
    assert d.message == "B(0, stage 0) on rank 0 needs F(0, stage 0), which is overlapped with it"


def test_a_pair_is_exactly_two_single_ops():
    fails("stages 1\nrank r { F(0) & F(1) & B(0)  B(1) }", "E111")
    fails("stages 1\nrank r { def two() { F(0) B(0) }\n two() & F(1)  B(1) }", "E111")


# ---- declarations -----------------------------------------------------------------------------------------------


def test_ranks_and_microbatches_default_to_parameters_p_and_m_and_placement_to_round_robin():
    s = make("stages 6\nrank r { }", "(p: int = 3, m: int = 5)", check=False)
    assert (s.num_stages, s.num_ranks, s.num_microbatches) == (6, 3, 5)
    assert s.placement == (0, 1, 2, 0, 1, 2)
    assert s.kinds == ("F", "B") and not s.split_backward


def test_explicit_sizes_override_the_parameters():
    s = make(
        "stages n * 2\nranks n\nmicrobatches k\nplace s -> if s < n then s else 2 * n - 1 - s\nrank r { }",
        "(n: int = 2, k: int = 3)",
        check=False,
    )
    assert (s.num_stages, s.num_ranks, s.num_microbatches) == (4, 2, 3)
    assert s.placement == (0, 1, 1, 0)
    assert s.stages_of(0) == (0, 3)


def test_declaration_errors():
    body = "rank r { F(0) B(0) }"
    assert fails(body, "E106").message == "the schedule needs a `stages` declaration"
    assert fails("stages 1", "E106").message == "the schedule needs a `rank r { ... }` block"
    fails("stages 1\n" + body, "E106", "(n: int = 1, m: int = 1)")  # no `ranks` and no parameter p
    fails("stages 1\nstages 1\n" + body, "E106")
    fails("stages 1\nops F, B\nops F, B\n" + body, "E106")
    fails("stages 1\nops B, F\n" + body, "E110")
    fails("stages 1\nops F, X\n" + body, "E110")
    fails("stages 0\n" + body, "E210")
    fails("stages true\n" + body, "E103")
    d = fails("stages 2\nplace s -> s + 1\n" + body, "E305")
    assert d.message == "`place` maps stage 0 to rank 1, outside 0..0"


def test_declarations_may_follow_the_rank_block():
    s = make("rank r { F(0) B(0) F(1) B(1) }\nstages 1")
    assert seq(s) == ["F0", "B0", "F1", "B1"]


def test_cost_and_memory_are_per_stage_and_the_limit_per_rank():
    s = make(
        "stages 2 * p\nplace s -> s % p\n"
        "cost F = 1 + s\ncost B = 2.5\ncost W = 0.5 * s\ncost comm = if s == 0 then 0.1 else 0.2\n"
        "memory act = s * 2\nmemory wact = 1\nmemory params = 4\nmemory limit = 10 + r\n"
        "rank r { }",
        "(p: int = 2, m: int = 1)",
        check=False,
    )
    assert s.costs == {
        "F": (1.0, 2.0, 3.0, 4.0),
        "B": (2.5,) * 4,
        "W": (0.0, 0.5, 1.0, 1.5),
        "comm": (0.1, 0.2, 0.2, 0.2),
    }
    assert s.memory == {"act": (0.0, 2.0, 4.0, 6.0), "wact": (1.0,) * 4, "params": (4.0,) * 4, "limit": (10.0, 11.0)}
    assert all(type(v) is float for vals in [*s.costs.values(), *s.memory.values()] for v in vals)


def test_cost_and_memory_errors():
    body = "stages 1\nrank r { F(0) B(0) }\n"
    assert (
        fails(body + "cost X = 1", "E108").message
        == "unknown cost `X`; known: F, B, W, comm, act_bytes, grad_bytes, param_bytes, reduce_grad, unshard, step, "
        "saved_bytes, wsaved_bytes, input_bytes, state_bytes, offload, attn, op_fixed, moe_layers, a2a, a2a_bytes"
    )
    known = "act, wact, ckpt, params, limit, host_limit"
    assert fails(body + "memory foo = 1", "E108").message == f"unknown memory `foo`; known: {known}"
    fails(body + "memory host_limit = s", "E101")  # per rank too
    fails(body + "cost F = true", "E103")
    fails(body + "cost F = 1\ncost F = 2", "E106")
    fails(body + "memory limit = s", "E101")  # the limit is per rank: its variable is r
    fails(body + "cost F = 1 // (s - s)", "E201")


# ---- topology ---------------------------------------------------------------------------------------------------

TOPOLOGY = """
topology {
    dc "east" ranks 0 .. p // 2
    dc "west" ranks p // 2 .. p;  link "east" <-> "west" latency 40ms bandwidth 10Gbps
    default link latency 5us bandwidth 100Gbps
    link "east" <-> "east" latency 1.5s bandwidth 2Tbps   # inside one datacenter
    link "west" <-> "west" latency 2ms bandwidth 800Mbps
    link "west" <-> "east" bandwidth 1Kbps latency 1ms    # attributes in any order, either may be left out
    link "east" <-> "west" bandwidth 8bps
}
stages p
rank r { F(0) B(0) }
"""


def test_topology_is_parsed_with_units_in_seconds_and_bits_per_second():
    topo = make(TOPOLOGY, "(p: int = 4, m: int = 1)").topology
    assert [(d.name, d.lo, d.hi) for d in topo.datacenters] == [("east", 0, 2), ("west", 2, 4)]
    got = [(k.a, k.b, k.latency_s, k.bandwidth_bps) for k in topo.links]
    want = [
        ("east", "west", 40e-3, 10e9),
        (None, None, 5e-6, 100e9),
        ("east", "east", 1.5, 2e12),
        ("west", "west", 2e-3, 800e6),
        ("west", "east", 1e-3, 1e3),
        ("east", "west", None, 8.0),
    ]
    assert len(got) == len(want)
    for (a, b, lat, bw), (wa, wb, wlat, wbw) in zip(got, want):
        assert (a, b) == (wa, wb)
        assert (lat is None and wlat is None) or math.isclose(lat, wlat, rel_tol=1e-12)
        assert (bw is None and wbw is None) or math.isclose(bw, wbw, rel_tol=1e-12)


def test_no_topology_is_None_and_an_empty_one_is_empty():
    assert make(f"stages 1\nrank r {{ {ONE_STAGE_DONE} }}").topology is None
    topo = make(f"topology {{ }}\nstages 1\nrank r {{ {ONE_STAGE_DONE} }}").topology
    assert topo.datacenters == () and topo.links == ()


@pytest.mark.parametrize(
    "items, code, message",
    [
        ("default link latency 5", "E107", "latency needs a unit, one of us, ms, s (got `5`)"),
        ("default link latency 5Gbps", "E107", "latency needs a unit, one of us, ms, s (got `5Gbps`)"),
        (
            "default link bandwidth 5GB",
            "E107",
            "bandwidth needs a unit, one of bps, Kbps, Mbps, Gbps, Tbps (got `5GB`)",
        ),
        ('dc "a" ranks 0 .. 5', "E112", 'datacenter "a" ranks 0..5 are not within 0..4'),
        ('dc "a" ranks 2 .. 2', "E112", 'datacenter "a" ranks 2..2 are not within 0..4'),
        ('dc "a" ranks 0 .. 2  dc "b" ranks 1 .. 3', "E112", 'datacenter "b" overlaps "a"'),
        ('dc "a" ranks 0 .. 2  dc "a" ranks 2 .. 4', "E112", 'datacenter "a" declared twice'),
        ('dc "a" ranks 0 .. 2  link "a" <-> "b" latency 1ms', "E112", 'link names unknown datacenter "b"'),
    ],
)
def test_topology_errors(items, code, message):
    d = fails(f"topology {{ {items} }}\nstages p\nrank r {{ F(0) B(0) }}", code, "(p: int = 4, m: int = 1)")
    assert d.message == message


def test_a_link_needs_an_attribute():
    fails('topology { dc "a" ranks 0 .. 1  link "a" <-> "a" }\nstages 1\nrank r { F(0) B(0) }', "E001")


# ---- evaluating some ranks only ------------------------------------------------------------------------------


def test_building_some_ranks_leaves_the_others_empty_and_does_not_run_them():
    body = (
        'stages p\nrank r {\n  require r != 0, "rank 0 was evaluated"\n'
        "  for i in 0 .. m { F(i) }\n  for i in 0 .. m { B(i) }\n}"
    )
    header = "(p: int = 3, m: int = 2)"
    # Evaluating every rank runs rank 0's block, whose `require` fails...
    d = fails(body, "E202", header)
    assert d.message == "requirement failed: rank 0 was evaluated"
    # ...so building only rank 1 proves rank 0's block never ran.
    s = make(body, header, ranks=[1])
    assert (s.num_ranks, len(s.ranks)) == (3, 3)
    assert seq(s, 1) == ["F0", "F1", "B0", "B1"]
    assert len(s.ranks[0]) == 0 and len(s.ranks[2]) == 0
    assert s.ops(0) == [] and s.num_ops == 4
    # Top-level statements still run: they define the schedule's shape.
    assert fails('require p > 3, "top level runs"\n' + body, "E202", header, ranks=[1]).message.endswith(
        "top level runs"
    )


def test_building_some_ranks_skips_the_whole_schedule_checks():
    # Rank 0's ops alone are not a whole schedule (rank 1's are missing), but no E303 is raised.
    s = make("stages p\nrank r { F(0) B(0) }", "(p: int = 2, m: int = 1)", ranks=[0])
    assert seq(s, 0) == ["F0", "B0"] and len(s.ranks[1]) == 0


# ---- the library and the reference's snippets -------------------------------------------------------------------

DOC = ROOT / "docs" / "language.md"
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def doc_blocks() -> list[tuple[str, str, int]]:
    """(info string, text, line) of every fenced block of docs/language.md, in order."""
    text = DOC.read_text()
    return [(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 1) for m in _FENCE.finditer(text)]


def _wrap_fragment(info: str, text: str) -> str:
    header = "(p: int = 4, m: int = 8)"
    if info == "pipe rank":  # statements of a rank block, in a 4-rank schedule with one stage per rank
        return program(f"stages p\nrank r {{\n{text}\n}}", header, "fragment")
    if info == "pipe top":  # top-level statements and declarations, then an empty rank block
        stages = "" if re.search(r"^\s*stages ", text, re.M) else "stages p\n"
        return program(f"{text}\n{stages}rank r {{ }}", header, "fragment")
    raise AssertionError(f"unknown kind of pipe block `{info}`")


PIPE_BLOCKS = [
    pytest.param(i, info, text, line, id=f"line{line}")
    for i, (info, text, line) in enumerate(doc_blocks())
    if info.split(" ")[0] == "pipe"
]


def test_the_reference_has_snippets_of_each_kind():
    kinds = {(info.split(" ") + ["complete"])[1] for _, info, _, _ in (p.values for p in PIPE_BLOCKS)}
    assert kinds == {"complete", "rank", "top", "error"}, kinds


@pytest.mark.parametrize("index, info, text, line", PIPE_BLOCKS)
def test_every_pipe_snippet_of_the_reference_runs(index, info, text, line):
    """`pipe`: a complete schedule that checks clean; `pipe rank` / `pipe top`: a fragment that evaluates;
    `pipe error CODE`: a complete schedule that fails with CODE, its diagnostic shown in the ```text block after."""
    where = f"docs/language.md:{line}"
    if info == "pipe":
        build(Source(where, text))
    elif info.startswith("pipe error "):
        code = info.split(" ")[2]
        with pytest.raises(PipecError) as e:
            build(Source("bad.pipe", text))
        assert e.value.code == code, f"{where}: {e.value}"
        after_info, shown, _ = doc_blocks()[index + 1]
        assert after_info == "text", f"{where}: expected a ```text block with the diagnostic after it"
        assert shown == e.value.diagnostics[0].format() + "\n", f"{where}: the diagnostic shown is not the real one"
    else:
        build(Source(where, _wrap_fragment(info, text)), check=False)
