"""Every diagnostic code, triggered by a minimal schedule: code, span and rendering.

The same snippets are shown in docs/errors.md; `test_docs_examples_print_what_they_say`
runs the documented ones and compares the printed diagnostic, and the drift tests
below keep the code list in `pipec/`, the docs and this file in step.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from repo import ROOT

from pipec.cli import app as cli
from pipec.driver import build
from pipec.errors import PipecError, Source, snippet
from pipec.frontend import library

DOCS = ROOT / "docs" / "errors.md"

# A correct schedule; most cases below change one line of it.
OK = """\
schedule "t" (p: int = 2, m: int = 2) {
    stages p
    place s -> s
    ops F, B
    rank r {
        for i in 0 .. m { F(i) }
        for i in 0 .. m { B(i) }
    }
}
"""


def _with(old: str, new: str, text: str = OK) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def _rank(body: str, text: str = OK) -> str:
    """OK with its rank block's body replaced."""
    old = "        for i in 0 .. m { F(i) }\n        for i in 0 .. m { B(i) }\n"
    return _with(old, "".join(f"        {line}\n" for line in body.splitlines()), text)


BIG = "    let k = 1000000000000000000\n    let big = k * k * k * k * k * k * k * k\n"


def _order(body: str) -> str:
    """OK with an `order r { ... }` policy instead of its rank block."""
    start = OK.index("    rank r {")
    return OK[:start] + "    order r {\n" + "".join(f"        {line}\n" for line in body.splitlines()) + "    }\n}\n"


# A correct schedule with token slices (docs/terapipe.md).
SLICED = """\
schedule "t" (p: int = 2, m: int = 2) {
    stages p
    slices 2
    seqlen 100
    ops F, B
    rank r {
        for i in 0 .. m { F(i, slice: 0)  F(i, slice: 1) }
        for i in 0 .. m { B(i, slice: 1)  B(i, slice: 0) }
    }
}
"""

# (code, schedule text, parameters, line, col of the diagnostic's span)
CASES: list[tuple[str, str, dict[str, object], int, int]] = [
    ("E001", _with("    stages p\n", "    stages p)\n"), {}, 2, 13),
    ("E002", _with("    stages p\n", "    stages p $ 2\n"), {}, 2, 14),
    ("E003", _with("    stages p\n", "    stages p\n    let x = " + "-" * 150 + "1\n"), {}, 3, 159),
    ("E004", _with("    stages p\n", "    stages 99999999999999999999\n"), {}, 2, 12),
    ("E101", _with("    stages p\n", "    stages q\n"), {}, 2, 12),
    ("E102", _rank("for i in 0 .. m { F(i, 0) }\nfor i in 0 .. m { B(i) }"), {}, 6, 27),
    ("E103", _with("    stages p\n", "    stages p / 2\n"), {}, 2, 12),
    ("E104", _with("    rank r {\n", "    let m = 4\n    rank r {\n"), {}, 5, 5),
    ("E105", _rank("for i in 0 .. m { F(i, rank: r) }\nfor i in 0 .. m { B(i) }"), {}, 6, 32),
    ("E106", _with("    stages p\n", "    stages p\n    stages 2 * p\n"), {}, 3, 5),
    ("E107", _with("    ops F, B\n", "    ops F, B\n    topology { default link latency 5 }\n"), {}, 5, 37),
    ("E108", _with("    ops F, B\n", "    ops F, B\n    cost X = 1\n"), {}, 5, 5),
    ("E109", _with("    ops F, B\n", "    ops F, B\n    F(0)\n"), {}, 5, 5),
    ("E110", _with("    ops F, B\n", "    ops F, B, X\n"), {}, 4, 15),
    ("E111", _rank("for i in 0 .. m { F(i) & B(i) & F(i) }"), {}, 6, 27),
    (
        "E112",
        _with("    ops F, B\n", '    ops F, B\n    topology {\n        dc "east" ranks 0 .. 4\n    }\n'),
        {},
        6,
        9,
    ),
    ("E113", _order("prefer B, X"), {}, 6, 19),
    ("E201", _with("    stages p\n", "    stages p // (m - 2)\n"), {}, 2, 14),
    ("E202", _with("    stages p\n", '    require m >= 4, "need at least 4 micro-batches"\n    stages p\n'), {}, 2, 5),
    ("E203", _with("m: int = 2", "m: int"), {}, 1, 1),
    ("E204", OK, [("m", 4), ("m", 8)], 1, 27),
    ("E205", OK, {"q": 4}, 1, 1),
    ("E206", OK, {"m": "many"}, 1, 27),
    ("E207", _rank("while done(F, 0) < m { }"), {}, 6, 9),
    ("E208", _rank("F(0, stage: 5)"), {}, 6, 9),
    ("E209", _rank("for i in 0 .. m + 1 { F(i) }"), {}, 6, 31),
    ("E210", _with("    stages p\n", "    stages 0\n"), {}, 2, 5),
    ("E211", _rank("for i in 0 .. m by 0 { F(i) }"), {}, 6, 28),
    ("E212", _with("    stages p\n", "    stages p\n" + BIG + "    let x = big * big * big / 3\n"), {}, 5, 5),
    ("E213", _order("inflight <= 0"), {}, 5, 5),
    ("E214", SLICED.replace("    seqlen 100\n", "    seqlen 100\n    tokens j -> 40\n"), {}, 5, 5),
    ("E215", _with("    place s -> s\n", "    place s -> s\n    length i -> i - 1\n"), {}, 4, 5),
    ("E218", _rank("window 5\nfor i in 0 .. m { F(i) }\nfor i in 0 .. m { B(i) }"), {}, 6, 9),
    ("E219", _rank("window 2 prefer fastest\nfor i in 0 .. m { F(i) }\nfor i in 0 .. m { B(i) }"), {}, 6, 25),
    ("E216", _with("    place s -> s\n", "    place s -> s\n    edge s -> if s == 1 then 0 else s + 1\n"), {}, 4, 5),
    ("E301", _rank("for i in 0 .. m { F(i, stage: 0) }"), {}, 6, 27),
    ("E302", _rank("for i in 0 .. m { F(i) }\nF(0)\nfor i in 0 .. m { B(i) }"), {}, 7, 9),
    ("E303", _rank("for i in 0 .. m { F(i) }"), {}, 5, 5),
    ("E304", _rank("for i in 0 .. m { B(i) }\nfor i in 0 .. m { F(i) }"), {}, 6, 27),
    ("E305", _with("    place s -> s\n", "    place s -> s + 1\n"), {}, 3, 5),
    ("E306", _rank("for i in 0 .. m { F(i) }\nfor i in 0 .. m { B(i)  W(i) }"), {}, 7, 33),
    ("E307", _with("    ops F, B\n", "    ops F, B, W\n"), {}, 5, 5),
    ("E308", _with("    stages p\n    place s -> s\n", "    stages 2 * p\n    place s -> s % p\n"), {}, 6, 27),
    ("E310", _rank("RECOMPUTE(0)\nfor i in 0 .. m { F(i) }\nfor i in 0 .. m { B(i) }"), {}, 6, 9),
    ("E311", _rank("for i in 0 .. m { F(i)  OFFLOAD(i) }\nfor i in 0 .. m { B(i) }"), {}, 6, 33),
]

# The same codes raised on other paths (kept so those paths stay diagnostics too).
MORE_CASES: list[tuple[str, str, dict[str, object], int, int]] = [
    # Python allows at most 20 nested loops: E003 at the schedule header.
    ("E003", _rank("for a in 0 .. 1 {\n" * 21 + "}\n" * 21), {}, 1, 1),
    (
        "E004",
        _with("    ops F, B\n", "    ops F, B\n    topology { default link latency 1" + "0" * 400 + "s }\n"),
        {},
        5,
        37,
    ),
    ("E106", _with("    stages p\n", ""), {}, 1, 1),
    ("E201", _with("    stages p\n", "    stages p\n    let x = m % (p - 2)\n"), {}, 3, 15),
    ("E207", _rank("for i in 0 .. 1000000000 { }"), {}, 6, 9),
    ("E207", _rank("while true { F(stage: r) }"), {}, 6, 9),
    ("E209", _rank("F(9223372036854775807 + 1)"), {}, 6, 9),
    ("E210", OK, {"m": 100_000_000}, 1, 1),
    ("E212", _with("    place s -> s\n", "    place s -> s\n" + BIG + "    cost F = big * big * big\n"), {}, 6, 5),
]


def _build(text: str, params) -> None:
    build(Source("t.pipe", text), params)


def _case_id(case) -> str:
    return case[0]


@pytest.mark.parametrize("case", CASES + MORE_CASES, ids=_case_id)
def test_code_span_and_caret(case):
    code, text, params, line, col = case
    with pytest.raises(PipecError) as info:
        _build(text, params)
    d = info.value.diagnostics[0]
    assert d.code == code, d.format()
    assert d.span is not None, d.format()
    assert (d.span.line, d.span.col) == (line, col), d.format()
    out = d.format()
    first, *rest = out.splitlines()
    assert first.startswith(f"t.pipe:{line}:{col}: error[{code}]: ")
    # The source line (a long one cut around the span, errors.snippet), then a caret line starting under
    # the span's first column.
    shown, at, _ = snippet(Source("t.pipe", text).line(line), col, 1)
    assert rest[0].endswith(" | " + shown)
    assert re.fullmatch(r" *\^+", rest[1]), out
    assert rest[1].index("^") == rest[0].index(" | ") + 3 + at - 1


def test_the_base_schedule_is_fine():
    sched = build(Source("t.pipe", OK), {})
    assert sched.num_ops == 8


def test_unknown_library_name_is_E000():
    with pytest.raises(PipecError) as info:
        library.read("no-such-schedule")
    assert info.value.code == "E000"
    assert "no-such-schedule" in info.value.diagnostics[0].format()


# ---- the command line --------------------------------------------------------


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cli_user_error_exits_1(case, in_tmp, capsys):
    code, text, params, line, col = case
    (in_tmp / "t.pipe").write_text(text)
    items = params.items() if isinstance(params, dict) else params
    argv = ["check", "t.pipe"] + [a for k, v in items for a in ("-D", f"{k}={v}")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"t.pipe:{line}:{col}: error[{code}]: ")
    assert "^" in err
    assert "Traceback" not in err


def test_cli_ok_exits_0(in_tmp, capsys):
    (in_tmp / "t.pipe").write_text(OK)
    assert cli.main(["check", "t.pipe"]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["frobnicate", "1f1b"],  # unknown subcommand
        ["check", "1f1b", "-D", "p"],  # malformed -D
        ["check", "1f1b", "-D", "=4"],
        [],  # no subcommand
    ],
)
def test_cli_misuse_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_cli_unknown_library_name_exits_1(capsys):
    assert cli.main(["check", "no-such-schedule"]) == 1  # an input error (E000), not command-line misuse
    err = capsys.readouterr().err
    assert "error[E000]" in err
    assert "Traceback" not in err


def test_cli_missing_file_exits_1(in_tmp, capsys):
    assert cli.main(["check", "missing.pipe"]) == 1
    assert "error[E000]" in capsys.readouterr().err


# ---- docs/errors.md and the code list stay in step --------------------------


def _source_codes() -> set[str]:
    codes = set()
    for path in (ROOT / "pipec").rglob("*.py"):
        codes |= set(re.findall(r"\"(E\d{3})\"", path.read_text()))
    return codes


def _doc_sections() -> dict[str, str]:
    """Each `### E123 ...` heading of docs/errors.md and the text up to the next heading."""
    text = DOCS.read_text()
    parts = re.split(r"^### (E\d{3})\b[^\n]*\n", text, flags=re.M)
    return {parts[i]: parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


# E2xx codes a tool raises on a schedule that builds (E217: an exporter or tool that cannot take a stage graph
# yet), so no `pipec check` triggers them: documented with the tool's command and, like the listed codes,
# triggered by the tools' own tests (tests/unit/tools/test_graph_refusals.py runs E217's example).
AFTER_BUILD = {"E217"}


def _listed_codes() -> set[str]:
    """E4xx and up: listed in docs/errors.md, documented in full and tested by the work that adds them."""
    return {c for c in _doc_sections() if c[1] >= "4" or c in AFTER_BUILD}


def test_every_code_in_the_source_is_documented():
    missing = sorted(_source_codes() - set(_doc_sections()))
    assert not missing, f"codes raised in pipec/ but not documented in docs/errors.md: {missing}"


def test_every_documented_code_has_a_test_here():
    tested = {c[0] for c in CASES} | {"E000"}
    documented = set(_doc_sections()) - _listed_codes()
    assert documented - tested == set(), "documented codes without a case in CASES"
    assert tested - documented == set(), "tested codes missing from docs/errors.md"


def test_the_compiled_program_checks_come_last():
    headings = re.findall(r"^## (.*)$", DOCS.read_text(), flags=re.M)
    assert headings[-1] == "Checks on the compiled program (E4xx)"
    last = DOCS.read_text().split("## Checks on the compiled program (E4xx)")[1]
    assert {c for c in _source_codes() if c.startswith("E4")} <= set(re.findall(r"^### (E\d{3})", last, flags=re.M))


def test_listed_codes_are_tested_somewhere():
    """E4xx .. E8xx: each is triggered by some test under tests/ (those tests belong to the work adding them)."""
    here = Path(__file__).name
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py") if p.name != here)
    untested = sorted(c for c in _listed_codes() if c not in tests)
    assert not untested, f"listed in docs/errors.md but not triggered by any test under tests/: {untested}"


def _doc_examples():
    out = []
    for code, body in _doc_sections().items():
        pipe = re.search(r"```pipe\n(.*?)```", body, flags=re.S)
        shown = re.search(r"```text\n(.*?)```", body, flags=re.S)
        cmd = re.search(r"`pipec check t\.pipe((?: -D \S+)*)`", body)
        if pipe and shown and cmd:
            params = [tuple(d.split("=", 1)) for d in cmd.group(1).split()[1::2]]
            out.append(pytest.param(pipe.group(1), params, shown.group(1).rstrip("\n"), id=code))
    return out


@pytest.mark.parametrize(("text", "params", "shown"), _doc_examples())
def test_docs_examples_print_what_they_say(text, params, shown):
    with pytest.raises(PipecError) as info:
        _build(text, params)
    assert "\n".join(d.format() for d in info.value.diagnostics) == shown


def test_docs_have_an_example_for_every_tested_code():
    with_example = {p.id for p in _doc_examples()}
    assert {c[0] for c in CASES} - with_example == set()


@pytest.mark.parametrize("sep", ["\f", "\r", "\v", "\x1c", "\u2028"])
def test_the_caret_line_counts_lines_as_the_parser_does(sep):
    """A form feed, lone carriage return or other character that str.splitlines() splits on, inside a
    comment, does not end a line for the parser, so the quoted line is the one the error is on."""
    text = _with("    stages p\n", f"    # a comment with {sep!r}: {sep} inside\n    stages q\n")
    with pytest.raises(PipecError) as e:
        build(Source("t.pipe", text), {})
    line = e.value.span.line
    assert text.split("\n")[line - 1] == "    stages q"
    assert f"{line:>4} |     stages q" in str(e.value)


def test_crlf_sources_quote_their_lines_without_the_carriage_return():
    text = _with("    stages p\n", "    stages q\n").replace("\n", "\r\n")
    with pytest.raises(PipecError) as e:
        build(Source("t.pipe", text), {})
    assert f"{e.value.span.line:>4} |     stages q\n" in str(e.value) + "\n"


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["check", "1f1b", "-D", "p=" + "x" * 300], "got `" + "x" * 20 + "..." + "x" * 10 + " (300 characters)`"),
        (["check", "1f1b", "-D", "p=" + "9" * 300], "got " + "9" * 20 + "..." + "9" * 10 + " (300 digits)"),
        (["simulate", "1f1b", "--cost", "F=" + "y" * 300], "cannot read `" + "y" * 20 + "..."),
        (["simulate", "1f1b", "--cost", "y" * 300], "error[E801]: cannot read cost file"),
    ],
)
def test_huge_values_are_quoted_briefly(argv, shown, capsys):
    """A value given on the command line is quoted by its ends and length, not echoed whole; a --cost too
    long to be a path is still a diagnostic, not a traceback."""
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert shown in err and "Traceback" not in err
    if "cost file" not in shown:
        assert max(len(line) for line in err.splitlines()) < 200
