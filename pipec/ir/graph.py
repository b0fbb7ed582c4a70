"""The stage graph: which stage feeds which, as a value, and the message key every pass shares.

Every pipeline system assumes stage s feeds s + 1. A stage graph lifts that: a skip connection (U-Net's
encoder level s feeding decoder level S - 1 - s), encoders fanning into a decoder, a stage whose output
several stages read. The chain is the graph whose edges are (s, s + 1); a Schedule or Program without a
graph (`graph is None`) is that chain, so every schedule file and Program file written before keeps its
meaning, bit for bit.

What a graph must be (E216 at the `edge` declaration, `check_graph`): every edge goes from a lower stage to
a higher one (the stage numbers are a topological order, so "F in stage order" is always a valid forward);
no edge twice; the last stage, where the loss is, is the only stage without outputs (every other stage's
output reaches the loss). Stages without inputs (sources) read the micro-batch; the chain's stage 0 is one.

The message key. A message is (what travels, micro-batch, edge): the activation of micro-batch i travels
edge (u, v) forward, from u to v; its gradient travels the same edge back, from v to u. Edges are numbered
in sorted order (`edge_id`); on the chain edge (s, s + 1) is number s. `pipec.ir.rules` states what F, B
and W need on a graph; lowering, the dry run (each channel's order), the simulator's links and the executor
all name a message by this key.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

# The longest list of edges one schedule may declare (each is an `edge` map's value for one stage, so a
# schedule of S stages with k `edge` declarations has at most k * S).
MAX_EDGES = 10_000_000


@dataclass(frozen=True)
class StageGraph:
    """Stages 0 .. num_stages - 1 and the edges between them, sorted; the loss is on the last stage.

    Built by `StageGraph.of` (which sorts and checks nothing) or the front end's `edge` declarations
    (which `check_graph` first). The arrays below are CSR views made once: a pass that asks "the inputs of
    every op" indexes them instead of looping over stages.
    """

    num_stages: int
    edges: tuple[tuple[int, int], ...]

    @staticmethod
    def of(num_stages: int, edges) -> StageGraph:
        return StageGraph(int(num_stages), tuple(sorted({(int(u), int(v)) for u, v in edges})))

    @staticmethod
    def chain(num_stages: int) -> StageGraph:
        return StageGraph(num_stages, tuple((s, s + 1) for s in range(num_stages - 1)))

    @property
    def is_chain(self) -> bool:
        return self.edges == tuple((s, s + 1) for s in range(self.num_stages - 1))

    @property
    def num_edges(self) -> int:
        return len(self.edges)

    @functools.cached_property
    def _arrays(self) -> dict[str, np.ndarray]:
        S, E = self.num_stages, len(self.edges)
        src = np.fromiter((u for u, _ in self.edges), dtype=np.int64, count=E)
        dst = np.fromiter((v for _, v in self.edges), dtype=np.int64, count=E)
        by_dst = np.lexsort((src, dst))  # edges into each stage, by source
        out = {
            "src": src,
            "dst": dst,
            "out_ptr": np.concatenate(([0], np.cumsum(np.bincount(src, minlength=S)))).astype(np.int64),
            "in_ptr": np.concatenate(([0], np.cumsum(np.bincount(dst, minlength=S)))).astype(np.int64),
            "in_edge": by_dst.astype(np.int64),  # edges sorted by (dst, src): in_ptr indexes them
        }
        for a in out.values():
            a.setflags(write=False)
        return out

    @property
    def src(self) -> np.ndarray:
        """Per edge id, its source stage."""
        return self._arrays["src"]

    @property
    def dst(self) -> np.ndarray:
        """Per edge id, its destination stage."""
        return self._arrays["dst"]

    def in_edges(self, stage: int) -> np.ndarray:
        """The ids of the edges into `stage`, by source stage."""
        a = self._arrays
        return a["in_edge"][a["in_ptr"][stage] : a["in_ptr"][stage + 1]]

    def out_edges(self, stage: int) -> np.ndarray:
        """The ids of the edges out of `stage`, by destination stage (edges are sorted by source)."""
        a = self._arrays
        return np.arange(a["out_ptr"][stage], a["out_ptr"][stage + 1])

    def inputs(self, stage: int) -> tuple[int, ...]:
        """The stages whose outputs `stage` reads, in order (a stage's forward takes them in this order)."""
        return tuple(self.src[self.in_edges(stage)].tolist())

    def outputs(self, stage: int) -> tuple[int, ...]:
        """The stages that read `stage`'s output, in order (a stage's forward returns one output per entry,
        or one tensor all of them read)."""
        return tuple(self.dst[self.out_edges(stage)].tolist())

    @property
    def max_in(self) -> int:
        return int(np.diff(self._arrays["in_ptr"]).max(initial=0))

    @property
    def max_out(self) -> int:
        return int(np.diff(self._arrays["out_ptr"]).max(initial=0))

    def in_slot(self, stage: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
        """For each stage in `stage` (an array), its j-th input edge: (edge id, valid), vectorised."""
        a = self._arrays
        lo, hi = a["in_ptr"][stage], a["in_ptr"][stage + 1]
        valid = lo + j < hi
        return np.where(valid, a["in_edge"][np.minimum(lo + j, max(len(self.edges) - 1, 0))], -1), valid

    def out_slot(self, stage: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
        """For each stage in `stage` (an array), its j-th output edge: (edge id, valid), vectorised."""
        a = self._arrays
        lo, hi = a["out_ptr"][stage], a["out_ptr"][stage + 1]
        valid = lo + j < hi
        return np.where(valid, lo + j, -1), valid

    def edge_id(self, src: int, dst: int) -> int:
        """The number of edge (src, dst) in sorted order; KeyError when there is no such edge."""
        return self._index[(src, dst)]

    @functools.cached_property
    def _index(self) -> dict[tuple[int, int], int]:
        return {e: k for k, e in enumerate(self.edges)}

    @functools.cached_property
    def _below(self) -> tuple[int, ...]:
        """Per stage, the stages it reaches (itself excluded) as a bitset, built from the last stage down."""
        below = [0] * self.num_stages
        for s in range(self.num_stages - 1, -1, -1):
            for v in self.outputs(s):
                below[s] |= below[v] | (1 << v)
        return tuple(below)

    def reaches(self, a: int, b: int) -> bool:
        """Whether a path of edges leads from stage a to stage b (a != b): b's forward needs a's."""
        return bool(self._below[a] >> b & 1)

    def describe(self, limit: int = 8) -> str:
        """The edges as `0->1, 0->3, ...` (the first `limit`), for diagnostics and reports."""
        shown = ", ".join(f"{u}->{v}" for u, v in self.edges[:limit])
        return shown + (f", ... ({len(self.edges)} edges)" if len(self.edges) > limit else "")

    def to_json(self) -> list[list[int]]:
        return [[u, v] for u, v in self.edges]


def across(
    graph: StageGraph | None, stage: np.ndarray, offset: np.ndarray, S: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The stages across an edge from each op's stage, in the direction `offset` gives per op (-1: the stages
    it reads, +1: the stages that read it, 0: none), vectorised: a list of (other stage, valid) slots. On the
    chain one slot, s + offset; on a graph as many as the most edges one stage has that way, by edge order."""
    if graph is None:
        other = stage + offset
        return [(other, (offset != 0) & (other >= 0) & (other < S))]
    out = []
    for j in range(max(graph.max_in, graph.max_out)):
        e_in, v_in = graph.in_slot(stage, j)
        e_out, v_out = graph.out_slot(stage, j)
        if not graph.num_edges:
            break
        other = np.where(offset < 0, graph.src[np.maximum(e_in, 0)], graph.dst[np.maximum(e_out, 0)])
        valid = np.where(offset < 0, v_in, np.where(offset > 0, v_out, False))
        if valid.any():
            out.append((np.where(valid, other, -1), valid))
    return out


def graph_of(obj) -> StageGraph:
    """The stage graph of a Schedule or Program: its own, or the chain when it has none."""
    g = getattr(obj, "graph", None)
    return g if g is not None else StageGraph.chain(obj.num_stages)


def check_graph(num_stages: int, edges: list[tuple[int, int]]) -> str | None:
    """Why these edges are not a stage graph (the message of E216), or None when they are one."""
    seen: set[tuple[int, int]] = set()
    for u, v in edges:
        if not (0 <= u < num_stages and 0 <= v < num_stages):
            return f"edge {u} -> {v} names a stage outside 0..{num_stages - 1}"
        if v <= u:
            return (
                f"edge {u} -> {v} goes back: an edge goes from a stage to a later one "
                "(the stage numbers are a topological order)"
            )
        if (u, v) in seen:
            return f"edge {u} -> {v} is declared twice"
        seen.add((u, v))
    has_out = {u for u, _ in seen}
    sinks = [s for s in range(num_stages - 1) if s not in has_out]
    if sinks:
        return (
            f"stage {sinks[0]} has no outputs: every stage but the last ({num_stages - 1}, where the loss is) "
            "must feed another"
        )
    return None


def message_edge(graph: StageGraph | None, sending: np.ndarray, other: np.ndarray) -> np.ndarray:
    """The edge id of messages by their sending stage and the stage at the other end (vectorised): an
    activation from u to v is edge (u, v), a gradient from v back to u is edge (u, v) too."""
    lo, hi = np.minimum(sending, other), np.maximum(sending, other)
    if graph is None:
        return lo  # the chain: edge (s, s + 1) is number s
    S = graph.num_stages
    keys, want = graph.src * S + graph.dst, lo * S + hi  # sorted: edges are sorted by (src, dst)
    pos = np.minimum(np.searchsorted(keys, want), max(len(keys) - 1, 0))
    return np.where(keys[pos] == want, pos, -1) if len(keys) else np.full_like(want, -1)
