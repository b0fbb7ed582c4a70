"""Stage graphs for tests (issue 42): `edge` declarations written from a list of edges, and hypothesis
strategies for random graphs (every edge u -> v with u < v, every stage but the last with an output)."""

from __future__ import annotations

from hypothesis import strategies as st


def edge_decls(S: int, edges: list[tuple[int, int]], indent: str = "    ") -> str:
    """`edge` declarations for these edges, one line each: the j-th declaration gives each stage its j-th
    output (a nested `if` over the stages), so any graph is written in the language."""
    slots = max((sum(1 for u, _ in edges if u == s) for s in range(S)), default=0)
    out = []
    for j in range(slots):
        expr = "-1"
        for u in range(S - 1, -1, -1):
            outs = [v for a, v in edges if a == u]
            if j < len(outs):
                expr = f"(if s == {u} then {outs[j]} else {expr})"
        out.append(f"{indent}edge s -> {expr}\n")
    return "".join(out)


@st.composite
def graphs(draw, S: int, most: int = 3) -> list[tuple[int, int]]:
    """A random stage graph on S stages with at most `most` outputs and (where it can) inputs a stage."""
    edges: set[tuple[int, int]] = set()
    fan_in = [0] * S
    for u in range(S - 1):
        options = [v for v in range(u + 1, S) if fan_in[v] < most] or [u + 1]
        for v in draw(st.lists(st.sampled_from(options), min_size=1, max_size=most, unique=True)):
            edges.add((u, v))
            fan_in[v] += 1
    return sorted(edges)
