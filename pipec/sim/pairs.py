"""A value for every ordered pair of ranks, held by what decides it: the two ranks' datacenters and whether
they share a node.

Every link rule of the cost model (a class default, `default link`, `link "A" <-> "B"`, a cost file's
`latency.node`) is a function of those three facts, so the cost model's latency, bandwidth, link class
and shared cross-datacenter link are each a (D, D, 2) table over D datacenters instead of a (ranks, ranks)
matrix: a check of 10,000 ranks held five matrices of 100 million entries (2.5 GB, and the check time per
op grew with p; issue 32). Indexing `table[src, dst]` with rank numbers or arrays of them reads it as the
matrix would be; `numpy.asarray(table)` builds the matrix for the few consumers that want one whole (a
synthesized file's topology lines, at the sizes synth searches).
"""

from __future__ import annotations

import numpy as np


class PairTable:
    """Per rank pair (a, b), `table[dc[a], dc[b], same node]`; `diagonal` where a == b.

    dc: each rank's datacenter as a dense index 0..D-1; node: each rank's node (ranks of one node share
    it; every rank its own node when the machine has no node size).
    """

    __slots__ = ("dc", "node", "table", "diagonal", "_present")

    def __init__(self, dc: np.ndarray, node: np.ndarray, table: np.ndarray, diagonal: float) -> None:
        self.dc, self.node, self.table, self.diagonal = dc, node, table, diagonal
        self._present: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.dc), len(self.dc))

    def __getitem__(self, key: tuple) -> np.ndarray:
        a, b = key
        a, b = np.asarray(a), np.asarray(b)
        v = self.table[self.dc[a], self.dc[b], (self.node[a] == self.node[b]).astype(np.int64)]
        return np.where(a == b, self.diagonal, v)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        r = np.arange(len(self.dc))
        out = self[r[:, None], r[None, :]]
        return out if dtype is None else out.astype(dtype)

    def with_table(self, table: np.ndarray) -> PairTable:
        """The same ranks with other values (a table of the same shape)."""
        return PairTable(self.dc, self.node, table, self.diagonal)

    def pairs(self) -> np.ndarray:
        """Ordered rank pairs (a != b) of each (dc, dc, same node) entry: 0 where no pair reads it."""
        if self._present is None:
            D = self.table.shape[0]
            per_dc = np.bincount(self.dc, minlength=D).astype(np.int64)
            out = np.zeros((D, D, 2), dtype=np.int64)
            out[:, :, 0] = per_dc[:, None] * per_dc[None, :]
            keys, counts = np.unique(np.stack([self.dc, self.node], axis=1), axis=0, return_counts=True)
            same = np.bincount(keys[:, 0], weights=counts * (counts - 1), minlength=D).astype(np.int64)
            idx = np.arange(D)
            out[idx, idx, 0] -= per_dc + same  # a rank with itself, and pairs on one node
            out[idx, idx, 1] = same
            self._present = out
        return self._present

    def values(self, where: np.ndarray | None = None) -> np.ndarray:
        """The values some pair of ranks reads (of the entries `where` selects), each entry once."""
        sel = self.pairs() > 0
        return self.table[sel if where is None else sel & where]

    def any(self) -> bool:
        """Whether some pair of ranks has a nonzero value (the diagonal aside)."""
        return bool(self.values().any())
