"""What each compute op of the simulator waits for: its remote inputs, as message ids, on the chain or a stage graph.

A compute op's inputs are the instruction table's `needs` (FWD: the activation from the stages it reads;
BWD: the gradient from the stages that read it), taken across the edges of the Program's stage graph by
`pipec.ir.graph.across` (the chain: the one neighbour, s - 1 or s + 1; a graph: every edge in that
direction, by edge order). An input from a stage on the op's own rank is handed over locally, earlier on the
same stream (the schedule's order put that op first), so the op waits only for inputs from other ranks. Each
is named by `pipec.ir.opcodes.message_key` of the receive that carries it, the key its send has, so the
simulator finds the message by key: one message on the chain, one per remote edge on a graph, all of which
must have arrived before the op starts (`pipec.sim.machine`: `Plan.need` is the first, `Plan.more` the rest).
"""

from __future__ import annotations

import numpy as np

from pipec.errors import error
from pipec.ir.graph import StageGraph, across
from pipec.ir.opcodes import KIND_OF, MESSAGE_NOUNS, NEEDS_MSG, NEEDS_STAGE, RECV_OF_KIND, message_key


def wanted(
    op: np.ndarray,
    mb: np.ndarray,
    stage: np.ndarray,
    rank: np.ndarray,
    placement: np.ndarray,
    S: int,
    m: int,
    graph: StageGraph | None,
) -> list[np.ndarray]:
    """Per slot of `across` (one on the chain, as many as the most inputs of one op on a graph), per compute op
    (opcodes `op`), the key of the message it waits for in that slot, -1 for none (no input there, or one
    from a stage on its own rank)."""
    msg = NEEDS_MSG[op]
    # The receive that carries the input: its key is the message's (a compute op itself has none).
    recv = np.where(msg >= 0, RECV_OF_KIND[np.maximum(KIND_OF[op], 0)], op)
    out = []
    for other, valid in across(graph, stage, NEEDS_STAGE[op], S):
        remote = valid & (msg >= 0) & (placement[np.clip(other, 0, S - 1)] != rank)
        key = message_key(recv, mb, stage, S, m, other, graph) if remote.any() else np.full(len(op), -1)
        out.append(np.where(remote, key, -1))
    return out or [np.full(len(op), -1, dtype=np.int64)]


def resolve(
    wants: list[np.ndarray], keys: np.ndarray, order: np.ndarray, S: int, m: int, graph: StageGraph | None
) -> tuple[np.ndarray, list[tuple[int, ...]] | None]:
    """The wanted keys as message ids (`keys`: the sends' keys sorted, `order`: their message ids): per op the
    first (-1: none) and, when some op waits for several, per op the rest (else None). E403 naming a message
    a compute op needs that no send sends."""
    M = len(keys)
    ids = []
    for want in wants:
        got = np.full(len(want), -1, dtype=np.int64)
        remote = np.flatnonzero(want >= 0)
        if len(remote):
            at = np.clip(np.searchsorted(keys, want[remote]), 0, max(M - 1, 0))
            found = (keys[at] == want[remote]) if M else np.zeros(len(remote), dtype=bool)
            if not found.all():
                k = int(want[remote][~found][0])
                raise error("E403", f"the program never sends {describe_key(k, S, m, graph)}, which a compute op needs")
            got[remote] = order[at]
        ids.append(got)
    if len(ids) == 1:
        return ids[0], None
    both = np.stack(ids)
    first = np.argsort(both < 0, axis=0, kind="stable")  # each op's inputs first, in slot (edge) order
    both = np.take_along_axis(both, first, axis=0)
    need, rest = both[0], both[1:]
    several = np.flatnonzero((rest >= 0).any(axis=0))
    if not len(several):
        return need, None
    more: list[tuple[int, ...]] = [()] * len(need)
    for j in several.tolist():
        more[j] = tuple(x for x in rest[:, j].tolist() if x >= 0)
    return need, more


def describe_key(k: int, S: int, m: int, graph: StageGraph | None = None) -> str:
    """A message key (`message_key`) in words: what travels, its micro-batch, its sending stage or edge."""
    rest, i = divmod(k, m)
    if graph is None:
        kind, s = divmod(rest, S)
        return f"the {MESSAGE_NOUNS[kind]} of micro-batch {i} from stage {s}"
    kind, e = divmod(rest, max(graph.num_edges, 1))
    u, v = graph.edges[e] if e < graph.num_edges else (-1, -1)
    return f"the {MESSAGE_NOUNS[kind]} of micro-batch {i} on edge {u} -> {v}"
