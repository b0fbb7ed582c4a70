"""The LALR parser of `grammar/pipe.lark`, with its tables shipped in the package.

Why a module: building lark's LALR tables takes 0.27 s of CPU, more than a whole compile of a
large schedule, and a user's first compile of a new file (an empty per-user cache) paid it every time.
So the tables are built once, by the maintainers, and shipped beside the grammar as `pipe.tables`:
lark's own serialized form (`Lark.save`: dicts, lists, strings and numbers, the format lark's standalone
parsers embed), loaded in about 20 ms. The file starts with a digest of the grammar text and the options,
so tables of another grammar are never used; a grammar edited without rebuilding them, or a lark that
cannot read them, falls back to the per-user cache (`pipec.cachedir`) and then to building in-process.

    python -m pipec.frontend.tables        # rebuild grammar/pipe.tables after editing the grammar
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import io
import sys
import types
from pathlib import Path

from pipec import cachedir
from pipec.frontend.library import package_files


class _Deferred(types.ModuleType):
    """`regex` as lark holds it: the real package, imported on first use (its every attribute is the
    real module's)."""

    def __getattr__(self, name: str) -> object:
        return getattr(importlib.import_module("regex"), name)


def _import_lark() -> types.ModuleType:
    """lark, without importing `regex` with it. lark imports the `regex` package whenever it is installed
    (transformers brings it), for `Lark(regex=True)` and Unicode categories in terminals, which pipe.lark
    uses neither of; that import is 10 to 15 ms of CPU, about a tenth of a cold compile. So lark gets a
    stand-in that imports the real package on its first use, and sys.modules forgets the stand-in at once:
    any other `import regex` in the process gets the real module, as before."""
    if "lark" in sys.modules or "regex" in sys.modules or importlib.util.find_spec("regex") is None:
        return importlib.import_module("lark")
    stand_in = sys.modules["regex"] = _Deferred("regex")
    try:
        return importlib.import_module("lark")
    finally:
        if sys.modules.get("regex") is stand_in:
            del sys.modules["regex"]


lark = _import_lark()

OPTIONS = {"parser": "lalr", "propagate_positions": True, "maybe_placeholders": True}
MAGIC = b"pipec-lark-tables 1 "  # then the digest (64 hex digits), a newline, and lark's pickle


def grammar_text() -> str:
    return package_files("pipec.grammar").joinpath("pipe.lark").read_text()


def digest(grammar: str) -> str:
    """What the tables depend on that pipec controls: the grammar text and the options."""
    return hashlib.sha256("\0".join((grammar, repr(sorted(OPTIONS.items())))).encode()).hexdigest()


def _shipped(grammar: str) -> lark.Lark | None:
    try:
        data = package_files("pipec.grammar").joinpath("pipe.tables").read_bytes()
    except OSError:
        return None
    head = MAGIC + digest(grammar).encode() + b"\n"
    if not data.startswith(head):
        return None
    try:
        return lark.Lark.load(io.BytesIO(data[len(head) :]))
    except Exception:  # a lark whose serialized form differs: the cache, then a build
        return None


def _cached_or_built(grammar: str) -> lark.Lark:
    # The cache entry's name also holds lark's and Python's versions: it is this machine's own build.
    name = f"pipe-lark-{digest(grammar + lark.__version__ + sys.version)[:32]}.pickle"
    data = cachedir.load(name)
    if data is not None:
        try:
            return lark.Lark.load(io.BytesIO(data))
        except Exception:  # unreadable or damaged: build the tables and write a new entry
            pass
    parser = lark.Lark(grammar, **OPTIONS)
    out = io.BytesIO()
    parser.save(out)
    cachedir.store(name, out.getvalue())
    return parser


@functools.cache
def parser() -> lark.Lark:
    """The parser: from the shipped tables, else the per-user cache, else built (the module docstring)."""
    grammar = grammar_text()
    return _shipped(grammar) or _cached_or_built(grammar)


def source() -> str:
    """Where `parser()` takes its tables from in this installation: "shipped" or "cache or build"."""
    return "shipped" if _shipped(grammar_text()) is not None else "cache or build"


def build_tables(grammar: str) -> bytes:
    """The file `pipe.tables` for a grammar text: the header, then lark's serialized parser."""
    out = io.BytesIO()
    lark.Lark(grammar, **OPTIONS).save(out)
    return MAGIC + digest(grammar).encode() + b"\n" + out.getvalue()


def main() -> None:
    """Rebuild grammar/pipe.tables from grammar/pipe.lark (the source tree's, where this module lives)."""
    folder = Path(__file__).resolve().parents[2] / "grammar"
    path = folder / "pipe.tables"
    path.write_bytes(build_tables((folder / "pipe.lark").read_text()))
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
