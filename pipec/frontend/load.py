"""The front end's loader: a `.pipe` text to its generated code (cached) and, with parameter values, to a Schedule.

What comes out is the text evaluated as it stands: not checked, and an `order` block left as its
`Policy` value (`Schedule.order`), for the passes above to resolve. `pipec.driver.build` is the one
caller that finishes the job (the torch CSV front end, the policy, the checks); the topology reader
(`pipec.frontend.topology`) evaluates its stand-in schedule here, below the driver.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Mapping

from pipec import cachedir
from pipec.errors import Source
from pipec.frontend.codegen import GeneratedCode, compile_ast
from pipec.frontend.evaluate import evaluate
from pipec.frontend.library import package_files
from pipec.ir.schedule import Schedule


@functools.lru_cache(maxsize=128)
def compile_source(source: Source) -> GeneratedCode:
    """Parse and generate code once per distinct text: in this process (lru_cache), and across processes
    through the per-user cache (`pipec.cachedir`), since every rank of a job, and every fresh `pipec`
    command, compiles the same few schedule texts again. The entry's name digests the text and the
    front end's own files, so an edit to either is never served stale."""
    import hashlib
    import pickle

    name = "code-" + hashlib.sha256((_front_end_digest() + "\0" + source.text).encode()).hexdigest()[:32] + ".pickle"
    data = cachedir.load(name)
    if data is not None:
        try:
            code = pickle.loads(data)
            if isinstance(code, GeneratedCode):
                return code
        except Exception:  # a damaged entry: compute it again
            pass
    from pipec.frontend.parse import parse  # lark loads only when a text is parsed

    code = compile_ast(parse(source), source)
    cachedir.store(name, pickle.dumps(code))
    return code


@functools.cache
def _front_end_digest() -> str:
    """What the generated code depends on besides the text: the grammar, the front end's modules and the
    unit table they scale quantities by (`pipec.ir.units`), the versions of pipec and Python."""
    import hashlib
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    h = hashlib.sha256(f"{sys.version}\0{_version()}".encode())
    for path in [*sorted(here.glob("*.py")), here.parent / "ir" / "units.py"]:
        with contextlib.suppress(OSError):
            h.update(path.read_bytes())
    h.update(package_files("pipec.grammar").joinpath("pipe.lark").read_bytes())
    return h.hexdigest()


def _version() -> str:
    from pipec import __version__

    return __version__


def evaluate_source(
    source: Source,
    params: Mapping[str, object] | Iterable[tuple[str, object]] = (),
    ranks: Iterable[int] | None = None,
) -> Schedule:
    """A `.pipe` text evaluated with these parameters (strings from `-D`, or typed values): unchecked, its
    `order` block (if any) still a `Policy` on `Schedule.order` (`pipec.passes.policy.resolve` derives it)."""
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    return evaluate(compile_source(source), source, items, ranks)
