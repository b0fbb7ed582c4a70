"""The schedule's dependency graph for the partition search, and its longest paths under a split's stage
times. Why a module of its own: every bound of the search (`pipec.partition.search`'s docstring, point 1)
rests on it; a path's length is additive over the stages, so each path is one linear row over the split.

Every op of the Program has a predecessor on its rank (the op before it) and, but for a first F, a data
predecessor from another rank (`pipec.ir.rules`; the second op of its pair when the producer is the first
of an overlapped pair, whose messages leave after the pair). The simulator never starts an op before both have
ended, plus the message's latency and fixed `comm` time when they are on two ranks, so for any path P and
any split x the simulated step T(x) >= len_P(x).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from pipec.ir.rules import dependencies
from pipec.ir.schedule import Schedule

KINDS = ("F", "B", "W")


class _Graph:
    """The Program's dependency graph (the module docstring): each op's predecessor on its rank and its
    data predecessor, with the message delay (latency + comm, in units, rounded down) between them."""

    def __init__(self, sched: Schedule, costs, unit: float) -> None:
        S = sched.num_stages
        kinds = sched.kinds
        kind_index = np.array([KINDS.index(k) for k in kinds], dtype=np.int64)
        slices = sched.slicing.slices if sched.slicing else 1
        kind = np.concatenate([kind_index[r.kind] for r in sched.ranks]) if sched.ranks else np.zeros(0, np.int64)
        mb = np.concatenate([r.mb for r in sched.ranks]).astype(np.int64)
        stage = np.concatenate([r.stage for r in sched.ranks]).astype(np.int64)
        rank = np.repeat(np.arange(len(sched.ranks)), [len(r) for r in sched.ranks])
        info = list(zip(kind.tolist(), stage.tolist(), rank.tolist(), mb.tolist()))  # (kind 0..2, stage, rank, mb)
        n, m = len(info), sched.num_microbatches
        ident = np.full(len(KINDS) * S * m, -1, dtype=np.int64)
        ident[(kind * S + stage) * m + mb] = np.arange(n)
        rank_pred = np.full(n, -1, dtype=np.int64)
        data_pred = np.full(n, -1, dtype=np.int64)
        delay = np.zeros(n, dtype=np.int64)
        first = 0
        for ops in sched.ranks:
            for j in range(1, len(ops)):
                rank_pred[first + j] = first + j - 1
            first += len(ops)
        # The data predecessor: the op's input from another rank by the dependency rule (pipec.ir.rules; a
        # kind receives at most one). An input on the op's own rank, the slice rules' included, ends before
        # the rank's previous op does (E304 holds them earlier in its order), so the rank chain carries it.
        for _, dk, dmb, ds, valid in dependencies(kind, mb, stage, S, len(kinds) == 3, slices):
            u = np.where(valid, ident[(dk * S + np.clip(ds, 0, S - 1)) * m + np.clip(dmb, 0, m - 1)], -1)
            remote = (u >= 0) & (rank[np.maximum(u, 0)] != rank)
            data_pred = np.where(remote, u, data_pred)
        # An overlapped pair's first op sends its output after the pair's step (`pipec.passes.lower`), so
        # a remote successor waits for the pair's second op, the one that ends the step.
        paired = np.concatenate([r.paired for r in sched.ranks]).astype(bool) if sched.ranks else np.zeros(0, bool)
        has = data_pred >= 0
        data_pred[has] += paired[data_pred[has]]
        for v in np.flatnonzero(data_pred >= 0).tolist():
            u, r = int(data_pred[v]), info[v][2]
            ru = info[u][2]
            d = float(costs.latency[ru, r]) + float(costs.comm[info[u][1]])
            delay[v] = math.floor(d / unit) if math.isfinite(d) else 0
        # a topological order: advance each rank while its next op's data predecessor is done
        order, done = [], np.zeros(n, dtype=bool)
        heads = []
        first = 0
        for ops in sched.ranks:
            heads.append([first, first + len(ops)])
            first += len(ops)
        progress = True
        while progress:
            progress = False
            for h in heads:
                while h[0] < h[1] and (data_pred[h[0]] < 0 or done[data_pred[h[0]]]):
                    done[h[0]] = True
                    order.append(h[0])
                    h[0] += 1
                    progress = True
        self.order = order
        self.kind = np.array([x[0] for x in info], dtype=np.int64)
        self.stage = np.array([x[1] for x in info], dtype=np.int64)
        self.rank = np.array([x[2] for x in info], dtype=np.int64)
        self.rank_pred, self.data_pred, self.delay = rank_pred.tolist(), data_pred.tolist(), delay.tolist()
        self.last_of_rank = [h[1] - 1 for h in heads if h[1] > 0]
        self.S = S

    def rank_chains(self, R: int) -> list[tuple[int, np.ndarray]]:
        """Each rank's whole order as a path: the sum of its ops (a rank computes one op at a time)."""
        out = []
        for r in range(R):
            counts = np.zeros((3, self.S), dtype=np.int64)
            sel = self.rank == r
            np.add.at(counts, (self.kind[sel], self.stage[sel]), 1)
            out.append((0, counts))
        return out

    def lengths(self, units: Mapping[str, np.ndarray]) -> np.ndarray:
        """The longest path's length (units) for each of a batch of splits, units[k] of shape (n, S):
        `paths`' first value for each, in one pass over the graph with numpy."""
        dur = np.stack([units[k] for k in KINDS])[self.kind, :, self.stage]  # (ops, n)
        end = np.empty_like(dur)
        rp, dp, dl = self.rank_pred, self.data_pred, self.delay
        for v in self.order:
            a = end[rp[v]] if rp[v] >= 0 else 0
            if dp[v] >= 0:
                a = np.maximum(a, end[dp[v]] + dl[v])
            end[v] = a + dur[v]
        return end.max(axis=0) if len(end) else np.zeros(dur.shape[1], dtype=np.int64)

    def paths(self, units: dict[str, np.ndarray]) -> tuple[int, list[tuple[int, np.ndarray]]]:
        """The longest path's length (units) at these per-stage durations, and the paths to cut with: the
        longest one, and the longest one ending at each rank's last op, as (constant, counts[kind, stage])."""
        dur = np.stack([units[k] for k in KINDS])[self.kind, self.stage].tolist()
        n = len(dur)
        end = [0] * n
        via = [-1] * n
        rp, dp, dl = self.rank_pred, self.data_pred, self.delay
        for v in self.order:
            a = end[rp[v]] if rp[v] >= 0 else 0
            b = end[dp[v]] + dl[v] if dp[v] >= 0 else -1
            if b > a:
                end[v], via[v] = b + dur[v], dp[v]
            else:
                end[v], via[v] = a + dur[v], rp[v]
        tips = [int(np.argmax(end)), *self.last_of_rank]
        out = []
        for t in dict.fromkeys(tips):
            counts = np.zeros((3, self.S), dtype=np.int64)
            const, v = 0, t
            while v >= 0:
                counts[self.kind[v], self.stage[v]] += 1
                u = via[v]
                if u >= 0 and u == dp[v]:
                    const += dl[v]
                v = u
            out.append((const, counts))
        return max(end), out
