"""Fuzzing every input: whatever the text, the only exception that escapes is PipecError.

Four properties of the front end, each run through `parse` and `build` with small parameters:
random token soup, text generated from the grammar, generated schedules (valid
syntax, random meaning), and mutations of the library files. Each failure that
these found is kept in REGRESSIONS.

Then every input kind (section (c), `KINDS`): schedules, cost files (TOML and JSON), topologies,
torch CSVs and Programs (JSON and text), each a valid file mutated (a line deleted, duplicated or
swapped, a number changed, a token dropped, a group flag flipped, the file cut short) and read
as pipec reads it, from a file; what is accepted goes on (a cost file into a cost model and a
simulation, a Program into the dry run, which may refuse it only with E403 or E404).

Examples per property: `PIPEC_FUZZ_EXAMPLES` (default 100, a few seconds in all); inputs per kind
here: `PIPEC_FUZZ_INPUTS` (default 40). `python benchmarks/fuzz.py` runs both at length.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
import traceback
from collections import Counter
from contextlib import contextmanager
from importlib import resources

import lark
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.lark import from_lark
from repo import ROOT

from pipec.driver import build
from pipec.errors import PipecError, Source
from pipec.frontend import evaluate
from pipec.frontend.parse import parse

EXAMPLES = int(os.environ.get("PIPEC_FUZZ_EXAMPLES", "100"))

settings.register_profile(
    "pipec-fuzz",
    max_examples=EXAMPLES,
    deadline=None,  # the first example pays for building the parser
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
FUZZ = settings.get_profile("pipec-fuzz")

SMALL = {"p": 2, "m": 4, "v": 2}
HUGE = ["0", "-1", "2147483648", "9223372036854775807", "99999999999999999999", "1" + "0" * 400, "1e999", "0.0"]


@contextmanager
def small_limits():
    """Lower evaluate's size and work limits, so that no example spends seconds building a huge schedule."""
    names = ("MAX_SIZE", "MAX_OPS", "WORK_FIXED")
    saved = [getattr(evaluate, n) for n in names]
    for n, v in zip(names, (256, 20_000, 5_000)):
        setattr(evaluate, n, v)
    try:
        yield
    finally:
        for n, v in zip(names, saved):
            setattr(evaluate, n, v)


def run(text: str, params=()) -> None:
    """Parse and build; a PipecError is fine if every diagnostic formats, anything else fails the test."""
    source = Source("fuzz.pipe", text)
    try:
        with small_limits():
            parse(source)
            build(source, params)
    except PipecError as e:
        assert e.diagnostics
        lines = max(1, len(text.splitlines()))
        for d in e.diagnostics:
            assert re.fullmatch(r"E\d{3}", d.code), d.code
            out = d.format()
            assert f"error[{d.code}]: " in out.splitlines()[0]
            if d.span is not None:
                assert 1 <= d.span.line <= lines + 1, out
                assert d.span.col >= 1, out


def declared_params(text: str) -> dict[str, object]:
    """SMALL restricted to the parameters the text declares (none if it does not parse)."""
    try:
        tree = parse(Source("fuzz.pipe", text))
    except PipecError:
        return {}
    return {p.name: SMALL[p.name] for p in tree.params if p.name in SMALL}


# ---- (a) random text: tokens of the language, and a little noise --------------

KEYWORDS = (
    "schedule require stages ranks microbatches place ops cost memory topology rank let def for in repeat "
    "while if elif else then and or not true false dc link default latency bandwidth int float bool str "
    "min max abs done F B W stage mb act wact params limit comm by expect when order prefer inflight fill lag "
    "bubble bubble_time in_flight peak_memory"
).split()
PUNCT = "( ) { } , : = -> .. & ; + - * // / % == != < <= > >= <->".split()
NAMES = ["p", "m", "r", "i", "s", "k", "x", "v", "f", "g"]
ATOMS = ["0", "1", "2", "3", "8", "0.5", "1e3", "40ms", "10Gbps", "5", '"t"', '"east"', '""']

token = st.one_of(
    st.sampled_from(KEYWORDS),
    st.sampled_from(PUNCT),
    st.sampled_from(NAMES),
    st.sampled_from(ATOMS),
    st.sampled_from(HUGE),
    st.sampled_from(["\n", " ", "  ", "# note\n", "\t"]),
    st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=0x2FF), max_size=2),
)
soup = st.lists(token, max_size=80).map(" ".join)
HEADER = 'schedule "t" (p: int = 2, m: int = 4) {\n'


@FUZZ
@given(st.one_of(soup, soup.map(lambda s: HEADER + s + "\n}\n")))
def test_token_soup(text):
    run(text)


# Its own Lark object: from_lark needs the grammar, which a cached parser does not keep.
GRAMMAR = lark.Lark(resources.files("pipec.grammar").joinpath("pipe.lark").read_text(), parser="lalr")


@FUZZ
@given(from_lark(GRAMMAR, alphabet=st.characters(min_codepoint=32, max_codepoint=126)))
def test_grammar_text(text):
    run(text)


# ---- generated schedules: valid syntax, mostly well-typed, random meaning -----

CMP = ["==", "!=", "<", "<=", ">", ">="]
small_int = st.one_of(st.integers(0, 9).map(str), st.sampled_from(["-1", "16", "100", "2147483648"]))


def int_exprs(names: list[str], calls: bool = True) -> st.SearchStrategy[str]:
    """Integer expressions over these names (with a little float, bool and op-counter noise).

    One strategy object per (names, calls), made once: `schedules` asks for these inside its draws, and
    a recursive strategy made anew for every example is validated anew, which cost most of this file's
    time (the examples drawn are the same)."""
    return _int_exprs(tuple(names), calls)


@functools.cache
def _int_exprs(names: tuple[str, ...], calls: bool) -> st.SearchStrategy[str]:
    names = list(names)
    noise = ["true", "1ms", "2GiB", "0.5", "(p / 2)", "done(F, 0)"] + (
        ["done(B, r)", "done(F, r + 1)"] if "r" in names else []
    )
    leaf = st.one_of(small_int, st.sampled_from(names * 8 + noise))

    def extend(e):
        cond = st.tuples(e, st.sampled_from(CMP), e).map(" ".join)
        return st.one_of(
            st.tuples(e, st.sampled_from(["+", "-", "*", "//", "%"]), e).map(lambda t: f"({' '.join(t)})"),
            e.map(lambda a: f"-({a})"),
            st.tuples(cond, e, e).map(lambda t: f"(if {t[0]} then {t[1]} else {t[2]})"),
            st.tuples(st.sampled_from(["min", "max"]), st.lists(e, min_size=1, max_size=3)).map(
                lambda t: f"{t[0]}({', '.join(t[1])})"
            ),
            e.map(lambda a: f"abs({a})"),
            e.map(lambda a: f"f({a})" if calls else a),
        )

    return st.recursive(leaf, extend, max_leaves=6)


@functools.cache  # one strategy per integer strategy, as int_exprs
def bool_exprs(ints: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    cmp = st.tuples(ints, st.sampled_from(CMP), ints).map(" ".join)
    return st.one_of(
        cmp,
        st.tuples(cmp, st.sampled_from(["and", "or"]), cmp).map(" ".join),
        cmp.map(lambda c: f"not ({c})"),
        st.sampled_from(["true", "false", "done(F, r) < m"]),
    )


TOP = int_exprs(["p", "m"])
RANK = int_exprs(["p", "m", "r", "i", "x"])
RANK_BOOL = bool_exprs(RANK)


def _op(kind: str):
    return st.one_of(
        RANK.map(lambda a: f"{kind}({a})"),
        RANK.map(lambda a: f"{kind}(stage: {a})"),
        st.tuples(RANK, RANK).map(lambda t: f"{kind}({t[0]}, stage: {t[1]})"),
        RANK.map(lambda a: f"{kind}(mb: {a})"),
        st.just(f"{kind}(i)"),
    )


op = st.one_of(_op("F"), _op("B"), _op("F"), _op("B"), _op("W"))


def _compound(inner):
    block = st.lists(inner, max_size=4).map(lambda xs: "{\n" + "\n".join(xs) + "\n}")
    return st.one_of(
        st.tuples(RANK, RANK, block).map(lambda t: f"for i in {t[0]} .. {t[1]} {t[2]}"),
        st.tuples(RANK, RANK, RANK, block).map(lambda t: f"for i in {t[0]} .. {t[1]} by {t[2]} {t[3]}"),
        st.tuples(RANK, block).map(lambda t: f"repeat {t[0]} {t[1]}"),
        st.tuples(RANK_BOOL, block).map(lambda t: f"while {t[0]} {t[1]}"),
        st.tuples(RANK_BOOL, block, block).map(lambda t: f"if {t[0]} {t[1]} else {t[2]}"),
        st.tuples(op, op).map(lambda t: f"{t[0]} & {t[1]}"),
    )


stmt = st.recursive(
    st.one_of(
        op,
        st.sampled_from(["for i in 0 .. m { F(i) }", "for i in 0 .. m { B(i) }", "for i in 0 .. m { W(i) }"]),
        st.sampled_from(["for i in 0 .. m { F(i, stage: s0)  B(i, stage: s0) }", "g(x)", "g(i)"]),
        RANK_BOOL.map(lambda a: f"require {a}"),
    ),
    _compound,
    max_leaves=10,
)


ORDER_INT = int_exprs(["r", "p", "m"])


@st.composite
def orders(draw, kinds: str) -> str:
    items = []
    if draw(st.booleans()):
        names = kinds.split(", ")
        wrong = st.lists(st.sampled_from(names + ["X"]), min_size=1)
        items.append("prefer " + ", ".join(draw(st.permutations(names) | wrong)))
    if draw(st.booleans()):
        items.append(f"inflight <= {draw(ORDER_INT)}")
    if draw(st.integers(0, 3)) == 0:
        items.append(f"inflight(s) <= {draw(int_exprs(['r', 'p', 's']))}")
    if draw(st.integers(0, 3)) == 0:
        items.append("fill W")
    if draw(st.integers(0, 3)) == 0:
        items.append(f"lag W = {draw(ORDER_INT)}")
    return "order r {\n" + "\n".join(draw(st.permutations(items))) + "\n}"


METRIC = st.sampled_from(["bubble", "bubble_time", "makespan", "ideal", "peak_memory(r)", "in_flight(0)"])
expects = st.tuples(METRIC, st.sampled_from(CMP), TOP, st.sampled_from(["", " when p > 1"])).map(
    lambda t: f"{t[0]} {t[1]} {t[2]}{t[3]}"
)


PLACE = st.sampled_from(["s", "s % p", "if s < p then s else 2 * p - 1 - s"]) | int_exprs(["s", "p"])
STAGES = st.sampled_from(["p"] * 6 + ["2 * p", "p * v", "p + 1"]) | TOP


@st.composite
def schedules(draw) -> tuple[str, dict[str, object]]:
    """A schedule with every part present most of the time; a third of rank blocks start from a correct one."""
    params = ["p: int = 2, m: int = 4", "p = 2, m = 4, v = 2", "p = 3, m = 1", "p = 3, m", "p: float = 2, m = 2", ""]
    lines = [f'schedule "g" ({draw(st.sampled_from(params[:3] * 4 + params[3:]))}) {{']

    def maybe(percent: int, line: str) -> None:
        if draw(st.integers(0, 99)) < percent:
            lines.append(line)

    maybe(95, f"def f(a) = {draw(int_exprs(['a', 'p'], calls=False))}")
    maybe(30, f"require {draw(bool_exprs(TOP))}")
    maybe(60, "def g(a) { F(a)  B(a) }")
    maybe(95, f"stages {draw(STAGES)}")
    maybe(10, f"ranks {draw(TOP)}")
    maybe(10, f"microbatches {draw(TOP)}")
    maybe(80, f"place s -> {draw(PLACE)}")
    kinds = draw(st.sampled_from(["F, B"] * 5 + ["F, B, W"] * 5 + ["F", "F, B, W, W"]))
    maybe(90, f"ops {kinds}")
    maybe(30, f"cost {draw(st.sampled_from(['F', 'B', 'W', 'comm']))} = {draw(int_exprs(['s', 'p']))}")
    maybe(30, f"memory {draw(st.sampled_from(['act', 'wact', 'params']))} = {draw(int_exprs(['s', 'p']))}")
    maybe(10, f"memory limit = {draw(int_exprs(['r', 'p']))}")
    maybe(15, f'topology {{ dc "a" ranks {draw(TOP)} .. {draw(TOP)}  default link latency 1ms }}')
    body = draw(st.lists(stmt, max_size=6))
    if draw(st.integers(0, 2)) == 0:  # a correct GPipe body, then random statements
        body[:0] = [f"for i in 0 .. m {{ {k}(i) }}" for k in kinds.split(", ")]
    head = f"let x = {draw(int_exprs(['p', 'm', 'r']))}\nlet i = 0\nlet s0 = r"
    if draw(st.integers(0, 3)) == 0:  # a policy instead of a rank block
        lines.append(draw(orders(kinds)))
    else:
        maybe(95, "rank r {\n" + head + "\n" + "\n".join(draw(st.permutations(body))) + "\n}")
    maybe(20, f"expect {draw(expects)}")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    given_params = draw(st.sampled_from([{}, {"m": 2}, {"p": 1, "m": 1}, {"p": 3, "m": 5}, {"m": 0}]))
    return text, given_params


@FUZZ
@given(schedules())
def test_generated_schedules(case):
    text, params = case
    declared = declared_params(text).keys() | {"p", "m"}
    run(text, {k: v for k, v in params.items() if k in declared})


# ---- (b) mutations of the library files --------------------------------------

LIBRARY = sorted(
    (f.name, f.read_text()) for f in resources.files("pipec.schedules").iterdir() if f.name.endswith(".pipe")
)
TOKEN_RE = re.compile(
    r'"[^"\n]*"|#[^\n]*|[A-Za-z_][A-Za-z_0-9]*|[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+|[A-Za-z]+)?'
    r"|<->|\.\.|->|==|!=|<=|>=|//|\s+|."
)


def _tokens(text: str) -> list[str]:
    return TOKEN_RE.findall(text)


@st.composite
def mutants(draw) -> tuple[str, dict[str, object]]:
    name, text = draw(st.sampled_from(LIBRARY))
    for _ in range(draw(st.integers(1, 4))):
        text = _mutate(draw, text)
    params = draw(st.sampled_from(["defaults", "small"]))
    return text, {} if params == "defaults" else declared_params(text)


def _mutate(draw, text: str) -> str:
    toks = _tokens(text)
    words = [j for j, t in enumerate(toks) if not t.isspace()]
    lines = text.splitlines(keepends=True)
    how = draw(
        st.sampled_from(
            [
                "delete token",
                "swap tokens",
                "duplicate token",
                "insert token",
                "number",
                "parens",
                "minus",
                "blocks",
                "delete line",
                "swap lines",
                "duplicate line",
            ]
        )
    )
    if how.endswith("line") or how == "swap lines":
        if not lines:
            return text
        a = draw(st.integers(0, len(lines) - 1))
        b = draw(st.integers(0, len(lines) - 1))
        if how == "delete line":
            del lines[a]
        elif how == "swap lines":
            lines[a], lines[b] = lines[b], lines[a]
        else:
            lines.insert(b, lines[a])
        return "".join(lines)
    if not words:
        return text
    j = draw(st.sampled_from(words))
    if how == "delete token":
        toks[j] = ""
    elif how == "swap tokens":
        k = draw(st.sampled_from(words))
        toks[j], toks[k] = toks[k], toks[j]
    elif how == "duplicate token":
        toks[j] = toks[j] + " " + toks[j]
    elif how == "insert token":
        toks[j] = draw(token) + " " + toks[j]
    elif how == "number":
        numbers = [k for k in words if toks[k][0].isdigit()] or [j]
        toks[draw(st.sampled_from(numbers))] = draw(st.sampled_from(HUGE))
    elif how == "parens":
        n = draw(st.sampled_from([1, 3, 50, 200, 1000]))
        toks[j] = "(" * n + toks[j] + ")" * n
    elif how == "minus":
        n = draw(st.sampled_from([1, 3, 149, 200, 1000]))
        toks[j] = "-(" * n + toks[j] + ")" * n
    else:  # wrap a line in nested blocks
        n = draw(st.sampled_from([1, 3, 21, 80, 500]))
        a = draw(st.integers(0, max(0, len(lines) - 1)))
        if lines:
            lines[a] = "if true {\n" * n + lines[a] + "}\n" * n
        return "".join(lines)
    return "".join(toks)


@FUZZ
@given(mutants())
def test_library_mutations(case):
    text, params = case
    run(text, params)


def test_the_library_itself_builds():
    for name, text in LIBRARY:
        run(text)
        build(Source(name, text), declared_params(text))


# ---- every crash the fuzzers found, kept ------------------------------------

REGRESSIONS = [
    # VisitError/ValueError: a schedule with no parameter list
    'schedule "t" {\n stages 2\n}\n',
    # VisitError/IndexError: a parameter with a default but no type (and one with neither)
    'schedule "t" (p = 2, m) {\n stages p\n}\n',
    # VisitError/IndexError: `require` without a message
    'schedule "t" (p = 2, m = 2) {\n require m > 4\n stages p\n}\n',
    # RecursionError / VisitError: deep nesting
    'schedule "t" {\n let x = ' + "-" * 5000 + "1\n}\n",
    'schedule "t" {\n let x = ' + "not " * 5000 + "true\n}\n",
    'schedule "t" {\n let x = ' + "1 + " * 50000 + "1\n}\n",
    'schedule "t" {\n rank r {\n' + "if true {\n" * 3000 + "}\n" * 3000 + "}\n}\n",
    # SyntaxError from Python: too many nested parentheses / blocks in the generated code
    'schedule "t" (p = 2, m = 2) {\n stages p\n let x = ' + "max(1, " * 145 + "1" + ")" * 145 + "\n}\n",
    'schedule "t" (p = 2, m = 2) {\n stages p\n rank r {\n' + "for a in 0 .. 1 {\n" * 30 + "}\n" * 30 + "}\n}\n",
    # ValueError: an integer literal over 4300 digits; NameError: `inf` in the generated code
    'schedule "t" {\n stages ' + "9" * 5000 + "\n}\n",
    'schedule "t" (p = 2, m = 2) {\n stages p\n cost F = 1e999\n rank r { F(0) }\n}\n',
    'schedule "t" (p = 2, m = 2) {\n stages p\n topology { default link latency ' + "9" * 400 + "ms }\n}\n",
    # OverflowError: int too large for a float
    'schedule "t" (p = 2, m = 2) {\n stages p\n let k = 1000000000000000000\n'
    " let x = k * k * k * k * k * k * k * k * k * k * k * k * k * k * k * k * k * k / 3\n}\n",
]


@pytest.mark.parametrize("text", REGRESSIONS, ids=range(len(REGRESSIONS)))
def test_regressions(text):
    run(text)


# The hypothesis properties, by name (benchmarks/fuzz.py runs them at length).
PROPERTIES = ("test_token_soup", "test_grammar_text", "test_generated_schedules", "test_library_mutations")


# ---- (c) every input kind, from files: seeds, mutations, and what must hold ----------------------------

KINDS = ("pipe", "cost-toml", "cost-json", "topology", "torch-csv", "program-json", "program-text")
INPUTS = int(os.environ.get("PIPEC_FUZZ_INPUTS", "40"))

NUMBERS = [
    "0", "-0", "1", "-1", "2", "3", "7", "0.5", "-2.5", "1e308", "1e999", "-1e999", "1e-400", "nan", "inf",
    "-inf", "2147483648", "9223372036854775807", "9223372036854775808", "-9223372036854775809",
    "99999999999999999999", "1" + "0" * 400, "1_0", "\u0664", "0x10", "3.0", "1e3", "40ms", "10Gbps", "16MiB",
]  # fmt: skip
NOISE = {
    "pipe": ["{", "}", "(", ")", ",", "F(0)", "B(0)", "W(0)", "rank r {", "for i in 0 .. m {", "&", "stages p"],
    "cost-toml": ["[", "]", "=", '"', ",", "#", "\n", "[end]", "[links]", "keys = 1", "stages = 0", "version = 3",
                  'format = "x"', 'F = "1ms"', "F = []", "F = [[1]]", 'B = "x"', "{", "}", "W = -1"],
    "cost-json": ["{", "}", "[", "]", ",", ":", '"', "null", "true", "false", '"F"', '"end"', '"keys"', "[]", "{}"],
    "topology": ["{", "}", "..", "<->", '"a"', '"b"', "dc", "link", "default", "latency", "bandwidth", "ranks"],
    "torch-csv": [",", "\n", "F", "B", "W", "I", "0F0", "1B1", "0SEND_F0", "1RECV_F0", "0UNSHARD", "0RESHARD",
                  "0REDUCE_GRAD", "F0", "9F9", "-1F0", '"', ";"],
    "program-json": ["{", "}", "[", "]", ",", ":", '"', "null", "true", "false", "[0,0,0,-1,false]", '"ranks"',
                     '"version"', "-1", "[]"],
    "program-text": ["&", "rank 0", "rank 9", "FWD 0 0", "BWD 1 0", "WGRAD 0 0", "SEND_ACT 0 0 1", "RECV_ACT 0 1 0",
                     "SEND_GRAD 0 1 0", "RECV_GRAD 0 0 1", "REDUCE_GRAD 0", "STEP 0", "split true", "place 0 0",
                     "stages 1", "-1", "\n"],
}  # fmt: skip
_NUMBER_RE = re.compile(r"(?<![A-Za-z_0-9])-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_TOKEN_RE = re.compile(r'"[^"\n]*"|[A-Za-z_][A-Za-z_0-9]*|[0-9.]+|\s+|.')


def _library_programs() -> list[tuple[str, dict]]:
    return [("1f1b", {"p": 2, "m": 3}), ("gpipe", {"p": 3, "m": 2}), ("zb-h1", {"p": 2, "m": 4}),
            ("interleaved-1f1b", {"p": 2, "m": 4, "v": 2}), ("dualpipe-v", {"p": 4, "m": 8})]  # fmt: skip


@functools.cache
def kind_seeds(kind: str) -> tuple[tuple[str, str], ...]:
    """Valid files of this kind, as (suffix, text): what the mutations start from."""
    from pipec.api import compile as compile_program
    from pipec.api import load
    from pipec.formats.program_file import to_json, to_text
    from pipec.formats.torch_csv_writer import export_csv
    from pipec.sim.cost_files import dump_costs

    if kind == "pipe":
        return tuple((".pipe", text) for _, text in LIBRARY)
    if kind.startswith("cost"):
        docs = [
            {"F": [1.0, 1.5], "B": [2.0, 2.5], "W": 0.0, "comm": 0.01, "act_bytes": 1e6},
            {"F": 1.0, "B": 2.0},
            {"F": [0.001, 0.002], "B": [0.002, 0.004], "W": [0.001, 0.001], "act_bytes": [1e6, 2e6]},
        ]
        toml = kind == "cost-toml"
        seeds = [(".toml" if toml else ".json", dump_costs(d, toml)) for d in docs]
        if toml:
            seeds += [
                (".toml", "F = 1.0\nB = 2.0\ncomm = 0.001\n"),
                (".toml", (ROOT / "examples/cross_dc.toml").read_text()),
            ]
        else:
            seeds.append((".json", '{"F": 1.0, "B": [2.0, 3.0], "comm": "1ms"}'))
        return tuple(seeds)
    if kind == "topology":
        items = 'dc "a" ranks 0 .. 2\ndc "b" ranks 2 .. 4\nlink "a" <-> "b" latency 1ms bandwidth 10Gbps\n'
        items += "default link latency 5us bandwidth 100Gbps\n"
        return (
            (".topo", items),
            (".topo", "topology {\n" + items + "}\n"),
            (".pipe", (ROOT / "examples/cross_dc.pipe").read_text()),
        )
    if kind == "torch-csv":
        seeds = []
        for name, params in _library_programs():
            try:
                seeds.append((".csv", export_csv(load(name, params))))
                seeds.append((".csv", export_csv(load(name, params), compile_program(name, params))))
            except PipecError:  # a schedule torch's CSV cannot hold
                continue
        return tuple(seeds)
    if kind.startswith("program"):
        write = to_json if kind == "program-json" else to_text
        suffix = ".json" if kind == "program-json" else ".txt"
        return tuple((suffix, write(compile_program(name, params))) for name, params in _library_programs())
    raise ValueError(f"no input kind {kind!r} (kinds: {', '.join(KINDS)})")


def make_input(kind: str, seed: int, i: int) -> tuple[str, str]:
    """Input `i` of this kind and seed (the same every time): a seed file, mutated one to four times, or
    now and then noise."""
    rng = random.Random(f"{kind}/{seed}/{i}")
    suffix, text = rng.choice(kind_seeds(kind))
    if rng.random() < 0.02:
        alphabet = "".join(NOISE[kind]) + "\x00\r\t\u0664\u2028\ufeff\U0001f600" + "".join(NUMBERS[:8])
        return suffix, "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 400)))
    if rng.random() < 0.01:  # deep nesting
        n = rng.choice([200, 5_000, 100_000])
        opener = {"cost-json": "[", "program-json": "[", "cost-toml": "a = [", "pipe": "("}.get(kind, "{")
        at = rng.randint(0, len(text))
        return suffix, text[:at] + opener * n + text[at:]
    for _ in range(rng.randint(1, 4)):
        if kind.startswith("program") and rng.random() < 0.7:
            text = _mutate_program(rng, kind, text)
        else:
            text = _mutate_text(rng, kind, text)
    return suffix, text


def _mutate_program(rng: random.Random, kind: str, text: str) -> str:
    """One change to a Program's instructions that keeps its syntax: an instruction deleted, duplicated or
    moved, one of its numbers moved by one or two (or made -1), or its group (overlap) flag flipped."""
    how = rng.choice(["delete", "duplicate", "swap", "number", "number", "flip group"])
    if kind == "program-json":
        try:
            doc = json.loads(text)
            rows = [rank["instructions"] for rank in doc["ranks"]]
        except (ValueError, KeyError, TypeError):
            return text
        where = [(r, j) for r, rs in enumerate(rows) for j in range(len(rs))]
        if not where:
            return text
        (r, j), (r2, j2) = rng.choice(where), rng.choice(where)
        if how == "delete":
            del rows[r][j]
        elif how == "duplicate":
            rows[r2].insert(j2, list(rows[r][j]))
        elif how == "swap":
            rows[r][j], rows[r2][j2] = rows[r2][j2], rows[r][j]
        elif how == "number":
            row = rows[r][j]
            k = rng.randrange(len(row) - 1) if len(row) > 1 else 0
            if isinstance(row[k], int) and not isinstance(row[k], bool):
                row[k] = rng.choice([row[k] - 1, row[k] + 1, row[k] + 2, -1])
        elif isinstance(rows[r][j][-1], bool):
            rows[r][j][-1] = not rows[r][j][-1]
        return json.dumps(doc, separators=(",", ":"))
    lines = text.split("\n")
    where = [k for k, line in enumerate(lines) if line[:1].isupper()]  # instruction lines: `FWD 0 0`
    if not where:
        return text
    a, b = rng.choice(where), rng.choice(where)
    if how == "delete":
        del lines[a]
    elif how == "duplicate":
        lines.insert(b, lines[a])
    elif how == "swap":
        lines[a], lines[b] = lines[b], lines[a]
    elif how == "number":
        words = lines[a].split(" ")
        k = rng.choice([k for k, w in enumerate(words) if w.lstrip("-").isdigit()] or [0])
        if words[k].lstrip("-").isdigit():
            n = int(words[k])
            words[k] = str(rng.choice([n - 1, n + 1, n + 2, -1]))
        lines[a] = " ".join(words)
    else:
        lines[a] = lines[a][:-2] if lines[a].endswith(" &") else lines[a] + " &"
    return "\n".join(lines)


def _mutate_text(rng: random.Random, kind: str, text: str) -> str:
    lines = text.split("\n")
    how = rng.choice(["delete line", "duplicate line", "swap lines", "number", "number", "number", "delete token",
                      "duplicate token", "swap tokens", "insert", "truncate", "flip group", "flip group"])  # fmt: skip
    if how.endswith("line") or how == "swap lines":
        a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
        if how == "delete line":
            del lines[a]
        elif how == "swap lines":
            lines[a], lines[b] = lines[b], lines[a]
        else:
            lines.insert(b, lines[a])
        return "\n".join(lines)
    if how == "number":
        found = list(_NUMBER_RE.finditer(text))
        if not found:
            return text
        m = rng.choice(found)
        old = m.group()
        nudged = [str(int(old) + d) for d in (-1, 1, 2)] if re.fullmatch(r"-?[0-9]{1,30}", old) else []
        new = rng.choice(NUMBERS + nudged * 3)
        return text[: m.start()] + new + text[m.end() :]
    if how == "truncate":
        return text[: rng.randint(0, len(text))]
    if how == "flip group":  # a Program's overlap flag; elsewhere a `true`/`false` or `&` of any kind
        if kind == "program-text":
            k = rng.randrange(len(lines))
            lines[k] = lines[k][:-2] if lines[k].endswith(" &") else lines[k] + " &"
            return "\n".join(lines)
        flags = list(re.finditer(r"\btrue\b|\bfalse\b", text))
        if not flags:
            return text
        m = rng.choice(flags)
        return text[: m.start()] + ("false" if m.group() == "true" else "true") + text[m.end() :]
    toks = _TOKEN_RE.findall(text)
    words = [j for j, t in enumerate(toks) if not t.isspace()] or [0]
    j = rng.choice(words)
    if not toks:
        return rng.choice(NOISE[kind])
    if how == "delete token":
        toks[j] = ""
    elif how == "duplicate token":
        toks[j] = toks[j] + " " + toks[j]
    elif how == "swap tokens":
        k = rng.choice(words)
        toks[j], toks[k] = toks[k], toks[j]
    else:
        toks[j] = rng.choice(NOISE[kind]) + (" " if rng.random() < 0.5 else "") + toks[j]
    return "".join(toks)


class Wrong(Exception):
    """An input accepted where it must be refused, or refused later with a code that should have come first."""


@functools.cache
def _fixtures():
    from pipec.api import compile as compile_program
    from pipec.api import load

    return {
        "sched": load("1f1b", p=2, m=2),
        "prog": compile_program("1f1b", p=2, m=2),
        "sched4": load("1f1b", p=4, m=4),
        "prog4": compile_program("1f1b", p=4, m=4),
    }


def read_as_pipec_does(kind: str, path: str) -> None:
    """Read the file at `path` as pipec reads an input of this kind, then use what was accepted; a refusal
    is a PipecError. Raises Wrong for an accepted input that a later stage refuses with the wrong code."""
    from pipec.api import compile as compile_program
    from pipec.formats.program_file import read_program
    from pipec.frontend.library import read
    from pipec.frontend.topology import read_topology, with_topology
    from pipec.passes.dryrun import prove
    from pipec.sim.cost_files import read_cost_file
    from pipec.sim.costs import cost_model
    from pipec.sim.simulate import simulate

    fx = _fixtures()
    if kind == "pipe":
        source = read(path)
        with small_limits():
            build(source, declared_params(source.text))
    elif kind.startswith("cost"):
        doc = read_cost_file(path)
        simulate(fx["prog"], cost_model(fx["sched"], [doc]))
    elif kind == "topology":
        sched = with_topology(fx["sched4"], read_topology(path, fx["sched4"]))
        simulate(fx["prog4"], cost_model(sched))
    elif kind == "torch-csv":
        with small_limits():
            compile_program(path)
    else:
        prog = read_program(path)  # read and validated (E501, E502)
        try:
            prove(prog)  # one message order per channel (E404), the rendezvous dry run (E403)
        except PipecError as e:
            if e.code not in ("E403", "E404"):
                raise Wrong(f"read_program accepted a Program that prove refuses with {e.code}: {e}") from None
            raise


def check_diagnostics(e: PipecError, text: str) -> None:
    """Every diagnostic has a code and formats, its span (if any) on a line of the text or just past it."""
    assert e.diagnostics
    lines = max(1, len(text.split("\n")))
    for d in e.diagnostics:
        assert re.fullmatch(r"E\d{3}", d.code), d.code
        out = d.format()
        assert f"error[{d.code}]: " in out.splitlines()[0], out
        if d.span is not None and d.source is not None and d.source.text == text:
            assert 1 <= d.span.line <= lines + 1 and d.span.col >= 1, out


class Hang(Exception):
    pass


@contextmanager
def watchdog(seconds: float):
    """Hang (from SIGALRM) if the block runs longer than `seconds`; a no-op off the main thread."""

    def ring(signum, frame):
        raise Hang(f"still running after {seconds} s")

    try:
        old = signal.signal(signal.SIGALRM, ring)
    except ValueError:  # not the main thread
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def fuzz_one(kind: str, seed: int, i: int, folder: str, timeout: float = 60.0) -> tuple[str, str]:
    """Outcome of input `i`: ("accepted", ""), (code, ""), or ("traceback" | "wrong" | "hang", details)."""
    suffix, text = make_input(kind, seed, i)
    path = os.path.join(folder, "input" + suffix)
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
    try:
        with watchdog(timeout):
            read_as_pipec_does(kind, path)
    except PipecError as e:
        try:
            check_diagnostics(e, text)
        except Exception:
            return "traceback", traceback.format_exc()
        return e.code, ""
    except Wrong as e:
        return "wrong", str(e)
    except Hang as e:
        return "hang", str(e)
    except Exception:
        return "traceback", traceback.format_exc()
    return "accepted", ""


@pytest.mark.parametrize("kind", KINDS)
def test_every_input_kind_is_read_or_refused(kind, tmp_path):
    outcomes = Counter()
    for i in range(INPUTS):
        outcome, detail = fuzz_one(kind, 0, i, str(tmp_path), timeout=60.0)
        assert outcome not in ("traceback", "wrong", "hang"), (
            f"{kind} input {i}: {detail}\n{make_input(kind, 0, i)[1]!r}"
        )
        outcomes[outcome] += 1
    assert sum(outcomes.values()) == INPUTS
    assert len(outcomes) > 1, outcomes  # the mutations reach past the first check, and some refuse


def test_a_program_diagnostic_counts_lines_as_the_file_does():
    from pipec.formats.program_file import parse_program

    text = 'pipec-program 1\rschedule "x" {}\rstages 1 ranks 1 microbatches 1 split false x y\r'
    with pytest.raises(PipecError) as e:
        parse_program(text, "t.txt")
    assert e.value.code == "E501"
    check_diagnostics(e.value, text)
