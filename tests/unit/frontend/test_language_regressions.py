"""Regressions: language bugs found while writing docs/language.md, each fixed."""

import subprocess
import sys

import pytest

from pipec.driver import build
from pipec.errors import PipecError, Source


def make(body, header="(p: int = 1, m: int = 1)", params=()):
    return build(Source("t.pipe", f'schedule "t" {header} {{\n{body}\n}}'), params)


# Was a bug (frontend/evaluate.py `_run`): parameter defaults are evaluated before `_Env` binds `_fdiv`/`_tdiv`/`_mod`
# into the generated module's namespace, so a default that divides by another parameter is a NameError traceback.
@pytest.mark.parametrize("default, value", [("m // p", 2), ("m / p", 2.0), ("m % p", 0)])
def test_a_default_may_divide_by_an_earlier_parameter(default, value):
    s = make(
        "stages p\nrank r { for i in 0 .. m { F(i) } for i in 0 .. m { B(i) } }",
        f"(p: int = 2, m: int = 4, v = {default})",
    )
    assert s.param("v") == value


# Was a bug (frontend/codegen.py / evaluate.py): function calls are not charged to the work budget, so a chain of
# k functions each calling the previous twice runs 2**k calls: "evaluation always ends" only in theory.
def test_exponential_function_calls_are_refused_with_E207():
    defs = "def f0(x) = x + 1\n" + "".join(f"def f{k}(x) = f{k - 1}(x) + f{k - 1}(x)\n" for k in range(1, 41))
    text = f'schedule "t" (p: int = 1, m: int = 1) {{\n{defs}let y = f40(0)\nstages 1\nrank r {{ F(0) B(0) }}\n}}'
    code = f"from pipec.driver import build\nfrom pipec.errors import Source\nbuild(Source('t.pipe', {text!r}))"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("2**40 function calls ran for more than 20 s instead of failing with E207")
    assert "E207" in done.stderr


# Was a bug (expressions.py `bind`): keywords can be bound by `let` (and as parameters), but the binding can never be
# read back: `true` still means true. Binding a keyword should be E104 like a built-in name.
def test_binding_a_keyword_is_E104():
    with pytest.raises(PipecError) as e:
        make("let true = 5\nrequire true == 5\nstages 1\nrank r { F(0) B(0) }")
    assert e.value.code == "E104"


# Was a bug (codegen.py `value_decl`): `cost`/`memory` bind their stage variable `s` only when no outer `s`
# exists; with a parameter (or top-level let) named `s`, `cost F = s` silently uses it for every stage.
def test_the_stage_variable_of_cost_is_not_captured_by_an_outer_s():
    s = make(
        "stages 2\nranks 1\ncost F = s\nrank r { F(0, stage: 0) F(0, stage: 1) B(0, stage: 1) B(0, stage: 0) }",
        "(p: int = 1, m: int = 1, s: int = 5)",
    )
    assert s.costs["F"] == (0.0, 1.0)


# Was a rough edge (expressions.py `binop`): op values compare with their source id, so the same op written twice is
# "different": `F(0) == F(0)` is false. Either compare (kind, mb, stage) or refuse `==` on ops (E103).
def test_ops_cannot_be_compared():
    with pytest.raises(PipecError) as e:
        make('require F(0) == F(0), "same op"\nstages 1\nrank r { F(0) B(0) }')
    assert e.value.code == "E103"


def test_for_by_step_counts_down_and_a_zero_step_is_e211():
    body = "stages 1\nrank r {{ for i in 0 .. m {{ F(i) }} for i in m - 1 .. -1 by {step} {{ B(i) }} }}"
    s = make(body.format(step=-1), "(p: int = 1, m: int = 3)")
    assert [(o.kind, o.mb) for o in s.ops(0)] == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    with pytest.raises(PipecError) as e:
        make(body.format(step=0), "(p: int = 1, m: int = 3)")
    assert e.value.code == "E211"
    assert (e.value.span.line, e.value.span.col) == (3, 59)  # the step expression
