"""The CLI's start-up stays quick: what `pipec --version` and `pipec list` import, and for how long.

A fresh process runs `python -X importtime`, which writes every import with its own and its cumulative time
in microseconds. The robust part is the set of modules: numpy, lark, matplotlib, torch and argcomplete are
for the commands that build arrays, parse schedule text, draw, train or complete, so `--version` and `list`
must not import them, and the pipec modules each may import are listed below (a new one is a deliberate
act: add it here, and say why in the commit). The time is a generous budget, 3x what the CLI took on the
machine that set it (2 shared CPU cores, load about 1: docs/cli.md's "Start-up"), since CI machines vary;
it catches an import that grows by tens of milliseconds, not a jitter.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from repo import ROOT

import pipec
from pipec.cli import app

HEAVY = ("numpy", "lark", "matplotlib", "torch", "argcomplete")

# The pipec modules each start-up may import. `--version`: the package, the CLI's registry and its
# envelope, and pipec.formats (the package only: the Program format version is read from program_file's
# source, not imported). `list`: the `list` command's module and what its arguments need (the options'
# parsers, the library's file names); no front end, no IR beyond the two stdlib-only value types.
VERSION_MODULES = {"pipec", "pipec.moved", "pipec.cli", "pipec.cli.app", "pipec.cli.envelope", "pipec.formats"}
LIST_MODULES = VERSION_MODULES | {
    "pipec.cli.check",
    "pipec.cli.args",
    "pipec.options",
    "pipec.errors",
    "pipec.ir",
    "pipec.ir.dataparallel",
    "pipec.ir.experts",
    "pipec.frontend",
    "pipec.frontend.library",
}

# Cumulative import time in microseconds of what each command imports beyond a bare interpreter: 3x the
# median measured after the fast-start work (11.1 ms, 17.1 ms and 41.0 ms over 9 runs each at load 1.2-1.4
# on 2 shared cores; before it, 148 ms and 154 ms for --version and list). The test takes the least of
# RUNS runs, so one run slowed by other load does not fail it.
BUDGET_US = {"import pipec.cli.app": 33_000, "--version": 51_000, "list": 123_000}
RUNS = 3

_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)$")


def importtime(args: list[str], cwd: Path) -> tuple[set[str], dict[str, int]]:
    """Every module a fresh `python -X importtime ARGS` imported, and the cumulative microseconds of each
    top-level import (one not made by another module's import)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    modules, top = set(), {}
    for line in out.stderr.splitlines():
        m = _LINE.match(line)
        if m:
            modules.add(m.group(4))
            if len(m.group(3)) == 1:  # `| name`: imported at the top level
                top[m.group(4)] = top.get(m.group(4), 0) + int(m.group(2))
    return modules, top


def beyond_interpreter(top: dict[str, int], bare: dict[str, int]) -> int:
    """Microseconds of the top-level imports that a bare interpreter (`-c pass`) does not make."""
    return sum(us for name, us in top.items() if name not in bare)


CASES = {
    "import pipec.cli.app": (["-c", "import pipec.cli.app"], VERSION_MODULES),
    "--version": (["-m", "pipec", "--version"], VERSION_MODULES),
    "list": (["-m", "pipec", "list"], LIST_MODULES),
}


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    return importtime(["-c", "pass"], tmp_path_factory.mktemp("bare"))[1]


@pytest.mark.parametrize("case", list(CASES))
def test_start_up_imports_only_what_the_command_uses(case: str, tmp_path: Path, bare: dict[str, int]) -> None:
    args, allowed = CASES[case]
    runs = [importtime(args, tmp_path) for _ in range(RUNS)]
    modules = set().union(*(m for m, _ in runs))
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not heavy, f"`{case}` imports {heavy}: import them where they are used"
    ours = {m for m in modules if m == "pipec" or m.startswith("pipec.")}
    assert ours <= allowed, f"`{case}` imports {sorted(ours - allowed)}: a new import on the start-up path"
    assert "pipec.cli.app" in ours  # the measurement saw the CLI (not an empty run)
    spent = min(beyond_interpreter(top, bare) for _, top in runs)
    assert spent <= BUDGET_US[case], f"`{case}` imports for {spent} us, over its budget of {BUDGET_US[case]} us"


def test_version_prints_the_package_and_the_program_format_it_writes(tmp_path: Path) -> None:
    from pipec.formats.program_file import VERSION

    assert app.program_format() == VERSION  # read from program_file's source: the same number
    out = subprocess.run([sys.executable, "-m", "pipec", "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert (out.returncode, out.stdout) == (0, f"pipec {pipec.__version__} (Program format {VERSION})\n")


def test_the_package_version_is_pyprojects() -> None:
    project = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(pipec.__version__)}"$', project, re.M), "pyproject and __version__"


def test_the_registry_names_each_command_as_its_module_does() -> None:
    """The registry lists each command's name and aliases so that a run imports only its own module."""
    rows = [(name, aliases) for name, aliases, _, _ in app.REGISTRY]
    assert rows == [(c.name, c.aliases) for c in app.commands()]
    assert app.COMMANDS == app.commands()


@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["list"],
        ["--json", "list"],
        ["list", "--bogus"],
        ["compare", "1f1b", "--json"],
        ["show", "1f1b", "--version"],
        ["show", "--help"],
        ["--help"],
        ["--vers"],
        ["nosuch"],
        [],
        ["-D", "p=4", "check"],
    ],
)
def test_the_parser_made_for_argv_parses_it_as_the_whole_parser_does(argv: list[str]) -> None:
    """`main` makes only the subcommand argv runs (none for --version, all where in doubt): the outcome of
    parsing, the namespace or the exit with its text, is the whole parser's."""
    assert parse(app.parser(app._needed(argv)), argv) == parse(app.parser(), argv)


def parse(ap, argv: list[str]) -> tuple[object, str]:
    """What parsing argv gives: the namespace (or the exit status or misuse), and what was printed."""
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    from pipec.cli.envelope import Misuse

    out = StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        try:
            ns, extra = ap.parse_known_args(argv)
            result: object = (vars(ns), extra)
        except SystemExit as e:
            result = ("exit", e.code)
        except Misuse as e:
            result = ("misuse", str(e), e.parser.prog if e.parser else None)
    return result, out.getvalue()
