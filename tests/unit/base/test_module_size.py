"""The house's line budget (issue 42: "no module is over 700 lines ... and a check in CI keeps both"): a module
that grows past it is split by what it does, into a module of its own named for it (as pipec/sim/plan.py and
pipec/sim/topology_links.py left simulate.py and costs.py).

Counted as `wc -l` counts (newline characters: every line, docstrings and comments included), over every module
of pipec/ and runtime/. pipec/runtime is a link to ../runtime (docs/architecture.md), so each file is counted
once, by its real path; __pycache__ is skipped.
"""

from __future__ import annotations

from repo import ROOT

LIMIT = 700


def _modules() -> dict[str, int]:
    """Each module's real path (relative to the checkout) -> its `wc -l` count."""
    sizes: dict[str, int] = {}
    for folder in ("pipec", "runtime"):
        for p in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in p.parts:
                continue
            real = p.resolve()
            sizes.setdefault(str(real.relative_to(ROOT.resolve())), real.read_bytes().count(b"\n"))
    return sizes


def test_the_count_sees_both_trees_once():
    sizes = _modules()
    assert len(sizes) > 100, "the globs found the packages"
    assert "pipec/sim/simulate.py" in sizes and "runtime/runner.py" in sizes
    assert not any(path.startswith("pipec/runtime/") for path in sizes), "the runtime counted through its link"


def test_no_module_is_over_the_line_budget():
    over = sorted((n, path) for path, n in _modules().items() if n > LIMIT)
    assert not over, f"modules over {LIMIT} lines (split them by what they do): {over}"
