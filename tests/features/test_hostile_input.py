"""Hostile input is a diagnostic (issue 16, item 5): each case below gives its code (or command-line misuse,
exit 2), never a traceback, a hang or a wrong success. The command-line cases run `python -m pipec` in a
fresh process; the subprocess timeout is only a hang guard, not a speed assertion (docs/reliability.md,
"Files and hostile input", lists the cases with their codes and times)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo import ROOT

from pipec import files
from pipec.api import compile as compile_program
from pipec.cli import app as cli
from pipec.errors import Diagnostic, PipecError, Source, Span
from pipec.formats.program_file import to_json, to_text
from pipec.sim.cost_files import dump_costs, read_cost_file

HANG_GUARD = 120  # seconds: only a hang trips it (each case takes about one on an idle machine)


def _pipec(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pipec", *argv],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=cwd or ROOT,
    )


def _refused(run: subprocess.CompletedProcess, code: str | None, shown: str) -> None:
    """Exit 1 with error[code] (exit 2 for misuse, code None), the text shown, and no traceback."""
    assert "Traceback" not in run.stderr, run.stderr
    assert run.returncode == (1 if code else 2), run.stderr
    if code:
        assert f"error[{code}]" in run.stderr, run.stderr
    assert shown in run.stderr, run.stderr


# ---- files that are no files --------------------------------------------------


@pytest.fixture
def fifo(tmp_path) -> str:
    path = tmp_path / "fifo.pipe"
    os.mkfifo(path)  # no writer: opening it for reading blocks for ever
    return str(path)


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["check", "/dev/zero"], "schedule file `/dev/zero` is a character device, not a regular file"),
        (["import", "/dev/zero"], "`/dev/zero` is a character device, not a regular file"),
        (["simulate", "1f1b", "--cost", "/dev/zero"], "cost file `/dev/zero` is a character device"),
    ],
)
def test_a_device_where_a_file_is_expected(argv, shown):
    _refused(_pipec(*argv), "E901", shown)


def test_a_fifo_schedule_or_cost_file_does_not_hang(fifo):
    _refused(_pipec("check", fifo), "E901", "is a FIFO, not a regular file")
    _refused(_pipec("simulate", "1f1b", "--cost", fifo), "E901", "cost file")


def test_an_input_above_64_mib_is_refused_unread(tmp_path):
    big = tmp_path / "big.pipe"
    with open(big, "wb") as f:
        f.truncate(files.MAX_INPUT_BYTES + 1)  # sparse: no disk, yet 64 MiB and a byte
    _refused(_pipec("check", str(big)), "E901", "above the limit of 64 MiB")


# ---- cost files -----------------------------------------------------------------


def _profile_doc() -> dict:
    """A cost document shaped as `pipec profile` makes one (runtime/profile/stages.py's cost_doc)."""
    return {
        "comment": "measured by pipec profile: 1f1b (p=4 m=8), model examples/mlp.py",
        "unit": "s",
        "schedule": "1f1b",
        "params": "p=4 m=8",
        "F": [0.001, 0.001, 0.001, 0.0012],
        "B": [0.002, 0.002, 0.002, 0.0024],
        "act_bytes": [65536, 65536, 65536, 0],
        "grad_bytes": [0, 65536, 65536, 65536],
        "latency": 5e-05,
        "bandwidth": 8000000000.0,
        "overhead": 1e-05,
        "measured": {"stages": {"forward": [0.001] * 4}, "run": {"reps": 20}},
    }


def test_an_empty_cost_file_is_not_the_defaults(tmp_path):
    (tmp_path / "empty.toml").write_bytes(b"")
    _refused(_pipec("simulate", "1f1b", "--cost", str(tmp_path / "empty.toml")), "E801", "is empty")


@pytest.mark.parametrize("toml", [True, False])
def test_a_profile_cost_file_cut_short_is_refused(tmp_path, toml):
    path = tmp_path / ("costs.toml" if toml else "costs.json")
    text = dump_costs(_profile_doc(), toml=toml)
    path.write_text(text)
    whole = _pipec("simulate", "1f1b", "--cost", str(path), "--json")
    assert whole.returncode == 0, whole.stderr  # the whole file reads
    assert json.loads(whole.stdout)["results"][0]["costs"]["free_comm"] is False
    path.write_text("".join(text.splitlines(keepends=True)[:8]))  # the cut: 8 lines
    if toml:  # still valid TOML: the declared entries and the end marker tell it from a whole file
        run = _pipec("simulate", "1f1b", "--cost", str(path))
        _refused(run, "E801", "is incomplete (truncated?): it lacks the entries `F`, `B`, `act_bytes`")
        assert "the `[end]` marker" in run.stderr
    else:  # cut JSON does not parse
        _refused(_pipec("simulate", "1f1b", "--cost", str(path)), "E801", "is not valid JSON")


def test_a_version_2_file_whose_lists_disagree_with_its_stages(tmp_path):
    text = dump_costs(_profile_doc()).replace("F = [0.001, 0.001, 0.001, 0.0012]", "F = [0.001, 0.001]")
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(PipecError) as info:
        read_cost_file(tmp_path / "c.toml")
    assert info.value.code == "E801" and "`F` lists 2 values but the file declares 4 stages" in str(info.value)


def test_hand_written_cost_files_without_a_version_read_as_before(tmp_path):
    (tmp_path / "mine.toml").write_text("F = 1\nB = 2\n")
    assert read_cost_file(tmp_path / "mine.toml")["B"] == 2.0
    (tmp_path / "v1.toml").write_text('format = "pipec-costs"\nversion = 1\nF = 1\n')
    assert read_cost_file(tmp_path / "v1.toml")["F"] == 1.0


@pytest.mark.parametrize(
    ("name", "body", "shown"),
    [
        ("big.toml", "F = " + "9" * 400 + "\n", "is out of range (at most 1e+18)"),
        ("big.json", '{"F": ' + "9" * 400 + "}", "is out of range (at most 1e+18)"),
        ("nest.json", '{"F": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests its JSON too deeply"),
        ("nest.toml", "F = " + "[" * 100_000 + "]" * 100_000 + "\n", "nests its TOML too deeply"),
        ("f308.json", '{"F": 1e308, "B": 1e308}', "`1e+308` is out of range"),
        ("rpn.toml", "ranks_per_node = " + "9" * 400 + "\n", "ranks_per_node must be a positive integer"),
        ("bw.toml", "bandwidth = 1e-300\n", "is out of range"),
    ],
)
def test_absurd_numbers_and_nesting_in_cost_files(tmp_path, name, body, shown):
    (tmp_path / name).write_text(body)
    _refused(_pipec("simulate", "1f1b", "--cost", str(tmp_path / name)), "E801", shown)


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        ("F=1e308", "`1e+308` is out of range"),
        ("F=1e308,B=1e308", "`1e+308` is out of range"),
        ("F=nan", "expected a finite number >= 0"),
        ("F=inf", "expected a finite number >= 0"),
        ("F=1_0", "cannot read `1_0` as a time"),
        ("F=٤", "cannot read `٤` as a time"),
    ],
)
def test_absurd_cost_overrides(spec, shown):
    _refused(_pipec("simulate", "1f1b", "--cost", spec), "E801", shown)


def test_a_schedule_declaring_an_absurd_cost_is_refused_before_it_overflows(tmp_path):
    text = (ROOT / "schedules" / "gpipe.pipe").read_text()
    head, brace, rest = text.partition("{\n")
    (tmp_path / "t.pipe").write_text(head + brace + "    cost F = 1e300\n" + rest)
    _refused(_pipec("simulate", str(tmp_path / "t.pipe")), "E801", "cost `F` is out of range")


# ---- command-line values ----------------------------------------------------------


@pytest.mark.parametrize("value", ["1_0", "٤", "0x4", "4.0"])
def test_define_values_are_the_languages_own_integers(value):
    _refused(_pipec("check", "1f1b", "-D", f"p={value}"), "E206", "parameter `p` must be int")


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["check", "1f1b", "--memory-limit", "nan"], "argument --memory-limit: expected a number >= 0"),
        (["check", "1f1b", "--memory-limit", "inf"], "argument --memory-limit: expected a number >= 0"),
        (["check", "1f1b", "--memory-limit", "1_0"], "argument --memory-limit: expected a number >= 0"),
        (["check", "1f1b", "--mem", "act=nan"], "argument --mem: expected a number >= 0"),
        (["run", "1f1b", "--timeout", "-1"], "argument --timeout: expected a number > 0 (ASCII digits)"),
        (["run", "1f1b", "--timeout", "0"], "argument --timeout: expected a number > 0, got `0`"),
        (["synth", "-p", "1000000000", "-m", "4"], "argument -p: expected an integer from 1 to 10,000,000"),
        (["synth", "-p", "100000", "-m", "1000"], "make 300,000,000 ops, above the limit of 50,000,000"),
        (["synth", "-p", "٤", "-m", "4"], "argument -p: expected an integer (ASCII digits)"),
    ],
)
def test_absurd_option_values_are_misuse(argv, shown):
    _refused(_pipec(*argv), None, shown)


# ---- Program files ------------------------------------------------------------------


@pytest.fixture(scope="module")
def program():
    return compile_program("gpipe", p=2, m=2)


def _json_with(program, **changes) -> str:
    doc = json.loads(to_json(program))
    doc.update(changes)
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("change", "code", "shown"),
    [
        ({"num_stages": int("9" * 400)}, "E501", "`num_stages` must be an integer from 1 to 10,000,000"),
        ({"num_ranks": 1}, "E502", "not one of the 1 ranks"),
        ({"placement": "01"}, "E501", "placement must be a list of ranks"),
        ({"num_microbatches": True}, "E501", "`num_microbatches` must be an integer"),
    ],
)
def test_a_json_program_whose_header_is_absurd(tmp_path, program, change, code, shown):
    (tmp_path / "p.json").write_text(_json_with(program, **change))
    _refused(_pipec("check", str(tmp_path / "p.json")), code, shown)


def test_a_json_program_with_opcode_minus_one_or_deep_nesting(tmp_path, program):
    doc = json.loads(to_json(program))
    doc["ranks"][0]["instructions"][0][0] = -1
    (tmp_path / "op.json").write_text(json.dumps(doc))
    _refused(_pipec("check", str(tmp_path / "op.json")), "E502", "no such opcode")
    text = to_json(program)
    (tmp_path / "deep.json").write_text(text[:-1] + ',"x":' + "[" * 100_000 + "]" * 100_000 + "}")
    _refused(_pipec("check", str(tmp_path / "deep.json")), "E501", "malformed program JSON")


@pytest.mark.parametrize(
    ("old", "new", "code", "shown"),
    [
        ("stages 2 ", "stages " + "9" * 400 + " ", "E501", "`stages` must be an integer from 1 to 10,000,000"),
        ("ranks 2 ", "ranks 1 ", "E502", "not one of the 1 ranks"),  # its shape disagrees with its streams
    ],
)
def test_a_text_program_whose_header_is_absurd(tmp_path, program, old, new, code, shown):
    text = to_text(program)
    assert old in text
    (tmp_path / "p.txt").write_text(text.replace(old, new, 1))
    run = _pipec("check", str(tmp_path / "p.txt"))
    _refused(run, code, shown)
    assert "9" * 400 not in run.stderr  # quoted by its ends, the line cut around the caret


# ---- messages -------------------------------------------------------------------------


def test_a_one_megabyte_line_is_quoted_around_the_caret_not_whole():
    line = "F(0) " * 200_000
    d = Diagnostic("E302", "op emitted twice", Span(2, 500_001, 2, 500_005), Source("t.pipe", "x\n" + line + "\n"))
    out = d.format().splitlines()
    assert len(out[1]) < 250 and out[1].startswith("   2 | ...") and out[1].endswith("...")
    at = out[2].index("^")
    assert out[1][at : at + 4] == "F(0)" and out[2].strip() == "^^^^"


def test_pipec_test_prints_its_diagnostics_on_stderr(tmp_path, capsys):
    (tmp_path / "bad.pipe").write_text(
        'schedule "bad" (p: int = 2, m: int = 2) {\n    stages p\n    place s -> s\n    ops F, B\n'
        "    rank r {\n        for i in 0 .. m { F(i + 1) }\n        for i in 0 .. m { B(i) }\n    }\n}\n"
    )
    assert cli.main(["test", str(tmp_path / "bad.pipe"), "--examples", "3"]) == 1
    out, err = capsys.readouterr()
    assert "error[E" in err and "FAILED at" in err and "reproduce: pipec check" in err
    assert "error[" not in out and "1 file: 0 ok, 1 failed" in out


# ---- sizes that would not fit ------------------------------------------------------------


@pytest.mark.parametrize("argv", [["check", "1f1b", "-D", "p=2", "-D", "m=1000"], ["simulate", "gpipe", "-D", "p=8"]])
def test_a_schedule_too_large_for_the_machine_is_refused_naming_its_size(argv, monkeypatch, capsys):
    """As `check 1f1b -D p=2 -D m=5000000` on a machine without 20 GB free: the estimate is checked before
    the checks allocate (the machine's free memory is made small here instead of the schedule large)."""
    monkeypatch.setattr(files, "available_memory", lambda: 2**16)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "error[E902]" in err and "ops) needs about" in err and "64 KiB available" in err
    assert "Traceback" not in err


def test_the_links_of_many_ranks_are_held_per_datacenter_pair(tmp_path):
    """As `check 1f1b -D p=100000` (its (ranks, ranks) link tables needed 745 GiB and the check time per op
    grew with p): the cost model holds a link per pair of datacenters and node sharing (pipec.sim.pairs), so
    10,000 ranks in two datacenters hold a few numbers, and a pair reads what the matrix held."""
    import numpy as np

    from pipec.api import load
    from pipec.sim.costs import cost_model
    from pipec.sim.topology_links import LINK_CLASSES, LINK_DEFAULTS

    f = tmp_path / "big.pipe"
    f.write_text(
        'schedule "big" (p: int = 10000, m: int = 2) {\n stages p\n place s -> s\n ops F, B\n'
        ' topology {\n  dc "a" ranks 0 .. 5000\n  dc "b" ranks 5000 .. 10000\n'
        '  link "a" <-> "b" latency 40ms bandwidth 10Gbps\n }\n'
        " rank r { for i in 0 .. 2 { F(mb: i) } for i in 0 .. 2 { B(mb: i) } }\n}\n"
    )
    cm = cost_model(load(f))
    assert cm.latency.table.size <= 8 and cm.link_class.table.size <= 8
    a, b = np.array([0, 1, 4999, 5000, 7]), np.array([1, 5001, 5000, 9999, 7])
    inside = LINK_DEFAULTS["dc"][0]
    assert cm.latency[a, b].tolist() == [inside, 0.04, 0.04, inside, 0.0]
    assert cm.bandwidth[1, 5001] * 8 == 10e9 and cm.bandwidth[7, 7] == np.inf
    classes = [LINK_CLASSES[c] if c >= 0 else None for c in cm.link_class[a, b].tolist()]
    assert classes == ["dc", "cross", "cross", "dc", None]
    assert cm.describe()["links"]["cross"]["pairs"] == 5000 * 5000


# ---- the front end ----------------------------------------------------------------------

HEAD = 'schedule "t" (p: int = 2, m: int = 2) {\n    stages p\n    place s -> s\n    ops F, B\n    rank r {\n'
TAIL = "\n    }\n}\n"


def _front_end_refuses(text: str) -> Diagnostic:
    from pipec.frontend.parse import parse

    with pytest.raises(PipecError) as e:
        parse(Source("t.pipe", text))
    return e.value.diagnostics[0]


def test_a_one_megabyte_source_line_is_refused_at_that_line_before_parsing(tmp_path):
    """200,000 `F(0)` on one line took lark 20 s or more; the line is refused before lark sees it."""
    d = _front_end_refuses(HEAD + "F(0) " * 200_000 + TAIL)
    assert d.code == "E901" and d.span.line == 6
    assert "line 6 is 1,000,000 characters long, above the limit of 10,000" in d.message
    (tmp_path / "t.pipe").write_text(HEAD + "F(0) " * 200_000 + TAIL)
    _refused(_pipec("check", str(tmp_path / "t.pipe")), "E901", "above the limit of 10,000")


def test_ten_thousand_nested_parentheses_are_too_deep():
    """Parentheses leave no node in lark's tree, so the tree's depth check never saw them."""
    one_line = _front_end_refuses(HEAD + "let x = " + "(" * 10_000 + "1" + ")" * 10_000 + TAIL)
    assert one_line.code == "E003" and "more than 150 levels deep" in one_line.message
    assert (one_line.span.line, one_line.span.col) == (6, 9 + 150)
    many_lines = _front_end_refuses(HEAD + "let x = " + "(\n" * 10_000 + "1" + "\n)" * 10_000 + TAIL)
    assert many_lines.code == "E003" and many_lines.span.line == 6 + 150


def test_parentheses_in_comments_and_strings_and_in_turn_are_not_nesting():
    from pipec.frontend.parse import parse

    text = HEAD + "# " + "(" * 200 + '\n        require 1 == 1, "' + "(" * 200 + '"\n'
    text += "let y = " + "(1) + " * 100 + "0\n        F(0)" + TAIL
    assert parse(Source("t.pipe", text)).name == "t"


@pytest.mark.parametrize(
    ("typ", "value"), [("int", "1_0"), ("int", "٤"), ("int", "0x4"), ("float", "1_0.5"), ("float", "٤.5")]
)
def test_define_values_are_ascii_literals_in_the_evaluator_itself(typ, value):
    """`parse_value` (pipec.frontend.params), not only the API's own check: int() and float() take `1_0` and `٤`."""
    from pipec.frontend.codegen import compile_ast
    from pipec.frontend.evaluate import evaluate
    from pipec.frontend.parse import parse

    src = Source("t.pipe", HEAD.replace("(p: int = 2,", f"(p: int = 2, q: {typ} = 1,") + "F(0)  B(0)" + TAIL)
    code = compile_ast(parse(src), src)
    with pytest.raises(PipecError) as e:
        evaluate(code, src, [("q", value)])
    d = e.value.diagnostics[0]
    assert d.code == "E206" and f"parameter `q` must be {typ}, got `{value}`" in d.message
    assert evaluate(code, src, [("q", " -3 ")]).num_ops == 4  # what was taken before is taken still


def test_a_schedule_too_large_for_memory_is_refused_before_evaluation_allocates(monkeypatch):
    """20,000,000 ops of 1F1B on a machine with 64 KiB: E902 at the `stages` declaration, from the evaluator
    (the API's own estimate, after evaluation, names no line)."""
    from pipec.api import load

    monkeypatch.setattr(files, "available_memory", lambda: 2**16)
    with pytest.raises(PipecError) as e:
        load("1f1b", p=2, m=5_000_000)
    d = e.value.diagnostics[0]
    assert d.code == "E902" and "(20,000,000 ops) needs about 18.6 GiB" in d.message
    assert d.span is not None and d.source.line(d.span.line).strip() == "stages p"


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_the_library_reader_refuses_a_fifo_or_device_itself(kind, fifo):
    """`pipec.frontend.library.read`, not only the API in front of it (a fresh process: a hang guard)."""
    path = fifo if kind == "fifo" else "/dev/zero"
    code = (
        "from pipec.errors import PipecError\nfrom pipec.frontend.library import read\n"
        f"try:\n    read({path!r})\nexcept PipecError as e:\n    print(e.code, e.diagnostics[0].message)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD, env=env)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    shown = "is a FIFO, not a regular file" if kind == "fifo" else "is a character device, not a regular file"
    assert run.stdout.startswith("E901 schedule file `") and shown in run.stdout
