"""The import contract bites, and the import graph has no circles: folders are floors (docs/architecture.md).

`lint-imports` (run by `.ci/lint-imports`) checks pyproject's `[tool.importlinter]` contract on this tree:
pipec/runtime is a link to runtime/, so it sees pipec.runtime where the installed package has it (the
editable install maps it from runtime/, which import-linter cannot see). Here: the contract holds; an upward
import injected into a copy of the package fails it, named; and what a layers contract does not say
on its own: no two modules import each other, directly or round a circle, and no two folders do. Imports
inside functions count, as for the contract (grimp reads whole modules); `if TYPE_CHECKING:` ones do not.

A folder is a floor: `pipec.X` for a package or a top-level module of pipec (`pipec.frontend`,
`pipec.api`), and inside the runtime `pipec.runtime.X` (`pipec.runtime.exec`, `pipec.runtime.errors`).

There is no circle left (issue 27 removed the last); a new one fails here, named.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import networkx as nx
import pytest
from repo import ROOT

# Run in the copy, by a fresh interpreter: this process has imported the working tree's pipec already.
_GRAPH = """
import json, sys
import grimp, pipec
assert pipec.__file__.startswith(sys.argv[1]), pipec.__file__
g = grimp.build_graph("pipec", include_external_packages=False, exclude_type_checking_imports=True, cache_dir=None)
print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))
"""


def _tool_env(**extra: str) -> dict[str, str]:
    """The environment with this interpreter's scripts (lint-imports) first on PATH."""
    env = dict(os.environ, **extra)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


@pytest.fixture(scope="module")
def graph(tmp_path_factory) -> dict[str, set[str]]:
    """Module -> the modules it imports, of pipec and pipec.runtime laid out as installed."""
    top = tmp_path_factory.mktemp("installed")
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "pipec", top / "pipec", ignore=skip)  # pipec/runtime, a link to runtime/, copied whole
    done = subprocess.run(
        [sys.executable, "-c", _GRAPH, str(top)],
        cwd=top,
        env=_tool_env(PYTHONPATH=str(top), PYTHONSAFEPATH=""),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return {m: set(imported) for m, imported in json.loads(done.stdout).items()}


def _circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node: each holds at least one circle."""
    g = nx.DiGraph([(a, b) for a, bs in edges.items() for b in bs])
    return [c for c in nx.strongly_connected_components(g) if len(c) > 1]


def _folder(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:3] if parts[:2] == ["pipec", "runtime"] else parts[:2])


def _folders(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for m, imported in graph.items():
        for n in imported:
            if _folder(m) != _folder(n):
                edges.setdefault(_folder(m), set()).add(_folder(n))
    return edges


def test_the_contract_holds_on_this_tree():
    done = subprocess.run(
        [str(ROOT / ".ci" / "lint-imports")], env=_tool_env(), capture_output=True, text=True, timeout=120
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Contracts: 3 kept, 0 broken." in out, out


def test_an_upward_import_fails_the_contract(tmp_path):
    probe = tmp_path / "ir" / "upward_probe.py"
    probe.parent.mkdir()
    probe.write_text('"""Floor 1 importing the top floor."""\n\nfrom pipec.cli import app  # noqa: F401\n')
    done = subprocess.run(
        [str(ROOT / ".ci" / "lint-imports"), str(tmp_path)],
        env=_tool_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "pipec.ir is not allowed to import pipec.cli" in out, out
    assert "pipec.ir.upward_probe -> pipec.cli.app" in out, out


def test_the_graph_holds_the_runtime_and_imports_inside_functions(graph):
    assert "pipec.runtime.exec.executor" in graph  # the installed layout: runtime/ as pipec.runtime
    assert "pipec.passes.checks" in graph["pipec.formats.torch_csv_reader"]  # imported inside read_csv


def test_no_module_cycles(graph):
    assert _circles(graph) == []


def test_no_folder_cycles(graph):
    assert _circles(_folders(graph)) == []
