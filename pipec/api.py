"""The front end in one call: text to a checked Schedule, with parse and codegen cached per text."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

from pipec.passes.checks import check_schedule
from pipec.frontend.codegen import GeneratedCode, compile_ast
from pipec.errors import Source
from pipec.frontend.evaluate import evaluate
from pipec.schedule import Schedule
from pipec.frontend.library import read
from pipec.frontend.parse import parse
from pipec.interop.torch_csv import is_torch_csv, read_csv


@functools.lru_cache(maxsize=128)
def compile_source(source: Source) -> GeneratedCode:
    """Parse and generate code once per distinct text."""
    return compile_ast(parse(source), source)


def param_names(source: Source) -> tuple[str, ...]:
    """The parameters a schedule declares (a torch CSV: `p` and `m`)."""
    if is_torch_csv(source):
        return ("p", "m")
    return tuple(p.name for p in compile_source(source).params)


def build(
    source: Source,
    params: Mapping[str, object] | Iterable[tuple[str, object]] = (),
    *,
    check: bool = True,
    ranks: Iterable[int] | None = None,
) -> Schedule:
    """Parse, evaluate with these parameters and (unless told not to) check a schedule.

    A source read from a `.csv` file is a torch.distributed.pipelining schedule CSV (docs/interop.md):
    it is read as it stands, and takes only `p` and `m`, equal to the sizes it fixes.
    """
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    if is_torch_csv(source):  # torch.distributed.pipelining's schedule CSV: its own front end
        return read_csv(source, items, check=check and ranks is None)
    sched = evaluate(compile_source(source), source, items, ranks)
    if check and ranks is None:
        check_schedule(sched)
    return sched


def load(name_or_path: str, params: Mapping[str, object] | None = None, **kwargs: object) -> Schedule:
    """A library schedule by name, or a file by path, evaluated and checked.

    >>> load("1f1b", p=4, m=8).num_ops
    64
    """
    merged = dict(params or {}, **kwargs)
    return build(read(name_or_path), merged)
