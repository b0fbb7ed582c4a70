"""An order family: the orders a rank may run at run time, as a value (docs/language.md, section 20).

A rank's family is its static order cut into consecutive segments, each with a window k: op j of a
segment may start once every op of the earlier segments, and every op of its own segment at least k places
before it, has run (and its inputs are ready: the dependencies of `pipec.ir.rules`, local ones included).
k = 1 is the static order; an `any { ... }` group is a segment whose window is its length; `window k`
gives the ops outside the groups, each run of them a segment, the window k. So two ops a < b of one rank
are ordered in every member when they lie in different segments or b - a >= k ("forced"); otherwise the
runtime may run b first unless b needs a (locally). The forced relation is an interval order (op j is the
interval [j, min(j + k, segment end))), which is what `pipec.passes.family`'s proof rests on.

`OrderFamily.ranks[r]` is None for a rank that stays static. The family is a value on the Schedule and
the Program (`family`, None: every rank static); `pipec.passes.family` proves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipec.errors import Span

# How the runtime chooses among the ops a family lets it run (a hint: every choice is proven safe).
# "order": the ready op earliest in the static order; "depth": the one of the lowest micro-batch, a
# backward before a forward (depth first); "breadth": a forward first, then the lowest micro-batch.
PREFER = ("order", "depth", "breadth")


@dataclass(frozen=True)
class RankFamily:
    """One rank's family: `segments` (lo, hi, window) cover the rank's ops 0 .. n in order; `prefer` is
    one of PREFER; `span` the `window` statement or the first `any` group that made it."""

    segments: tuple[tuple[int, int, int], ...]
    prefer: str = "order"
    # where it was written, not what it is: a family read back from a Program file (no span) equals it
    span: Span | None = field(default=None, compare=False)

    @property
    def num_ops(self) -> int:
        return self.segments[-1][1] if self.segments else 0

    @property
    def is_static(self) -> bool:
        return all(k <= 1 or hi - lo <= 1 for lo, hi, k in self.segments)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per op: its segment's index, its window (capped at the segment's end: `reach[j]` is one past the
        last op j may be overtaken by) and its segment's end."""
        n = self.num_ops
        seg = np.zeros(n, dtype=np.int64)
        reach = np.zeros(n, dtype=np.int64)
        end = np.zeros(n, dtype=np.int64)
        for i, (lo, hi, k) in enumerate(self.segments):
            j = np.arange(lo, hi)
            seg[lo:hi] = i
            reach[lo:hi] = np.minimum(j + max(k, 1), hi)
            end[lo:hi] = hi
        return seg, reach, end

    def forced(self, a: int, b: int) -> bool:
        """Whether op a runs before op b (a < b) in every member, by the windows alone."""
        seg, reach, _ = self.arrays()
        return bool(seg[a] != seg[b] or b >= reach[a])

    def describe(self) -> str:
        parts = []
        for lo, hi, k in self.segments:
            if k > 1 and hi - lo > 1:
                parts.append(f"ops {lo}..{hi - 1}: any order" if k >= hi - lo else f"ops {lo}..{hi - 1}: window {k}")
        return "; ".join(parts) or "static"


@dataclass(frozen=True)
class OrderFamily:
    """Per rank, its family (None: static). `nccl`: why NCCL, which matches a channel's messages by issue
    order, cannot run this family (a channel the family may reorder, E429's message), or None when it can;
    set by the compiler (`pipec.passes.compiler`), which proves the family for transports that match by key."""

    ranks: tuple[RankFamily | None, ...]
    nccl: str | None = None

    def of(self, rank: int) -> RankFamily | None:
        f = self.ranks[rank] if 0 <= rank < len(self.ranks) else None
        return None if f is None or f.is_static else f

    @property
    def is_static(self) -> bool:
        return all(self.of(r) is None for r in range(len(self.ranks)))

    def describe(self) -> dict:
        """The JSON form: per rank that reorders, its segments and policy."""
        return {
            str(r): {"segments": [list(s) for s in f.segments], "prefer": f.prefer}
            for r, f in enumerate(self.ranks)
            if self.of(r) is not None
        }
