"""The parser's tables ship with the package (pipec.frontend.tables): current with the grammar, used by a
process with an empty cache, and parsing as tables built from the grammar do."""

from __future__ import annotations

import os
import subprocess
import sys

import lark
from repo import ROOT

from pipec.frontend import tables
from pipec.frontend.library import names, read


def test_the_shipped_tables_are_the_grammars():
    """Edit grammar/pipe.lark without rebuilding its tables and this fails: `python -m pipec.frontend.tables`."""
    grammar = (ROOT / "grammar" / "pipe.lark").read_text()
    head = (ROOT / "grammar" / "pipe.tables").read_bytes()[: len(tables.MAGIC) + 65]
    assert head == tables.MAGIC + tables.digest(grammar).encode() + b"\n", "run: python -m pipec.frontend.tables"
    assert tables.source() == "shipped"


def test_a_process_with_an_empty_cache_builds_no_tables(tmp_path):
    probe = (
        "import lark, pipec\n"
        "built = []\n"
        "real = lark.Lark.__init__\n"
        "lark.Lark.__init__ = lambda self, *a, **k: (built.append(1), real(self, *a, **k))[1]\n"
        "pipec.compile('zb-v', p=2, m=4)\n"
        "print(len(built))\n"
    )
    env = dict(os.environ, PIPEC_CACHE_DIR=str(tmp_path / "empty"))
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"  # loaded, not built
    assert not any(p.name.startswith("pipe-lark") for p in (tmp_path / "empty").glob("*"))


def test_the_shipped_parser_parses_as_a_freshly_built_one():
    shipped, built = tables.parser(), lark.Lark(tables.grammar_text(), **tables.OPTIONS)
    for name in names():
        text = read(name).text
        assert shipped.parse(text) == built.parse(text), name


def test_tables_of_another_grammar_are_not_used(tmp_path, monkeypatch):
    """A grammar that differs from the one the tables were built from (an edit not rebuilt) is built from
    its text, so it parses as it says."""
    monkeypatch.setenv("PIPEC_CACHE_DIR", str(tmp_path))
    edited = tables.grammar_text() + "\n// an edit\n"
    assert tables._shipped(edited) is None
    assert tables._shipped(tables.grammar_text()) is not None
    assert isinstance(tables._cached_or_built(edited), lark.Lark)
