"""Writing `.pipe` source: the one writer of explicit per-rank orders (`pipec import`, `pipec synth`).

Both tools hand over each rank's order as steps (one op, or the ops of an overlapped pair) and get the
same text back: the same declarations, the same `rank r { if r == ... }` block, and the same folding of
repeated steps into loops. Folding is by dynamic programming (`fold`), so a rank is written with the
fewest tokens of the language that `for` loops over repeated patterns can give; a pattern may repeat
with its micro-batches moved by any constant step (`by d`), and may hold overlapped pairs.

Numbers are written so that reading the file back gives the same floats (`number`, `quantity`): a
written schedule simulates exactly as the one it was written from, links included (`topology_lines`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipec.ir.units import exact_text

Op = tuple[str, int, int]  # (op kind, micro-batch, stage)
Step = tuple[Op, ...]  # one op, or the ops of an overlapped pair (`F(i) & B(j)`)

MAX_PATTERN = 12  # longest pattern (in steps) folded into a loop
PER_LINE = 8  # steps per line where nothing repeats


# ---- numbers ------------------------------------------------------------------------------------


def number(x: float) -> str:
    """The shortest text the language reads back as exactly this float (`4`, `0.6`, `1e-05`)."""
    x = float(x)
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return repr(x)


# The language's units (pipec.ir.units.LANGUAGE) in the order a tie in length is settled.
_LATENCY_UNITS = ("us", "ms", "s")
_BANDWIDTH_UNITS = ("Gbps", "Tbps", "Mbps", "Kbps", "bps")


def quantity(x: float, kind: str) -> str:
    """`x` (seconds, or bits per second) as a quantity with a unit that reads back exactly: the shortest
    such text (`40ms`, `10Gbps`), falling back to seconds or bits per second written out in full."""
    units = _LATENCY_UNITS if kind == "latency" else _BANDWIDTH_UNITS
    best = exact_text(x, units, lambda v: np.format_float_positional(v, trim="-"))
    return best if best is not None else np.format_float_positional(x, trim="-") + units[-1]


def per_stage_expr(values: Sequence[float], var: str = "s") -> str:
    """One number, or `if s == 0 then ... else ...` naming the values that differ from the last one."""
    vals = [float(x) for x in values]
    expr = number(vals[-1])
    if all(v == vals[-1] for v in vals):
        return expr
    for s in range(len(vals) - 2, -1, -1):
        if vals[s] != vals[-1]:
            expr = f"if {var} == {s} then {number(vals[s])} else {expr}"
    return expr


# ---- declarations -------------------------------------------------------------------------------


def placement_expr(placement: Sequence[int], p: int) -> str:
    """The `place s -> ...` expression of a placement: a formula pipec's schedules use where one fits,
    else runs of stages (`if s < 2 then 0 else ...`)."""
    S = len(placement)
    stages = range(S)
    if all(placement[s] == s for s in stages):
        return "s"
    if p and all(placement[s] == s % p for s in stages):
        return "s % p"
    if S == 2 * p and all(placement[s] == (s if s < p else 2 * p - 1 - s) for s in stages):
        return "if s < p then s else 2 * p - 1 - s"
    if p and S % p == 0 and all(placement[s] == (s % p if s // p % 2 == 0 else p - 1 - s % p) for s in stages):
        return "if s // p % 2 == 0 then s % p else p - 1 - s % p"
    if p and S % p == 0 and all(placement[s] == s // (S // p) for s in stages):
        return f"s // {S // p}"
    runs: list[tuple[int, int]] = []  # (one past the last stage, rank)
    for s in stages:
        if runs and runs[-1][1] == placement[s]:
            runs[-1] = (s + 1, placement[s])
        else:
            runs.append((s + 1, placement[s]))
    parts = [f"if s < {end} then {rank} else " for end, rank in runs[:-1]]
    return "".join(parts) + str(runs[-1][1])


def schedule_head(
    name: str, p: int, m: int, why_fixed: str, placement: Sequence[int], kinds: Sequence[str]
) -> list[str]:
    """The opening of a schedule with fixed sizes: its name and parameters, the `require` that fixes them
    (saying why), its stages, placement and op kinds."""
    name = "".join("_" if c in '"\n\r' else c for c in name)
    return [
        f'schedule "{name}" (p: int = {p}, m: int = {m}) {{',
        f'    require p == {p} and m == {m}, "{why_fixed}"',
        f"    stages {len(placement)}",
        f"    place s -> {placement_expr(placement, p)}",
        f"    ops {', '.join(kinds)}",
    ]


def topology_lines(
    datacenters: Sequence[tuple[str, int, int]], latency: np.ndarray, bandwidth: np.ndarray, sized: bool
) -> list[str] | None:
    """A `topology { ... }` block under which every rank pair gets exactly this latency (seconds) and
    bandwidth (bytes per second, as `pipec.sim.costs.CostModel` holds it): the datacenters, then a
    `default link` and a `link "A" <-> "B"` for each pair of datacenters whose links differ from it.

    [] when no block is needed (one network, every link free); None when the language cannot say it:
    links that differ inside one pair of datacenters (per node), or an infinite bandwidth that matters
    (`sized`: some message has bytes) once a block gives every link a finite default."""
    R = latency.shape[0]
    group = np.zeros(R, dtype=np.int64)
    names = [n for n, _, _ in datacenters]
    for g, (_, lo, hi) in enumerate(datacenters):
        group[lo:hi] = g
    classes: dict[tuple[int, int], set[tuple[float, float]]] = {}
    for a in range(R):
        for b in range(R):
            if a != b:
                key = (min(group[a], group[b]), max(group[a], group[b]))
                classes.setdefault(key, set()).add((float(latency[a, b]), float(bandwidth[a, b])))
    if any(len(v) > 1 for v in classes.values()):
        return None
    links = {k: next(iter(v)) for k, v in sorted(classes.items())}
    if not datacenters and all(lat == 0 and bw == math.inf for lat, bw in links.values()):
        return []

    def attrs(lat: float, bw: float) -> str | None:
        if bw == math.inf:
            return None if sized else f"latency {quantity(lat, 'latency')}"
        return f"latency {quantity(lat, 'latency')} bandwidth {quantity(bw * 8.0, 'bandwidth')}"

    values = list(links.values())
    default = max(values, key=values.count) if values else None
    lines = ["    topology {"]
    lines += [f'        dc "{n}" ranks {lo} .. {hi}' for n, lo, hi in datacenters]
    if default is not None:
        text = attrs(*default)
        if text is None:
            return None
        lines.append(f"        default link {text}")
    for (g, h), v in links.items():
        if v != default:
            text = attrs(*v)
            if text is None:
                return None
            lines.append(f'        link "{names[g]}" <-> "{names[h]}" {text}')
    return lines + ["    }"]


# ---- rank orders --------------------------------------------------------------------------------


def op_text(kind: str, mb: str, stage: int, multi: bool) -> str:
    """One op call, or a memory op (`RECOMPUTE(3)`, written the same way); `stage:` only when the rank holds
    several stages."""
    return f"{kind}({mb}, stage: {stage})" if multi else f"{kind}({mb})"


def rank_block(bodies: Sequence[Sequence[str]]) -> list[str]:
    """`rank r { ... }` holding each rank's lines, one `if r == ...` branch per rank (none for one rank)."""
    lines = ["    rank r {"]
    for r, body in enumerate(bodies):
        if len(bodies) == 1:
            lines += ["        " + x for x in body]
            continue
        lines.append(("        if" if r == 0 else "        } elif") + f" r == {r} {{")
        lines += ["            " + x for x in body]
    if len(bodies) > 1:
        lines.append("        }")
    lines.append("    }")
    return lines


def schedule_steps(sched, r: int) -> list[Step]:
    """Rank r's order of a Schedule as steps, an overlapped pair as one step, with the memory ops it places
    (`Schedule.memops`) as steps of their own where they are issued: a memory op is a statement of the
    language placed before the rank's next op, so writing it there gives back its `before`. (One issued
    between the two ops of an overlapped pair, which the language cannot place, is written before the pair.)"""
    ranks = sched.ranks[r]
    kinds = [sched.kinds[k] for k in ranks.kind.tolist()]
    mb, stage, paired = ranks.mb.tolist(), ranks.stage.tolist(), ranks.paired.tolist()
    mems = list(sched.memops[r]) if sched.memops else []
    out: list[Step] = []
    j = x = 0
    while j < len(kinds):
        n = 1
        while j + n < len(kinds) and paired[j + n - 1]:
            n += 1
        while x < len(mems) and mems[x].before < j + n:
            out.append(((mems[x].op, mems[x].mb, mems[x].stage),))
            x += 1
        out.append(tuple((kinds[q], mb[q], stage[q]) for q in range(j, j + n)))
        j += n
    out += [((y.op, y.mb, y.stage),) for y in mems[x:]]
    return out


@dataclass(frozen=True)
class Loop:
    """Steps start .. start + length * count: a pattern of `length` steps written once, repeated `count`
    times with every micro-batch `delta` higher each time."""

    start: int
    length: int
    count: int
    delta: int


class _Columns:
    """A rank's steps as arrays (ops padded to the widest step by repeating the first): what `fold` needs
    to find repeats and count tokens without a Python loop per pattern length."""

    def __init__(self, steps: Sequence[Step], multi: bool) -> None:
        width = max((len(s) for s in steps), default=1)
        shapes: dict[tuple, int] = {}
        self.shape = np.array([shapes.setdefault(tuple((k, st) for k, _, st in s), len(shapes)) for s in steps])
        self.mb = np.array([[o[1] for o in s] + [s[0][1]] * (width - len(s)) for s in steps], dtype=np.int64)
        self.mb = self.mb.reshape(len(steps), width)
        self.real = np.array([[True] * len(s) + [False] * (width - len(s)) for s in steps], dtype=bool)
        self.real = self.real.reshape(len(steps), width)
        # A call is `F ( 0 )`, 4 tokens, and `, stage : 3` 4 more when the rank names stages; `&` joins a pair.
        ops = np.array([len(s) for s in steps], dtype=np.int64)
        self.tokens = ops * (8 if multi else 4) + ops - 1

    def repeats(self, L: int) -> tuple[np.ndarray, np.ndarray]:
        """For patterns of L steps, per step q: how many steps from q on have a copy L steps later with
        every micro-batch moved by one nonzero delta, the same delta throughout (0 where step q + L is
        no such copy of step q); and that delta."""
        N = len(self.shape) - L
        if N <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        diff = self.mb[L:] - self.mb[:N]
        delta = diff[:, 0]
        ok = (self.shape[L:] == self.shape[:N]) & (delta != 0) & (diff == delta[:, None]).all(axis=1)
        key = np.where(ok, delta, 0)
        last = ok & np.append(key[1:] != key[:-1], True)  # the last step of each run of one delta
        ends = np.flatnonzero(last)
        q = np.arange(N)
        e = ends[np.minimum(np.searchsorted(ends, q), len(ends) - 1)] if len(ends) else q
        return np.where(ok, e - q + 1, 0), delta

    def body_tokens(self, max_pattern: int) -> list[list[int]]:
        """Per pattern length L (index L - 1), per start j: the tokens of steps j .. j + L - 1 written
        relative to `i` = the first op's micro-batch (`i + 2` is two tokens more than `i`)."""
        n = len(self.shape)
        base = self.mb[:, 0]
        out, acc = [], np.zeros(n, dtype=np.int64)
        for u in range(min(max_pattern, n)):
            rel = ((self.mb[u:] != base[: n - u, None]) & self.real[u:]).sum(axis=1)
            acc = acc[: n - u] + self.tokens[u:] + 2 * rel
            out.append(acc.tolist())
        return out


def fold(steps: Sequence[Step], multi: bool = False, max_pattern: int = MAX_PATTERN) -> list[Step | Loop]:
    """A rank's steps as literal steps and loops, written with the fewest tokens of the language, then
    the fewest segments (a run of literal steps is one). A call is `F ( 0 )` (4 tokens, `i + 2` two
    more than `i`, `, stage: 3` 4 more), `&` one, a loop `for i in 0 .. 8 { }` 7 (`by 4` 2 more).

    Dynamic programming from the end. A loop's pattern of L steps at j may repeat any number of times
    its copies allow; its cost does not depend on the count but through where it ends, so a running
    minimum along each run of copies gives the best count: O(n * max_pattern) for n steps."""
    n = len(steps)
    if n == 0:
        return []
    cols = _Columns(steps, multi)
    tokens = cols.tokens.tolist()
    first_mb = cols.mb[:, 0].tolist()
    W = n + 1  # value = tokens * W + segments: compares tokens first
    val = [0] * (n + 1)
    choice: list[tuple[int, int, int]] = [(0, 0, 0)] * (n + 1)  # (length, count, delta); (0, 0, 0): literal
    lengths = range(1, min(max_pattern, n // 2) + 1)
    kmax, deltas = {}, {}
    for L in lengths:
        run, delta = cols.repeats(L)
        kmax[L], deltas[L] = (1 + run // L).tolist(), delta.tolist()
    body = cols.body_tokens(max_pattern)
    best_end: dict[int, list[tuple[int, int]]] = {L: [(0, 0)] * n for L in lengths}  # (value, end) per start
    for j in range(n - 1, -1, -1):
        lit_next = j + 1 < n and choice[j + 1][0] == 0
        cand = val[j + 1] + tokens[j] * W + (0 if lit_next else 1)
        pick = (0, 0, 0)
        for L in lengths:
            if j >= len(kmax[L]) or kmax[L][j] < 2:
                continue
            d = deltas[L][j]
            e = j + 2 * L
            here = (val[e] + (W if first_mb[e - L] + d < 0 else 0), e)  # `.. -1`: one token more
            if kmax[L][j] >= 3 and best_end[L][j + L][0] < here[0]:
                here = best_end[L][j + L]
            best_end[L][j] = here
            v = here[0] + (body[L - 1][j] + 7 + (0 if d == 1 else 2 if d > 0 else 3)) * W + 1
            if v < cand:
                cand, pick = v, (L, (here[1] - j) // L, d)
        val[j], choice[j] = cand, pick
    out: list[Step | Loop] = []
    j = 0
    while j < n:
        L, c, d = choice[j]
        if L == 0:
            out.append(steps[j])
            j += 1
        else:
            out.append(Loop(j, L, c, d))
            j += L * c
    return out


def _step_text(step: Step, multi: bool, base: int | None = None) -> str:
    def mb(i: int) -> str:
        if base is None:
            return str(i)
        d = i - base
        return "i" if d == 0 else f"i + {d}" if d > 0 else f"i - {-d}"

    return " & ".join(op_text(k, mb(i), s, multi) for k, i, s in step)


def rank_lines(steps: Sequence[Step], multi: bool) -> list[str]:
    """A rank's order as `.pipe` lines: `for i in a .. b [by d] { ... }` where steps repeat (see `fold`),
    the steps between loops PER_LINE to a line; `stage:` on every op when `multi`."""
    lines: list[str] = []
    plain: list[str] = []

    def flush() -> None:
        for k in range(0, len(plain), PER_LINE):
            lines.append("  ".join(plain[k : k + PER_LINE]))
        plain.clear()

    for seg in fold(steps, multi):
        if not isinstance(seg, Loop):
            plain.append(_step_text(seg, multi))
            continue
        flush()
        base = steps[seg.start][0][1]
        body = "  ".join(_step_text(s, multi, base) for s in steps[seg.start : seg.start + seg.length])
        by = "" if seg.delta == 1 else f" by {seg.delta}"
        lines.append(f"for i in {base} .. {base + seg.count * seg.delta}{by} {{ {body} }}")
    flush()
    return lines
