"""The declarations that shape a schedule beyond its sizes: its stage graph (`edge s -> e`) and its token
slices and sequence lengths (`slices`, `seqlen`, `tokens j -> e`, `length i -> e`), evaluated from what the
generated code declared (`pipec.frontend.evaluate` collects them) into the ir's values. Their errors are
`Fail`s, which the evaluator turns into diagnostics at the declaration's span.
"""

from __future__ import annotations

from pipec.errors import brief
from pipec.ir.graph import MAX_EDGES, StageGraph, check_graph
from pipec.ir.schedule import Slicing

MAX_SIZE = 10_000_000  # stages, ranks, micro-batches


class Fail(Exception):
    """A runtime error of the generated code or a declaration: a diagnostic's code, message, statement id
    (its span, None for the schedule's header) and notes."""

    def __init__(self, code: str, message: str, sid: int | None, notes: tuple[str, ...] = ()) -> None:
        self.code, self.message, self.sid, self.notes = code, message, sid, notes


def graph_of(decls: list[tuple[object, int]], num_stages: int) -> StageGraph | None:
    """The stage graph of the `edge s -> e` declarations (None without any: the chain). Each declaration is
    a map over the stages; a value below 0 means stage s has no edge by it. E216 names the declaration
    whose edge breaks a rule of `pipec.ir.graph.check_graph`."""
    if not decls:
        return None
    if len(decls) * num_stages > MAX_EDGES:
        raise Fail("E210", f"the schedule would have more than {MAX_EDGES:,} edges", decls[0][1])
    edges: list[tuple[int, int]] = []
    for fn, sid in decls:
        mine = [(s, int(t)) for s in range(num_stages) if (t := fn(s)) >= 0]
        why = check_graph(num_stages, edges + mine)
        if why is not None and why.startswith("edge"):  # an edge of this declaration: say it here
            raise Fail("E216", why, sid, (f"stages = {num_stages}",))
        edges += mine
    why = check_graph(num_stages, edges)
    if why is not None:
        raise Fail("E216", why, decls[-1][1], (f"stages = {num_stages}",))
    graph = StageGraph.of(num_stages, edges)
    return None if graph.is_chain else graph


def slicing_of(decls: dict[str, tuple[object, int]], m: int) -> Slicing | None:
    """The schedule's `slices`, `seqlen`, `tokens j -> ...` and `length i -> ...` as a Slicing (None when it
    declares none of them). Slices cover the sequence: each has at least one token and, with `seqlen`
    given, they sum to it (E214); without `tokens`, `seqlen` is cut as evenly as it goes (1 token each when
    no `seqlen` either: the units then weigh the same). Micro-batch lengths are at least one token; with
    slices every micro-batch has the sequence's length (E215)."""
    d = decls
    if not any(k in d for k in ("slices", "seqlen", "tokens", "length")):
        return None

    def count(kind: str) -> int | None:
        if kind not in d:
            return None
        v, sid = d[kind]
        if not 1 <= v <= MAX_SIZE:
            raise Fail("E210", f"`{kind}` must be between 1 and {MAX_SIZE:,}, got {brief(v)}", sid)
        return v

    n, seqlen = count("slices") or 1, count("seqlen")
    if "tokens" in d:
        fn, sid = d["tokens"]
        tokens = tuple(fn(j) for j in range(n))
        bad = [j for j, t in enumerate(tokens) if t < 1]
        if bad:
            raise Fail("E214", f"slice {bad[0]} has {tokens[bad[0]]} tokens: every slice needs at least one", sid)
        if seqlen is not None and sum(tokens) != seqlen:
            raise Fail(
                "E214",
                f"the {n} slices hold {sum(tokens):,} tokens, but the sequence has {seqlen:,} (`seqlen`): "
                "slices must cover it exactly",
                sid,
                (f"tokens: {', '.join(map(str, tokens[:12]))}{', ...' if n > 12 else ''}",),
            )
        seqlen = sum(tokens)
    elif seqlen is not None:
        if seqlen < n:
            raise Fail("E214", f"{n} slices of a sequence of {seqlen} tokens: a slice would be empty", d["seqlen"][1])
        q, r = divmod(seqlen, n)
        tokens = tuple(q + (j < r) for j in range(n))
    else:
        tokens = (1,) * n
        seqlen = n
    if "length" in d:
        fn, sid = d["length"]
        lengths = tuple(fn(i) for i in range(m))
        bad = [i for i, t in enumerate(lengths) if t < 1]
        if bad:
            raise Fail("E215", f"micro-batch {bad[0]} has length {lengths[bad[0]]}: at least one token", sid)
        if n > 1 and any(x != seqlen for x in lengths):
            raise Fail(
                "E215",
                "sliced micro-batches have the length of the sequence their slices cover: variable lengths and "
                "slices do not go together",
                sid,
            )
        if "seqlen" not in d and "tokens" not in d:
            seqlen = max(lengths)
    else:
        lengths = (seqlen,) * m
    return Slicing(m, n, seqlen, tokens, lengths)
