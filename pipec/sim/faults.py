"""Faults: the straggler and link jitter models, their draws and their flags (issue 44).

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

The machine that runs a Schedule under these faults, each rank choosing within its order family as the
runtime does, is the one machine model's (`pipec.sim.machine.run_family`, `predicted_gain`): a straggler
stretches an op's cost there, jitter is added to a message's arrival.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

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
