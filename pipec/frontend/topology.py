"""A topology given apart from the schedule: `--topology FILE|TEXT`, so one schedule runs on several networks.

The text is the language's own `topology { ... }` declaration (docs/language.md,
section 10), found in one of three places:

- a file holding just a `topology { ... }` block (comments allowed);
- a `.pipe` schedule file: its top-level `topology` declaration is taken;
- the text itself (when no such file exists): a `topology { ... }` block, or
  only its items, e.g. `dc "east" ranks 0 .. 4  dc "west" ranks 4 .. 8
  link "east" <-> "west" latency 40ms bandwidth 10Gbps`.

Rank bounds are expressions evaluated with the schedule's parameters, so
`dc "east" ranks 0 .. p // 2` follows `-D p=...`. The rules are the
language's (E107 for a quantity without its unit, E112 for datacenters that
overlap, lie outside the ranks or leave a rank out). The result replaces the
schedule's own topology; nothing else of the schedule changes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from pipec.errors import Diagnostic, PipecError, Source, Span, error
from pipec.frontend import ast
from pipec.ir.schedule import Schedule, Topology

_COMMENT = re.compile(r"#[^\n]*")


def read_topology(spec: str, sched: Schedule) -> Topology:
    """The topology `spec` names (a file or the text itself), evaluated for this schedule's parameters."""
    path = Path(spec)
    if path.is_file():
        from pipec.files import read_text  # bounded: a topology file is no larger than 64 MiB (E901)

        try:
            text = read_text(path, "topology file")
        except (OSError, UnicodeDecodeError) as e:
            raise error("E000", f"cannot read topology file `{spec}`: {e}") from None
        source = Source(str(path), text)
    elif _looks_like_a_path(spec):
        raise error("E000", f"no topology file `{spec}` (give a file, or the topology itself in quotes)")
    else:
        source = Source("--topology", spec)
    return _evaluate(source, sched)


def with_topology(sched: Schedule, topology: Topology | None) -> Schedule:
    """The same schedule on another network."""
    return dataclasses.replace(sched, topology=topology)


def _looks_like_a_path(spec: str) -> bool:
    return "{" not in spec and '"' not in spec and (spec.endswith((".pipe", ".topo", ".txt")) or "/" in spec)


def _evaluate(source: Source, sched: Schedule) -> Topology:
    from pipec.frontend.load import evaluate_source

    lines, offset = _topology_lines(source)
    # A stand-in schedule with the same parameters and ranks whose only content is this topology: evaluating it
    # checks the block exactly as a schedule's own. The user's line u is the stand-in's line u + offset, so
    # diagnostics move back onto the user's text.
    params = ", ".join(f"{k}: {_type(v)} = {_literal(v)}" for k, v in sched.params)
    header = f'schedule "topology" ({params}) {{ stages {sched.num_ranks}  place s -> s'
    stand_in = "\n".join([header, *lines, "rank r { } }"]) + "\n"
    try:
        built = evaluate_source(Source(source.path, stand_in))
    except PipecError as e:
        raise PipecError(*(_shift(d, source, offset) for d in e.diagnostics)) from None
    return built.topology or Topology((), ())


def _topology_lines(source: Source) -> tuple[list[str], int]:
    """The stand-in's lines after its header, and how many lines the user's text moved down."""
    from pipec.frontend.parse import parse

    text = source.text
    bare = _COMMENT.sub("", text).strip()
    if bare.startswith("schedule"):  # a schedule file: its topology declaration, at its own line numbers
        found = [st for st in parse(source).body if isinstance(st, ast.Topology)]
        if not found:
            raise error("E000", f"`{source.path}` declares no topology")
        span = found[0].span
        lines = text.splitlines()
        chunk = lines[span.line - 1 : span.end_line]
        chunk[-1] = chunk[-1][: span.end_col - 1] if span.end_line > span.line else chunk[-1][: span.end_col - 1]
        chunk[0] = " " * (span.col - 1) + chunk[0][span.col - 1 :]
        return [""] * (span.line - 1) + chunk, 1
    if bare.startswith("topology"):  # a topology block
        return text.splitlines(), 1
    return ["topology {", *text.splitlines(), "}"], 2  # only the items


def _shift(d: Diagnostic, source: Source, offset: int) -> Diagnostic:
    """A diagnostic about the stand-in schedule, moved onto the user's text (or left without a span)."""
    span = d.span
    if span is not None:
        line = span.line - offset
        if 1 <= line <= len(source.text.splitlines()):
            span = Span(line, span.col, max(span.end_line - offset, line), span.end_col)
        else:
            span = None
    return dataclasses.replace(d, span=span, source=source)


def _type(v) -> str:
    return (
        "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "float" if isinstance(v, float) else "str"
    )


def _literal(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v + '"'
    return repr(v)
