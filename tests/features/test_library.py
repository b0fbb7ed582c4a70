"""The standard library: every schedule checked over a parameter grid, compared op for op with
torch.distributed.pipelining's orders where torch has the schedule (and gets it right), and with the
papers' definitions (reference generators, in-flight bounds, bubble sizes) where it does not.

torch is a test dependency: it is imported normally, so a missing torch fails these tests loudly.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
from library_cases import TORCH, Op, grid_ms, orders, param_names, try_load
from torch.distributed.pipelining import schedules as ts
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.stage import PipelineStage

from pipec.api import load
from pipec.frontend import library
from pipec.ir.schedule import Schedule
from pipec.passes.compiler import compile_schedule

# The configurations each paper (or torch's docs) shows; they must be accepted.
MAIN_CONFIGS: dict[str, list[dict[str, int]]] = {
    "1f1b": [dict(p=4, m=8), dict(p=8, m=32)],
    "gpipe": [dict(p=4, m=8), dict(p=8, m=32)],
    "interleaved-1f1b": [dict(p=4, v=2, m=8), dict(p=4, v=4, m=16), dict(p=8, v=2, m=32)],
    "looped-bfs": [dict(p=4, v=2, m=8), dict(p=8, v=4, m=16)],
    "zb-h1": [dict(p=4, m=8), dict(p=8, m=24)],
    "zb-h2": [dict(p=4, m=8), dict(p=8, m=24)],
    "zb-v": [dict(p=4, m=8), dict(p=4, m=7), dict(p=8, m=32)],
    "dualpipe-v": [dict(p=4, m=8), dict(p=4, m=20), dict(p=8, m=32)],
    # Megatron-LM's combined 1F1B (--overlap-moe-expert-parallel-comm) over the interleaved configurations.
    "combined-1f1b": [dict(p=4, v=2, m=8), dict(p=4, v=4, m=16), dict(p=8, v=2, m=32)],
    # Pipeline Parallelism with Controllable Memory (NeurIPS 2024): the issue-19 reference points.
    "v-half": [dict(p=4, m=8), dict(p=8, m=16)],
    "v-min": [dict(p=4, m=8), dict(p=8, m=16)],
    # Two datacenters of p / 2 ranks (docs/cross-dc.md, examples/cross_dc.pipe).
    "crossdc-1f1b": [dict(p=4, m=8), dict(p=8, m=16), dict(p=8, m=32)],
    "crossdc-zb": [dict(p=4, m=8), dict(p=8, m=16), dict(p=8, m=32)],
    # Blocks of b = p micro-batches per chunk (the paper's scheduling unit), and one of 2p.
    "zeropp": [dict(p=4, v=2, m=8), dict(p=4, v=4, m=16), dict(p=8, v=2, m=32), dict(p=4, v=2, m=16, b=8)],
    # Memory ops (issue 19): Megatron's full recomputation on 1F1B and ZB-V, PipeOffload's offload on 1F1B.
    "1f1b-recompute": [dict(p=4, m=8), dict(p=8, m=32)],
    "zb-v-recompute": [dict(p=4, m=8), dict(p=8, m=32)],
    "1f1b-offload": [dict(p=4, m=8), dict(p=8, m=32), dict(p=4, m=8, k=2, ahead=2)],
    # TeraPipe (ICML 2021): one or two long sequences per step, cut into slices; both orders.
    "terapipe": [dict(p=4, m=1, n=4), dict(p=8, m=2, n=8), dict(p=4, m=1, n=16, f1b1=True)],
}


# ---------------------------------------------------------------- helpers


def simulate(s: Schedule, cost: dict[str, int]) -> list[tuple[int, int]]:
    """Run each rank's order in sequence, each op as soon as its dependencies are done (no comm cost).

    Returns each rank's (start of first op, end of last op); fails if the ranks wait on each other in a
    cycle. An overlapped pair runs as one unit costing both ops.
    """
    S, split = s.num_stages, s.split_backward
    ends: dict[tuple[str, int, int], int] = {}
    steps = []  # per rank: list of units, each a list of ops
    for r in range(s.num_ranks):
        units: list[list[Op]] = []
        join = False
        for op in orders(s)[r]:
            if join:
                units[-1].append(op)
            else:
                units.append([op])
            join = op[3]
        steps.append(units)

    def deps(k: str, i: int, st: int) -> list[tuple[str, int, int]]:
        if k == "F":
            return [("F", i, st - 1)] if st > 0 else []
        if k == "B":
            return [("F", i, st)] + ([("B", i, st + 1)] if st < S - 1 else [])
        return [("B", i, st)] if split else []

    pos = [0] * s.num_ranks
    free = [0] * s.num_ranks
    first: list[int | None] = [None] * s.num_ranks
    moved = True
    while moved:
        moved = False
        for r, units in enumerate(steps):
            while pos[r] < len(units):
                unit = units[pos[r]]
                own = {(k, i, st) for k, i, st, _ in unit}
                need = [d for k, i, st, _ in unit for d in deps(k, i, st) if d not in own]
                if any(d not in ends for d in need):
                    break
                start = max([free[r]] + [ends[d] for d in need])
                free[r] = start + sum(cost[k] for k, *_ in unit)
                for k, i, st, _ in unit:
                    ends[(k, i, st)] = free[r]
                first[r] = start if first[r] is None else first[r]
                pos[r] += 1
                moved = True
    stuck = [r for r in range(s.num_ranks) if pos[r] < len(steps[r])]
    assert not stuck, f"{s.name} {dict(s.params)}: ranks {stuck} wait on each other forever"
    return [(first[r] or 0, free[r]) for r in range(s.num_ranks)]


def span(s: Schedule, cost: dict[str, int]) -> int:
    """The longest rank's time from its first op to its last (Zero Bubble's cost of a schedule)."""
    return max(end - start for start, end in simulate(s, cost))


def in_flight(ops: list[Op], until: str) -> int:
    """The most micro-batches (per stage) a rank holds: forward done, `until` (B or W) not yet."""
    live, peak = set(), 0
    for k, i, st, _ in ops:
        if k == "F":
            live.add((i, st))
            peak = max(peak, len(live))
        elif k == until:
            live.discard((i, st))
    return peak


UNIT = {"F": 1, "B": 1, "W": 1}  # split backward, T_F = T_B = T_W
FULL = {"F": 1, "B": 2, "W": 0}  # full backward costs T_B + T_W


# ---------------------------------------------------------------- torch


@functools.cache  # building the autospec is the slow part; a schedule only sets p-determined attributes on it
def _stage_mock(p: int, v: int):
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, p * v
    return stage


def torch_orders(cls, p: int, m: int, v: int, split: bool) -> list[list[Op]] | None:
    """torch's per-rank compute order in our terms, or None when torch rejects the parameters.

    I (input grad) is our B; W is W; a full backward is B (then W, in a split schedule); an
    OVERLAP_F_B is our overlapped pair F & B. get_schedule_ops insists on >= 2 stages per rank for
    multi-stage classes, so those are built directly, which also allows v = 1.
    """
    try:
        if issubclass(cls, ts.PipelineScheduleSingle):
            rows = get_schedule_ops(cls, p, m)
        else:
            order = cls([_stage_mock(p, v)] * v, m).pipeline_order
            rows = [order[r] for r in range(p)]
    except ValueError:
        return None
    T = ts._ComputationType
    out = []
    for row in rows:
        ops: list[Op] = []
        for a in row:
            if a is None or a.computation_type == T.REDUCE_GRAD:
                continue
            pair = a.computation_type == T.OVERLAP_F_B
            for j, sub in enumerate(a.sub_actions if pair else (a,)):
                t, i, st = sub.computation_type, sub.microbatch_index, sub.stage_index
                kind = {T.FORWARD: "F", T.BACKWARD_INPUT: "B", T.FULL_BACKWARD: "B", T.BACKWARD_WEIGHT: "W"}[t]
                ops.append((kind, i, st, pair and j == 0))
                if t == T.FULL_BACKWARD and split:
                    ops.append(("W", i, st, False))
        out.append(ops)
    return out


# ---------------------------------------------------------------- (1) the grid


def test_every_schedule_has_main_configs():
    assert set(library.names()) <= set(MAIN_CONFIGS), "add the paper's configurations of a new schedule"


def _grid(name: str, ps: range) -> None:
    """Every p of `ps`, m = 1..4p, v = 1..3: load (every op once, in order), simulate, lower."""
    names = param_names(name)
    assert {"p", "m"} <= set(names), f"{name}: library schedules take p and m"
    for params in MAIN_CONFIGS.get(name, [{}]):
        assert try_load(name, **params) is not None, f"{name} rejects its main configuration {params}"
    accepted = 0
    for p in ps:
        for m in range(1, 4 * p + 1):
            for v in (1, 2, 3) if "v" in names else (None,):
                params = dict(p=p, m=m) | ({} if v is None else dict(v=v))
                s = try_load(name, **params)
                if s is None:
                    continue
                accepted += 1
                assert s.num_ranks == p and s.num_sequences == m  # with token slices, m * n units
                simulate(s, UNIT if s.split_backward else FULL)  # the ranks never wait on each other in a cycle
                compile_schedule(s)  # lowers; no deadlock even when sends block until received; memory fits
    assert accepted > 0


@pytest.mark.parametrize("name", library.names())
def test_grid(name: str):
    """p = 1..5 (every boundary a schedule has: m < p, m = p, m = 2p - 1, ...), m = 1..4p, v = 1..3."""
    _grid(name, range(1, 6))


@pytest.mark.slow  # p = 6..8 of the same grid: three quarters of its ops, the same boundaries as test_grid's
@pytest.mark.parametrize("name", library.names())
def test_grid_large_p(name: str):
    _grid(name, range(6, 9))


# ---------------------------------------------------------------- (2) torch as the oracle


@pytest.mark.parametrize("name, cls, local, split", TORCH, ids=[t[0] for t in TORCH])
def test_equals_torch(name, cls, local, split):
    compared = 0
    for p in range(1, 9):
        for m in grid_ms(p):
            for v in (1, 2, 3) if local == "v" else (local,):
                params = dict(p=p, m=m) | ({"v": v} if local == "v" else {})
                ours = try_load(name, **params)
                theirs = torch_orders(cls, p, m, v, split)
                if name == "zb-v" and ours is None and m < 2 * p - 1:
                    # torch builds ZB-V for m >= 2p - 1 micro-batches, then drops the ops past m;
                    # the library schedule requires m >= 2p - 1 instead.
                    assert theirs is not None
                    continue
                if name == "zb-h1" and theirs is None:
                    continue  # ZB1P's constructor wants m to split into rounds; ZB-H1 has no rounds
                assert (ours is None) == (theirs is None), f"{name} {params}: pipec and torch accept different m"
                if ours is None:
                    continue
                for r, (a, b) in enumerate(zip(orders(ours), theirs, strict=True)):
                    assert a == b, f"{name} {params} rank {r} differs from torch {cls.__name__}"
                compared += 1
    assert compared >= 30


def test_dualpipe_v_has_torch_overlaps():
    s = load("dualpipe-v", p=4, m=8)
    pairs = [(a, b) for ops in orders(s) for a, b in zip(ops, ops[1:]) if a[3]]
    assert pairs and all(a[0] == "F" and b[0] == "B" for a, b in pairs)
    assert len(pairs) == sum(
        1
        for row in get_schedule_ops("DualPipeV", 4, 8)
        for a in row
        if a is not None and a.computation_type == ts._ComputationType.OVERLAP_F_B
    )


def test_torch_1f1b_last_rank_is_malformed():
    """torch 2.13's Schedule1F1B IR order starts the last rank's steady state at F(1): its forwards are
    F(1)..F(m), skipping F(0) and running F(m) out of range, and `_validate_schedule` rejects it. Every
    other rank equals the paper's 1F1B (our library file). When torch fixes it, this test fails: then
    make torch an oracle for 1F1B as well."""
    for p in range(1, 7):
        for m in range(p, 3 * p + 1):  # torch's 1F1B needs m >= p
            ours = orders(load("1f1b", p=p, m=m))
            theirs = torch_orders(ts.Schedule1F1B, p, m, 1, False)
            assert theirs is not None
            assert theirs[: p - 1] == ours[: p - 1]
            shifted = [(k, i + 1 if k == "F" else i, st, pr) for k, i, st, pr in ours[p - 1]]
            assert theirs[p - 1] == shifted, f"p={p} m={m}"
            rows = get_schedule_ops("1F1B", p, m)
            with pytest.raises(AssertionError, match="without first running Forward"):
                ts._validate_schedule(dict(enumerate(rows)), p, p, m)


# ---------------------------------------------------------------- (3) the papers' definitions


def ref_gpipe(p: int, m: int) -> list[list[Op]]:
    return [[("F", i, r, False) for i in range(m)] + [("B", i, r, False) for i in range(m)] for r in range(p)]


def ref_1f1b(p: int, m: int) -> list[list[Op]]:
    """PipeDream-Flush as a rule: rank r runs a forward while fewer than p - r micro-batches are in
    flight and forwards remain, otherwise the oldest backward."""
    out = []
    for r in range(p):
        ops: list[Op] = []
        f = b = 0
        while b < m:
            if f < m and f - b < p - r:
                ops.append(("F", f, r, False))
                f += 1
            else:
                ops.append(("B", b, r, False))
                b += 1
        out.append(ops)
    return out


def with_lagging_w(fb: list[list[Op]], lag) -> list[list[Op]]:
    """Insert W(j) right after B(j + lag(r)) on rank r; the W passes with no such B go at the end."""
    out = []
    for r, ops in enumerate(fb):
        m = sum(1 for k, *_ in ops if k == "B")
        new: list[Op] = []
        for op in ops:
            new.append(op)
            if op[0] == "B" and op[1] - lag(r) >= 0:
                new.append(("W", op[1] - lag(r), r, False))
        new += [("W", j, r, False) for j in range(max(m - lag(r), 0), m)]
        out.append(new)
    return out


def ref_zb_h1(p: int, m: int) -> list[list[Op]]:
    """ZB-H1 (Zero Bubble, Figure 3): 1F1B's F/B order; rank r delays each W by r micro-batches."""
    return with_lagging_w(ref_1f1b(p, m), lambda r: r)


def ref_zb_h2(p: int, m: int) -> list[list[Op]]:
    """ZB-H2 (Zero Bubble, Figure 3): rank r warms up with 2(p - r) - 1 forwards, then each backward is
    followed by the next forward; W lags B by 2r micro-batches."""
    fb = []
    for r in range(p):
        warm = min(2 * (p - r) - 1, m)
        ops = [("F", i, r, False) for i in range(warm)]
        for i in range(m):
            ops.append(("B", i, r, False))
            if warm + i < m:
                ops.append(("F", warm + i, r, False))
        fb.append(ops)
    return with_lagging_w(fb, lambda r: 2 * r)


REFS = {"gpipe": ref_gpipe, "1f1b": ref_1f1b, "zb-h1": ref_zb_h1, "zb-h2": ref_zb_h2}


@pytest.mark.parametrize("name", sorted(REFS))
def test_equals_reference(name: str):
    for p in range(1, 9):
        for m in grid_ms(p):
            assert orders(load(name, p=p, m=m)) == REFS[name](p, m), f"{name} p={p} m={m}"


def _figure(text: str) -> list[tuple[str, int]]:
    """`F1 B1 W1` as in the paper's figures (1-based) to [(kind, 0-based mb)]."""
    return [(t[0], int(t[1:]) - 1) for t in text.split()]


def test_zero_bubble_figure_3():
    """Devices 1 and 4 of the paper's Figure 3 (p = 4, m = 8), read off the figure."""
    figure = {
        ("zb-h1", 0): "F1 F2 F3 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 F8 B5 W5 B6 W6 B7 W7 B8 W8",
        ("zb-h1", 3): "F1 B1 F2 B2 F3 B3 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 F8 B8 W5 W6 W7 W8",
        ("zb-h2", 0): "F1 F2 F3 F4 F5 F6 F7 B1 W1 F8 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7 B8 W8",
        ("zb-h2", 3): "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 W1 F8 B8 W2 W3 W4 W5 W6 W7 W8",
    }
    for (name, r), text in figure.items():
        ops = load(name, p=4, m=8).ops(r)
        assert [(o.kind, o.mb) for o in ops] == _figure(text), f"{name} device {r + 1}"


def test_1f1b_warmup_and_in_flight():
    for p in range(1, 9):
        for m in grid_ms(p):
            s = load("1f1b", p=p, m=m)
            for r, ops in enumerate(orders(s)):
                warm = min(p - 1 - r, m)
                kinds = "".join(k for k, *_ in ops)
                assert kinds[:warm] == "F" * warm
                steady = kinds[warm : warm + 2 * (m - warm)]
                assert steady == "FB" * (m - warm), f"p={p} m={m} rank {r}"
                assert in_flight(ops, "B") == min(p - r, m)


def test_split_backward_memory():
    """ZB-H1 keeps 1F1B's bound (p - r micro-batches between F and B, p between F and W); ZB-H2 holds
    up to 2p - 1; ZB-V holds 2p chunk activations, i.e. p stage-sized ones, like 1F1B's first rank."""
    for p in range(1, 9):
        for m in grid_ms(p):
            for r, ops in enumerate(orders(load("zb-h1", p=p, m=m))):
                assert in_flight(ops, "B") == min(p - r, m)
                assert in_flight(ops, "W") <= p
            for r, ops in enumerate(orders(load("zb-h2", p=p, m=m))):
                assert in_flight(ops, "B") == min(2 * (p - r) - 1, m)
                assert in_flight(ops, "W") <= 2 * p - 1
            zbv = try_load("zb-v", p=p, m=m)
            for ops in orders(zbv) if zbv else []:
                assert in_flight(ops, "W") <= 2 * p


def test_bubbles_match_the_papers():
    """With T_F = T_B = T_W = 1 and no communication cost (Zero Bubble's cost: the longest rank's time):
    1F1B and GPipe (full B = T_B + T_W) lose (p-1)(T_F+T_B+T_W); ZB-H1 (p-1)(T_F+T_B-T_W) once m >= p;
    ZB-H2 and ZB-V nothing once m >= 2p - 1; interleaved 1F1B with v chunks of cost 1/v-th of a stage
    loses (p-1)(T_F+T_B+T_W) chunk-op units, i.e. (p-1)/(v m) of the ideal time."""
    for p in range(1, 9):
        for m in grid_ms(p):
            assert span(load("1f1b", p=p, m=m), FULL) == 3 * m + 3 * (p - 1)
            assert span(load("gpipe", p=p, m=m), FULL) == 3 * m + 3 * (p - 1)
            if m >= p:
                assert span(load("zb-h1", p=p, m=m), UNIT) == 3 * m + (p - 1)
            if m >= 2 * p - 1:
                assert span(load("zb-h2", p=p, m=m), UNIT) == 3 * m
                assert span(load("zb-v", p=p, m=m), UNIT) == 6 * m
            for v in (2, 3):
                s = try_load("interleaved-1f1b", p=p, m=m, v=v)
                if s is not None and m % p == 0:
                    assert span(s, FULL) == 3 * v * m + 3 * (p - 1)
