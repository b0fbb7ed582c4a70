"""Hypothesis strategies for random valid schedules, written as .pipe text.

A random placement (any stage on any rank, so contiguous, looped, V-shaped and
scattered all occur), then random list scheduling: repeatedly pick one ready
op (all its dependencies done) and append it to its owner's order. Every
per-rank order built that way is a projection of one global topological
order, so the schedule is valid and cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st


@dataclass(frozen=True)
class RandomSchedule:
    p: int
    m: int
    placement: tuple[int, ...]
    split: bool
    orders: tuple[tuple[tuple[str, int, int], ...], ...]  # per rank: (kind, mb, stage)

    def text(self) -> str:
        ops = "F, B, W" if self.split else "F, B"
        place = " else ".join(f"if s == {s} then {r}" for s, r in enumerate(self.placement[:-1]))
        place = f"{place} else {self.placement[-1]}" if place else str(self.placement[-1])
        lines = [
            f'schedule "random" (p: int = {self.p}, m: int = {self.m}) {{',
            f"    stages {len(self.placement)}",
            f"    place s -> {place}",
            f"    ops {ops}",
            "    rank r {",
        ]
        for r, order in enumerate(self.orders):
            body = " ".join(f"{k}({i}, stage: {s})" for k, i, s in order)
            lines.append(f"        {'if' if r == 0 else 'elif'} r == {r} {{ {body} }}")
        lines += ["    }", "}"]
        return "\n".join(lines) + "\n"


def deps(kind: str, i: int, s: int, num_stages: int, split: bool) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", i, s - 1)] if s > 0 else []
    if kind == "B":
        return [("F", i, s)] + ([("B", i, s + 1)] if s < num_stages - 1 else [])
    return [("B", i, s)]


@st.composite
def random_schedules(draw, max_ranks: int = 4, max_stages: int = 6, max_mb: int = 4) -> RandomSchedule:
    p = draw(st.integers(1, max_ranks))
    S = draw(st.integers(1, max_stages))
    m = draw(st.integers(1, max_mb))
    split = draw(st.booleans())
    placement = tuple(draw(st.lists(st.integers(0, p - 1), min_size=S, max_size=S)))
    kinds = ("F", "B", "W") if split else ("F", "B")
    pending = {(k, i, s) for k in kinds for i in range(m) for s in range(S)}
    done: set = set()
    orders: list[list] = [[] for _ in range(p)]
    while pending:
        ready = sorted(op for op in pending if all(d in done for d in deps(*op, S, split)))
        op = ready[draw(st.integers(0, len(ready) - 1))]
        pending.remove(op)
        done.add(op)
        orders[placement[op[2]]].append(op)
    return RandomSchedule(p, m, placement, split, tuple(tuple(o) for o in orders))
