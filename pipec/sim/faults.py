"""Faults, and a machine that chooses within an order family as the runtime does (issue 44).

**Fault models** (`Faults`), the same values for `pipec simulate` and `pipec run` (which emulates them:
pipec.runtime.exec.faults):

- a *straggler* (`Straggler`): one rank `factor` times slower on a random `share` of its compute ops;
- *link jitter* (`Jitter`): every message between two ranks delayed by a time drawn from a distribution
  (`exp:MEAN`, exponential; `uniform:LO:HI`; `const:D`).

Every draw is a pure function of (seed, step, and the op or the message), by a counter-based hash
(`unit`), not of a generator's state: the runtime and the simulator, the static and the dynamic order,
every process of a run, all see the same ops slowed and the same messages delayed, whatever order they
run them in. So a dynamic and a static run face the same faults, and the simulator predicts the very
draws a run then meets.

**The family machine** (`run_family`): one step of a Schedule on a simple machine (each op its cost from
the simulator's cost arrays, a message its latency plus bytes over bandwidth plus jitter, no link
contention), each rank choosing, whenever it is free, among the ready ops its family allows (window of
the first op not run, pipec.ir.family) by the family's `prefer`, as `pipec.runtime.exec.dynamic` does;
`static=True` (or a rank without a family) runs the static order. Ranks are advanced in time order: the
rank that can start an op earliest goes next, so no message that could still arrive before that time is
missed (every op takes a positive time). `predicted_gain` is 1 - dynamic / static of that machine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from pipec.ir.family import OrderFamily
from pipec.ir.units import quantity

_M = (1 << 64) - 1
JITTER_KINDS = ("exp", "uniform", "const")


def unit(*xs: int) -> float:
    """A number in [0, 1) from integers (splitmix64 over them): the same everywhere, for the same inputs."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) & _M)) & _M
        h = (h + 0x9E3779B97F4A7C15) & _M
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
        h = z ^ (z >> 31)
    return (h >> 11) / float(1 << 53)


@dataclass(frozen=True)
class Straggler:
    """Rank `rank` takes `factor` times as long on a random `share` of its compute ops."""

    rank: int
    factor: float = 2.0
    share: float = 0.3

    def describe(self) -> str:
        return f"rank {self.rank} {self.factor:g}x slower on {self.share:.0%} of its ops"


@dataclass(frozen=True)
class Jitter:
    """Each message between ranks delayed by a draw: `exp` (mean a), `uniform` (a to b), `const` (a), seconds."""

    kind: str
    a: float
    b: float = 0.0

    def draw(self, u: float) -> float:
        if self.kind == "exp":
            return -self.a * math.log(1.0 - u)
        if self.kind == "uniform":
            return self.a + (self.b - self.a) * u
        return self.a

    @property
    def mean(self) -> float:
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    def describe(self) -> str:
        if self.kind == "uniform":
            return f"link jitter uniform {self.a * 1e3:g} to {self.b * 1e3:g} ms"
        return f"link jitter {self.kind} {self.a * 1e3:g} ms"


@dataclass(frozen=True)
class Faults:
    straggler: Straggler | None = None
    jitter: Jitter | None = None
    seed: int = 0

    def slow(self, step: int, rank: int, kind: int, mb: int, stage: int) -> float:
        """How many times its cost op (kind, mb, stage) of `rank` takes at `step` (1.0: not slowed)."""
        s = self.straggler
        if s is None or s.rank != rank:
            return 1.0
        return s.factor if unit(self.seed, 1, step, kind, mb, stage) < s.share else 1.0

    def delay(self, step: int, kind: int, mb: int, u: int, v: int, src: int, dst: int) -> float:
        """Seconds the message (kind, mb, its sending stage u, or its edge (u, v); v = -1 on the chain) from
        rank src to rank dst is held at `step`."""
        j = self.jitter
        if j is None or src == dst:
            return 0.0
        return j.draw(unit(self.seed, 2, step, kind, mb, u, v, src, dst))

    @property
    def is_none(self) -> bool:
        return self.straggler is None and self.jitter is None

    def describe(self) -> str:
        parts = [x.describe() for x in (self.straggler, self.jitter) if x is not None]
        return (", ".join(parts) + f" (fault seed {self.seed})") if parts else "no faults"

    def to_json(self) -> str:
        s, j = self.straggler, self.jitter
        return json.dumps(
            {
                "straggler": None if s is None else [s.rank, s.factor, s.share],
                "jitter": None if j is None else [j.kind, j.a, j.b],
                "seed": self.seed,
            }
        )

    @staticmethod
    def from_json(text: str) -> Faults:
        d = json.loads(text)
        s, j = d.get("straggler"), d.get("jitter")
        return Faults(
            None if s is None else Straggler(int(s[0]), float(s[1]), float(s[2])),
            None if j is None else Jitter(str(j[0]), float(j[1]), float(j[2])),
            int(d.get("seed", 0)),
        )


def faults_of(straggler: str | None, jitter: str | None, seed: int = 0) -> Faults | None:
    """The faults of `--straggler` and `--jitter` (None when neither is given); ValueError with the reason."""
    if straggler is None and jitter is None:
        return None
    return Faults(
        None if straggler is None else parse_straggler(straggler),
        None if jitter is None else parse_jitter(jitter),
        seed,
    )


def parse_straggler(text: str) -> Straggler:
    """`RANK[:FACTOR[:SHARE]]`, e.g. `1:2:0.3` (defaults 2 and 0.3); ValueError with the reason."""
    parts = text.strip().split(":")
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"expected RANK[:FACTOR[:SHARE]] such as 1:2:0.3, got `{text}`")
    try:
        rank = int(parts[0])
        factor = float(parts[1]) if len(parts) > 1 else 2.0
        share = float(parts[2]) if len(parts) > 2 else 0.3
    except ValueError:
        raise ValueError(f"expected RANK[:FACTOR[:SHARE]] such as 1:2:0.3, got `{text}`") from None
    if rank < 0 or not (math.isfinite(factor) and factor >= 1) or not 0 <= share <= 1:
        raise ValueError(f"a straggler needs a rank >= 0, a factor >= 1 and a share in 0..1, got `{text}`")
    return Straggler(rank, factor, share)


def parse_jitter(text: str) -> Jitter:
    """`exp:MEAN`, `uniform:LO:HI` or `const:D`, times with a unit (`exp:2ms`); ValueError with the reason."""
    parts = text.strip().split(":")
    kind = parts[0]
    want = {"exp": 2, "const": 2, "uniform": 3}
    if kind not in want or len(parts) != want[kind]:
        raise ValueError(f"expected exp:MEAN, uniform:LO:HI or const:D (times such as 2ms), got `{text}`")
    try:
        vals = [quantity(p, "time", "--jitter") for p in parts[1:]]
    except Exception as e:  # a PipecError E801 with the reason
        msg = e.diagnostics[0].message if hasattr(e, "diagnostics") else str(e)
        raise ValueError(msg) from None
    if kind == "uniform" and vals[1] < vals[0]:
        raise ValueError(f"uniform jitter needs LO <= HI, got `{text}`")
    return Jitter(kind, vals[0], vals[1] if len(vals) > 1 else 0.0)


# ---- the family machine --------------------------------------------------------------------------------
@dataclass(frozen=True)
class FamilyRun:
    """One simulated step: its makespan, each rank's ops in the order run (static positions) and each op's
    start and end (per rank, by static position)."""

    makespan: float
    order: tuple[tuple[int, ...], ...]
    start: tuple[np.ndarray, ...]
    end: tuple[np.ndarray, ...]


def _key(prefer: str, kind: int, mb: int, q: int, nkinds: int) -> tuple:
    """The runtime's choice among ready ops (pipec.runtime.exec.dynamic.choose restates it)."""
    if prefer == "depth":  # the lowest micro-batch, a backward before a forward
        return (mb, -kind, q)
    if prefer == "breadth":  # a forward first, then the lowest micro-batch
        return (kind, mb, q)
    return (q,)


def run_family(
    sched,
    cost: np.ndarray,
    latency: np.ndarray | float,
    bandwidth: np.ndarray | float,
    nbytes: np.ndarray | float = 0.0,
    family: OrderFamily | None = None,
    faults: Faults | None = None,
    *,
    step: int = 0,
    static: bool = False,
) -> FamilyRun:
    """One step of `sched` (a pipec.ir.schedule.Schedule without memory ops or pairs) on the family machine.
    `cost[kind, stage]`: seconds of an op; `latency[a, b]`, `bandwidth[a, b]` (bytes/s; scalars for every
    pair) and `nbytes[stage]`, the bytes of a stage's activation (its gradient the same)."""
    from pipec.ir.rules import dependencies

    faults = faults or Faults()
    R, S, m = sched.num_ranks, sched.num_stages, sched.num_microbatches
    K = len(sched.kinds)
    lat = np.broadcast_to(np.asarray(latency, dtype=float), (R, R))
    bw = np.broadcast_to(np.asarray(bandwidth, dtype=float), (R, R))
    nb = np.broadcast_to(np.asarray(nbytes, dtype=float), (S,))
    offsets = np.cumsum([0] + [len(r) for r in sched.ranks])
    n = int(offsets[-1])
    none = [np.zeros(0, dtype=np.int64)]
    kind = np.concatenate([o.kind for o in sched.ranks] or none)
    mb = np.concatenate([o.mb for o in sched.ranks] or none)
    stage = np.concatenate([o.stage for o in sched.ranks] or none)
    rank = np.repeat(np.arange(R), np.diff(offsets))
    where = np.full(K * S * m, -1, dtype=np.int64)
    where[(kind * S + stage) * m + mb] = np.arange(n)
    deps: list[list[int]] = [[] for _ in range(n)]
    for _rule, dk, di, ds, valid in dependencies(kind, mb, stage, S, K == 3, 1, sched.graph):
        key = np.where(valid, (dk * S + np.clip(ds, 0, S - 1)) * m + np.clip(di, 0, m - 1), 0)
        for c in np.flatnonzero(valid).tolist():
            p = int(where[key[c]])
            if p >= 0:
                deps[c].append(p)
    kind_l, mb_l, stage_l, rank_l = kind.tolist(), mb.tolist(), stage.tolist(), rank.tolist()
    fwd = sched.kinds.index("F") if "F" in sched.kinds else 0
    dur = [float(cost[k, s]) * faults.slow(step, r, k, i, s) for k, i, s, r in zip(kind_l, mb_l, stage_l, rank_l)]
    # when op c's input from op p is there: p's end plus, across ranks, the wire and the jitter
    wire: list[list[float]] = []
    for c in range(n):
        row = []
        for p in deps[c]:
            a, b = rank_l[p], rank_l[c]
            if a == b:
                row.append(0.0)
                continue
            u, v = stage_l[p], -1
            if sched.graph is not None:  # the edge: (producer, consumer) for an activation, reversed for a gradient
                u, v = (stage_l[p], stage_l[c]) if kind_l[p] == fwd else (stage_l[c], stage_l[p])
            msg = 0 if kind_l[p] == fwd else 1
            t = float(lat[a, b]) + (float(nb[stage_l[p if msg == 0 else c]]) / float(bw[a, b]) if bw[a, b] > 0 else 0.0)
            row.append(t + faults.delay(step, msg, mb_l[p], u, v, a, b))
        wire.append(row)
    end = np.full(n, np.nan)
    done = np.zeros(n, dtype=bool)
    fams = [None if (static or family is None) else family.of(r) for r in range(R)]
    arrays = [None if f is None else f.arrays() for f in fams]
    first = [int(offsets[r]) for r in range(R)]  # global index of each rank's first op not run
    free = [0.0] * R
    orders: list[list[int]] = [[] for _ in range(R)]
    start = np.full(n, np.nan)
    left = n
    while left:
        best = None  # (time, rank, candidates ready by then)
        for r in range(R):
            f, hi_r = first[r], int(offsets[r + 1])
            if f >= hi_r:
                continue
            if arrays[r] is None:
                cand = [f]
            else:
                _, reach, _ = arrays[r]
                base = int(offsets[r])
                cand = [c for c in range(f, base + int(reach[f - base])) if not done[c]]
            times = []
            for c in cand:
                if all(done[p] for p in deps[c]):
                    times.append((max([free[r]] + [end[p] + w for p, w in zip(deps[c], wire[c])]), c))
            if not times:
                continue
            t = min(t for t, _ in times)
            if best is None or t < best[0]:
                best = (t, r, [c for tc, c in times if tc <= t])
        if best is None:
            stuck = "; ".join(
                f"rank {r} at its op {first[r] - offsets[r]}" for r in range(R) if first[r] < offsets[r + 1]
            )
            raise ValueError(f"the family machine is stuck: {stuck}")
        t, r, ready = best
        prefer = fams[r].prefer if fams[r] is not None else "order"
        c = min(ready, key=lambda c: _key(prefer, kind_l[c], mb_l[c], c, K))
        start[c], end[c] = t, t + dur[c]
        done[c] = True
        free[r] = end[c]
        orders[r].append(c - int(offsets[r]))
        left -= 1
        while first[r] < offsets[r + 1] and done[first[r]]:
            first[r] += 1
    cut = [(int(offsets[r]), int(offsets[r + 1])) for r in range(R)]
    return FamilyRun(
        float(np.nanmax(end)) if n else 0.0,
        tuple(tuple(o) for o in orders),
        tuple(start[a:b] for a, b in cut),
        tuple(end[a:b] for a, b in cut),
    )


def predicted_gain(sched, cost, latency, bandwidth, nbytes=0.0, family=None, faults=None, steps=(0,)) -> dict:
    """Static and dynamic makespans on the family machine, summed over `steps`, and the gain 1 - dyn/static."""
    st = sum(
        run_family(sched, cost, latency, bandwidth, nbytes, family, faults, step=s, static=True).makespan for s in steps
    )
    dy = sum(run_family(sched, cost, latency, bandwidth, nbytes, family, faults, step=s).makespan for s in steps)
    return {"static": st / len(steps), "dynamic": dy / len(steps), "gain": 1.0 - dy / st if st > 0 else 0.0}
