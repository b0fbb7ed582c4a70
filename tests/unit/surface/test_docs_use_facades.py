"""What users copy imports only the facades (issue 41): `pipec`, `pipec.runtime` and `pipec.testing`.

Every other module path may move (pipec/moved.py keeps the old ones for a release, with a DeprecationWarning),
so the code users copy from docs/*.md, README.md and examples/*.py must not teach them. Checked here:

- every examples/*.py, parsed with `ast`;
- every ```python block of docs/*.md, README.md and examples/README.md, parsed with `ast`. A block that does
  not parse as a whole is read as a doctest (`>>> ` and `... ` lines, prompts stripped, output lines dropped)
  and parsed again; a block that parses neither way is checked line by line with the regular expressions
  `IMPORT_RE` and `CHAIN_RE` (an `import` or `from ... import` of a pipec module, and a dotted `pipec.x.y` in
  the text), so no block is skipped. `test_every_block_is_checked` says how many took each road and fails if
  one was read by neither.

A violation is an `import pipec.X` or `from pipec.X import ...` of a module other than the three facades, a
`from pipec import name` (or `from pipec.runtime import name`, ...) of a name the facade does not export (a
submodule, say), an `importlib.import_module("pipec.X")` of a deep module, and an attribute chain that reaches
past a facade: `pipec.formats.program_file.write_json`, `pipec.runtime.runner.Runner`. `pipec.simulate(...)`
and `pipec.Program.from_json` are fine (a facade's name, then what that object offers). Prose that names a
module (docs/architecture.md) and ```console blocks are not code users import: they are not checked here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from repo import ROOT

import pipec
import pipec.runtime
import pipec.testing

FACADES: dict[str, set[str]] = {
    "pipec": set(pipec.__all__) | {"runtime", "testing"},
    "pipec.runtime": set(pipec.runtime.__all__),
    "pipec.testing": set(pipec.testing.__all__),
}

# The fallback for a block that is not Python even as a doctest: an import line of a pipec module, a dotted path.
IMPORT_RE = re.compile(
    r"^\s*(?:>>>\s*|\.\.\.\s*)?(?:from\s+(pipec(?:\.\w+)*)\s+import\s+([\w\s,()*]+)|import\s+(pipec[\w.]*))"
)
CHAIN_RE = re.compile(r"\bpipec(?:\.\w+)+")

FENCE_RE = re.compile(r"^(\s*)```python\s*$")


def _python_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line of the code, 1-based; code) for every ```python block of a Markdown file."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start, body = len(m.group(1)), i + 2, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        assert i < len(lines), f"{path.relative_to(ROOT)}:{start - 1}: a ```python block that never closes"
        blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    return blocks


def _doctest(code: str) -> str | None:
    """The source of a doctest-style block (prompts stripped, output dropped), or None if it has no `>>>`."""
    out, prompted = [], False
    for line in code.splitlines():
        s = line.lstrip()
        if s.startswith(">>>") or (s.startswith("...") and prompted):
            out.append(s[4:] if len(s) > 3 and s[3] == " " else s[3:])
            prompted = True
        else:
            out.append("")  # output: dropped, keeping the line numbers
            prompted = False
    return "\n".join(out) + "\n" if any(x.strip() for x in out) else None


def _dotted(node: ast.AST) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"], or None when the chain does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _past_facade(module: str, names: list[str]) -> str | None:
    """The deep path when `module.names[0].names[1]...` reaches past a facade, else None."""
    for name in names:
        if module not in FACADES:
            return module
        if name not in FACADES[module]:
            return f"{module}.{name}"
        if f"{module}.{name}" not in FACADES:
            return None  # a facade's export: what follows is that object's own attribute
        module = f"{module}.{name}"
    return None


def violations_in_tree(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, message) for each deep import or attribute chain in a parsed module."""
    found: list[tuple[int, str]] = []
    bound: dict[str, str] = {}  # local name -> the facade module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "pipec" or alias.name.startswith("pipec."):
                    if alias.name not in FACADES:
                        found.append((node.lineno, f"`import {alias.name}`: not a facade"))
                    elif alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound["pipec"] = "pipec"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mod = node.module
            if mod != "pipec" and not mod.startswith("pipec."):
                continue
            if mod not in FACADES:
                found.append((node.lineno, f"`from {mod} import ...`: not a facade"))
                continue
            for alias in node.names:
                if alias.name != "*" and alias.name not in FACADES[mod]:
                    found.append((node.lineno, f"`from {mod} import {alias.name}`: {mod} does not export it"))
                elif f"{mod}.{alias.name}" in FACADES:
                    bound[alias.asname or alias.name] = f"{mod}.{alias.name}"
        elif isinstance(node, ast.Call):
            f = _dotted(node.func)
            if f and f[-1] == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                target = node.args[0].value
                if isinstance(target, str) and target.startswith("pipec") and target not in FACADES:
                    found.append((node.lineno, f"`import_module({target!r})`: not a facade"))
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # part of a longer chain
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _dotted(node)
            if chain and chain[0] in bound:
                deep = _past_facade(bound[chain[0]], chain[1:])
                if deep:
                    found.append((node.lineno, f"`{'.'.join(chain)}` reaches past the facades ({deep})"))
    return sorted(set(found))


def violations_by_regex(code: str) -> list[tuple[int, str]]:
    """The fallback for a block that is not Python: import lines and dotted paths, line by line."""
    found = []
    for n, line in enumerate(code.splitlines(), 1):
        m = IMPORT_RE.match(line)
        if m and m.group(1):
            mod, names = m.group(1), [x.strip("() ") for x in m.group(2).split(",")]
            if mod not in FACADES:
                found.append((n, f"`from {mod} import ...`: not a facade"))
            else:
                found += [(n, f"`from {mod} import {x}`: not exported") for x in names if x and x not in FACADES[mod]]
        elif m and m.group(3) and m.group(3) not in FACADES:
            found.append((n, f"`import {m.group(3)}`: not a facade"))
        for chain in CHAIN_RE.findall(line):
            parts = chain.split(".")
            deep = _past_facade("pipec", parts[1:])
            if deep:
                found.append((n, f"`{chain}` reaches past the facades ({deep})"))
    return found


def check_code(code: str) -> tuple[str, list[tuple[int, str]]]:
    """How the code was read ("python", "doctest" or "regex") and its violations, lines relative to the code."""
    try:
        return "python", violations_in_tree(ast.parse(code))
    except SyntaxError:
        pass
    doctest = _doctest(code)
    if doctest is not None:
        try:
            return "doctest", violations_in_tree(ast.parse(doctest))
        except SyntaxError:
            pass
    return "regex", violations_by_regex(code)


def _sources() -> list[tuple[str, int, str]]:
    """(file relative to the root, line of the code's first line, code) for everything this test reads."""
    out = []
    for path in sorted((ROOT / "examples").glob("*.py")):
        out.append((str(path.relative_to(ROOT)), 1, path.read_text()))
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "examples" / "README.md"]:
        for line, code in _python_blocks(path):
            out.append((str(path.relative_to(ROOT)), line, code))
    return out


def test_docs_and_examples_import_only_the_facades():
    problems = []
    for name, first, code in _sources():
        _, found = check_code(code)
        problems += [f"{name}:{first + line - 1}: {msg}" for line, msg in found]
    assert not problems, "deep pipec paths in what users copy (use pipec, pipec.runtime, pipec.testing):\n" + "\n".join(
        problems
    )


def test_every_block_is_checked():
    """Each source is read one of the three ways, and there is something to read (the globs are right)."""
    sources = _sources()
    roads = {check_code(code)[0] for _, _, code in sources}
    assert roads <= {"python", "doctest", "regex"}
    assert sum(name.startswith("examples/") for name, _, _ in sources) >= 5
    assert sum(name.startswith("docs/") for name, _, _ in sources) >= 20


def test_the_checker_catches_what_it_should():
    """The rules on small cases: each bad form is caught, each good form passes."""
    bad = [
        "from pipec.runtime.model.split import split_model",
        "import pipec.formats.program_file",
        "from pipec import driver",
        "from pipec.runtime import runner",
        "import pipec\npipec.formats.program_file.write_json(p, f)",
        "import pipec.runtime\npipec.runtime.runner.Runner",
        "import pipec as pc\npc.driver.build(x)",
        "import importlib\nimportlib.import_module('pipec.sim.memtime')",
        "from pipec import runtime\nruntime.model.split",
    ]
    good = [
        "import pipec\npipec.simulate('1f1b', p=2, m=2).stats.makespan",
        "import pipec\npipec.Program.from_json",
        "from pipec.runtime import Runner, split_model",
        "from pipec.testing import check_invariants",
        "import pipec.runtime\npipec.runtime.Runner(prog)",
        "import pipec\nx = pipec.compile('1f1b', p=2, m=2)\nx.ranks[0]",
    ]
    for code in bad:
        assert check_code(code)[1], f"not caught: {code!r}"
    for code in good:
        assert not check_code(code)[1], f"wrongly caught: {code!r}: {check_code(code)[1]}"
    assert check_code(">>> from pipec.driver import build\n>>> build(x)\n33\n") == (
        "doctest",
        [(1, "`from pipec.driver import ...`: not a facade")],
    )
    road, found = check_code("$ python -c 'x'\nfrom pipec.sim.memtime import memory_curves (\n")
    assert road == "regex" and found
