"""The `pipec` command: list, check, show, help, exit statuses, `python -m pipec`, and the documented runs.

Most tests call `pipec.cli.app.main` in-process (fast); a few run the real
executable in a subprocess to prove the entry points work.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli as run
from repo import ROOT

from pipec.frontend import library

EXAMPLES = sorted((ROOT / "examples").glob("*.pipe"))


def one_f_one_b_cells(p: int, m: int) -> list[list[str]]:
    """1F1B by its definition: rank r runs min(p-1-r, m) forwards, then alternates F and B, then the last Bs."""
    ranks = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        cells = [f"F{i}" for i in range(warm)]
        for i in range(m - warm):
            cells += [f"F{i + warm}", f"B{i}"]
        cells += [f"B{i}" for i in range(m - warm, m)]
        ranks.append(cells)
    return ranks


def parse_grid(text: str) -> tuple[str, list[str], list[list[str]]]:
    """`pipec show` output to (title, column heads, one list of cells per rank). Every cell must be non-empty."""
    title, head, *rows = text.rstrip("\n").split("\n")
    heads = re.findall(r"Rank \d+", head)
    cols: list[list[str]] = [[] for _ in heads]
    for t, row in enumerate(rows):
        assert row.startswith(f"Step {t:02d} "), row
        cells = row[len(f"Step {t:02d} ") :].split()
        assert len(cells) == len(heads), row
        for c, cell in zip(cols, cells):
            c.append(cell)
    return title, heads, cols


# ---- pipec list ----------------------------------------------------------------------------------------------------


def test_list_prints_every_library_schedule_with_its_summary():
    rc, out, err = run("list")
    assert (rc, err) == (0, "")
    lines = out.rstrip("\n").split("\n")
    names = library.names()
    assert {"1f1b", "gpipe"} <= set(names)
    assert [line.split()[0] for line in lines] == names == sorted(names)
    width = max(map(len, names))
    for name, line in zip(names, lines):
        assert line == f"{name.ljust(width)}  {library.summary(name)}"
    assert lines[names.index("1f1b")].endswith("1F1B (PipeDream-Flush): one forward, one backward in the steady state.")


# ---- pipec check ---------------------------------------------------------------------------------------------------


def test_check_prints_one_summary_line():
    rc, out, err = run("check", "1f1b", "-D", "p=4", "-D", "m=8")
    assert (rc, out, err) == (0, "1f1b (p=4 m=8): 4 stages, 4 ranks, 64 ops: OK\n", "")


def test_check_uses_the_defaults_and_the_D_overrides():
    assert run("check", "gpipe")[1] == "gpipe (p=4 m=8): 4 stages, 4 ranks, 64 ops: OK\n"
    assert run("check", "gpipe", "-D", "m=3")[1] == "gpipe (p=4 m=3): 4 stages, 4 ranks, 24 ops: OK\n"
    assert run("check", "gpipe", "-Dp=2", "-D", " m = 5 ")[1] == "gpipe (p=2 m=5): 2 stages, 2 ranks, 20 ops: OK\n"


def test_check_json_fields():
    rc, out, err = run("check", "1f1b", "-D", "p=4", "-D", "m=8", "--json")
    assert (rc, err) == (0, "")
    assert out.count("\n") == 1
    summary = json.loads(out)
    expected = {
        "schedule": "1f1b",
        "source": "<library>/1f1b.pipe",
        "params": {"p": 4, "m": 8},
        "stages": 4,
        "ranks": 4,
        "microbatches": 8,
        "ops": 64,
        "kinds": ["F", "B"],
        "placement": [0, 1, 2, 3],
        "ok": True,
    }
    assert {k: summary.get(k) for k in expected} == expected


def test_check_json_of_a_file_names_the_file_and_typed_params(tmp_path):
    path = tmp_path / "typed.pipe"
    path.write_text(
        'schedule "typed" (p: int = 2, m: int = 2, x: float = 1, on: bool = false, tag: str = "a") {\n'
        "    stages p\n    rank r { for i in 0 .. m { F(i) } for i in 0 .. m { B(i) } }\n}\n"
    )
    rc, out, _ = run("check", str(path), "-D", "x=2", "-D", "on=true", "-D", "tag=eager", "--json")
    summary = json.loads(out)
    assert rc == 0
    assert summary["source"] == str(path)
    assert summary["params"] == {"p": 2, "m": 2, "x": 2.0, "on": True, "tag": "eager"}
    assert isinstance(summary["params"]["x"], float)


def test_a_schedule_error_is_a_diagnostic_on_stderr_with_status_1():
    rc, out, err = run("check", "1f1b", "-D", "m=0")
    assert (rc, out) == (1, "")
    first, source_line, caret, note = err.rstrip("\n").split("\n")
    assert re.fullmatch(
        r"<library>/1f1b\.pipe:\d+:\d+: error\[E202\]: requirement failed: need at least one micro-batch", first
    )
    assert source_line.split("| ")[1].strip() == 'require m >= 1, "need at least one micro-batch"'
    assert set(caret.strip()) == {"^"}
    assert note == "  = note: with p=4, m=0"


@pytest.mark.parametrize(
    "argv, code",
    [
        (["check", "1f1b", "-D", "m=eight"], "E206"),
        (["check", "1f1b", "-D", "q=1"], "E205"),
        (["check", "1f1b", "-D", "m=1", "-D", "m=2"], "E204"),
        (["show", "1f1b", "-D", "p=0"], "E202"),
        (["check", "no-such-schedule"], "E000"),
        (["check", "missing/file.pipe"], "E000"),
    ],
)
def test_parameter_errors_exit_1(argv, code):
    rc, out, err = run(*argv)
    assert (rc, out) == (1, "")
    assert f"error[{code}]" in err


def test_a_broken_file_exits_1(tmp_path):
    path = tmp_path / "broken.pipe"
    path.write_text('schedule "broken" (p: int = 1, m: int = 1) {\n    stages p\n    rank r { F(0) }\n}\n')
    rc, out, err = run("check", str(path))
    assert (rc, out) == (1, "")
    assert err.startswith(f"{path}:3:5: error[E303]: B(0, stage 0) is never emitted")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["check", "1f1b", "-D", "m"], "expected NAME=VALUE, got `m`"),
        (["check", "1f1b", "-D", "=3"], "expected NAME=VALUE"),
        (["check"], "the following arguments are required"),
        (["frobnicate"], "invalid choice"),
        ([], "the following arguments are required: COMMAND"),
        (["show", "1f1b", "--ranks", "zero"], "--ranks expects numbers like 0,3, got `zero`"),
        (["show", "1f1b", "--ranks", "0,4"], "rank 4 is not in 0..3"),
    ],
)
def test_command_line_misuse_exits_2(argv, needle):
    rc, out, err = run(*argv)
    assert (rc, out) == (2, "")
    assert needle in err


def test_an_unreadable_schedule_is_an_input_error_naming_it():
    rc, out, err = run("check", "no-such-schedule")
    assert (rc, out) == (1, "")
    assert "error[E000]: no schedule file or library schedule named `no-such-schedule`" in err
    assert "library: " + ", ".join(library.names()) in err
    rc, out, err = run("check", "missing/file.pipe")
    assert (rc, out) == (1, "") and "error[E000]: cannot read `missing/file.pipe`" in err


# ---- pipec show ----------------------------------------------------------------------------------------------------

SHOW_1F1B_P4_M8 = """\
1f1b (p=4 m=8): 4 stages on 4 ranks, 8 micro-batches
        Rank 0 Rank 1 Rank 2 Rank 3
Step 00 F0     F0     F0     F0
Step 01 F1     F1     F1     B0
Step 02 F2     F2     B0     F1
Step 03 F3     B0     F2     B1
Step 04 B0     F3     B1     F2
Step 05 F4     B1     F3     B2
Step 06 B1     F4     B2     F3
Step 07 F5     B2     F4     B3
Step 08 B2     F5     B3     F4
Step 09 F6     B3     F5     B4
Step 10 B3     F6     B4     F5
Step 11 F7     B4     F6     B5
Step 12 B4     F7     B5     F6
Step 13 B5     B5     F7     B6
Step 14 B6     B6     B6     F7
Step 15 B7     B7     B7     B7
"""


def test_show_1f1b_p4_m8_is_exactly_the_1f1b_grid():
    rc, out, err = run("show", "1f1b", "-D", "p=4", "-D", "m=8")
    assert (rc, err) == (0, "")
    assert out == SHOW_1F1B_P4_M8
    title, heads, cols = parse_grid(out)
    assert title == "1f1b (p=4 m=8): 4 stages on 4 ranks, 8 micro-batches"
    assert heads == [f"Rank {r}" for r in range(4)]
    assert cols == one_f_one_b_cells(4, 8)


@pytest.mark.parametrize("p, m", [(1, 1), (2, 3), (4, 2), (5, 7), (8, 3)])
def test_show_1f1b_follows_its_definition(p, m):
    rc, out, _ = run("show", "1f1b", "-D", f"p={p}", "-D", f"m={m}")
    assert rc == 0
    title, heads, cols = parse_grid(out)
    assert title == f"1f1b (p={p} m={m}): {p} stages on {p} ranks, {m} micro-batches"
    assert cols == one_f_one_b_cells(p, m)
    for r, cells in enumerate(cols):
        warm = min(p - 1 - r, m)
        assert cells[:warm] == [f"F{i}" for i in range(warm)]  # the warm-up
        steady = cells[warm : 2 * m - warm]
        assert [c[0] for c in steady] == ["F", "B"] * (m - warm)  # then one forward, one backward
        assert cells[2 * m - warm :] == [f"B{i}" for i in range(m - warm, m)]  # then the remaining backwards


def test_show_only_some_ranks():
    rc, out, _ = run("show", "1f1b", "-D", "p=4", "-D", "m=8", "--ranks", "0,3")
    assert rc == 0
    title, heads, cols = parse_grid(out)
    full = one_f_one_b_cells(4, 8)
    assert heads == ["Rank 0", "Rank 3"]
    assert cols == [full[0], full[3]]


def test_show_marks_overlapped_pairs_and_stages_of_multi_stage_ranks(tmp_path):
    path = tmp_path / "pairs.pipe"
    path.write_text(
        'schedule "pairs" (p: int = 1, m: int = 2) {\n    stages 2\n'
        "    rank r {\n        F(0, stage: 0)  F(0, stage: 1)  F(1, stage: 0) & B(0, stage: 1)\n"
        "        F(1, stage: 1)  B(0, stage: 0) & B(1, stage: 1)  B(1, stage: 0)\n    }\n}\n"
    )
    rc, out, err = run("show", str(path))
    assert (rc, err) == (0, "")
    assert out.split("\n")[2:] == [
        "Step 00 F0.0",
        "Step 01 F0.1",
        "Step 02 F1.0&B0.1",
        "Step 03 F1.1",
        "Step 04 B0.0&B1.1",
        "Step 05 B1.0",
        "",
    ]


# ---- help --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, mentions",
    [
        ([], ["check", "show", "list", "Library schedules:", "1f1b"]),
        (["check"], ["-D NAME=VALUE", "--json", "FILE|NAME"]),
        (["show"], ["-D NAME=VALUE", "--ranks", "FILE|NAME"]),
        (["list"], ["-h, --help"]),
    ],
)
def test_help_of_each_command_exits_0_and_mentions_its_options(argv, mentions):
    rc, out, err = run(*argv, "--help")
    assert (rc, err) == (0, "")
    assert out.startswith("usage: pipec")
    for word in mentions:
        assert word in out, word


# ---- entry points ------------------------------------------------------------------------------------------------


def test_python_dash_m_pipec(tmp_path):
    # From another directory, so the installed package (not the checkout on sys.path) is what runs.
    done = subprocess.run(
        [sys.executable, "-m", "pipec", "check", "1f1b", "-D", "p=2", "-D", "m=2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "1f1b (p=2 m=2): 2 stages, 2 ranks, 8 ops: OK\n", "")
    done = subprocess.run(
        [sys.executable, "-m", "pipec", "check", "1f1b", "-D", "m=0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "error[E202]" in done.stderr


def test_the_pipec_executable_next_to_python():
    exe = Path(sys.executable).parent / "pipec"
    if not exe.exists():
        pytest.skip("no `pipec` console script next to this interpreter (package not installed)")
    done = subprocess.run([str(exe), "list"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert done.stdout.split("\n")[0].split()[0] == library.names()[0]


# ---- examples and documented runs -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_checks_clean(path):
    rc, out, err = run("check", str(path))
    assert (rc, err) == (0, ""), err
    assert out.endswith(": OK\n")


def test_the_examples_readme_lists_every_example_with_a_command_that_works(monkeypatch):
    monkeypatch.chdir(ROOT)
    readme = (ROOT / "examples" / "README.md").read_text()
    rows = [line for line in readme.split("\n") if line.startswith("| [`")]
    listed = [re.match(r"\| \[`([^`]+)`\]", row).group(1) for row in rows]
    assert sorted(listed) == [p.name for p in EXAMPLES]
    for name, row in zip(listed, rows):
        commands = re.findall(r"`(pipec [^`]+)`", row)
        assert commands, f"no command for {name}"
        for command in commands:
            argv = shlex.split(command)[1:]
            assert f"examples/{name}" in argv
            rc, out, err = run(*argv)
            assert (rc, err) == (0, ""), f"{command}: {err}"


def console_runs(doc: Path) -> list[tuple[int, str, str]]:
    """(line, command, expected output) for each `$ pipec ...` line of the ```console blocks of a document."""
    runs = []
    text = doc.read_text()
    for m in re.finditer(r"^```console\n(.*?)^```", text, re.S | re.M):
        first_line = text.count("\n", 0, m.start()) + 2
        lines = m.group(1).split("\n")[:-1]
        starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
        assert starts and starts[0] == 0, f"{doc.name}:{first_line}: a console block starts with `$ command`"
        for a, b in zip(starts, starts[1:] + [len(lines)]):
            runs.append((first_line + a, lines[a][2:], "".join(line + "\n" for line in lines[a + 1 : b])))
    return runs


DOC_RUNS = console_runs(ROOT / "docs" / "language.md")


def test_the_reference_shows_real_runs():
    commands = [c for _, c, _ in DOC_RUNS]
    assert any(c.startswith("pipec show examples/extra_warmup_1f1b.pipe") for c in commands)
    assert any(c.startswith("pipec check") for c in commands)


@pytest.mark.parametrize("line, command, expected", DOC_RUNS, ids=[f"line{x[0]}" for x in DOC_RUNS])
def test_each_documented_run_prints_what_the_reference_shows(monkeypatch, line, command, expected):
    monkeypatch.chdir(ROOT)
    argv = shlex.split(command)
    assert argv[0] == "pipec"
    rc, out, err = run(*argv[1:])
    assert out + err == expected, f"docs/language.md:{line}: `{command}` prints something else now"
    assert rc == (1 if err else 0)


def test_the_python_snippet_of_the_reference_runs(monkeypatch):
    monkeypatch.chdir(ROOT)
    text = (ROOT / "docs" / "language.md").read_text()
    snippets = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert snippets
    for code in snippets:
        exec(compile(code, "docs/language.md", "exec"), {})
