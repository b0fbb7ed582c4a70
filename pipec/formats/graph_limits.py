"""What cannot take a stage graph yet: the one refusal (E217) of every exporter and tool that can express
only the chain s -> s + 1 (issue 42).

A stage graph (pipec.ir.graph) is a Schedule's or Program's `graph`; without one (`None`) it is the chain and
nothing here says a word. The torch CSV writer and torchtitan (whose runtimes send a stage's output to the
next stage only), `pipec partition` and `pipec plan` (which split a chain of layers into consecutive stages,
and Megatron-LM's settings, which describe one), `pipec synth` (which searches chain schedules) and `pipec
slice` (TeraPipe's dynamic program over a chain's depth) call `refuse_graph` before they do anything, so a
graph schedule is never exported, searched or sliced as if it were a chain. On floor 4 so the formats and
every tool above them (synth, partition, slicing, the planner, the CLI) share it.
"""

from __future__ import annotations

from pipec.errors import Source, Span, error


def refuse_graph(obj, tool: str, limit: str, hint: str | None = None, source: Source | None = None) -> None:
    """E217 when `obj` (a Schedule or Program) has a stage graph: `tool` cannot take a stage graph yet,
    because of `limit` (what it can express); at the schedule's first `edge` declaration when it has a
    source (`source`: where a Program was read from). `hint` says what to do instead (a note)."""
    graph = getattr(obj, "graph", None)
    if graph is None:
        return
    source = getattr(obj, "source", None) or source
    notes = [f"the stage graph of {graph.num_stages} stages: {graph.describe()}"]
    if hint:
        notes.append(hint)
    raise error("E217", f"{tool} cannot take a stage graph yet: {limit}", edge_span(obj, source), source, tuple(notes))


def edge_span(obj, source: Source | None = None) -> Span | None:
    """The schedule's first `edge s -> ...` declaration: its span when the evaluator kept one
    (`decl_spans["edge"]`), else the first line of its source (or `source`) that begins with `edge` (None
    for a Program read from a file, which has no schedule source)."""
    spans = getattr(obj, "decl_spans", None) or {}
    if "edge" in spans:
        return spans["edge"]
    source = getattr(obj, "source", None) or source
    text = getattr(source, "text", "") or ""
    for n, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        if stripped.startswith("edge ") or stripped.startswith("edge\t"):
            col = len(line) - len(line.lstrip()) + 1
            return Span(n, col, n, len(line.rstrip()) + 1)
    return None
