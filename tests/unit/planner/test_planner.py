"""pipec.planner: the candidates it builds compile and keep their memory ops where the rules allow; its
answer is the best of every candidate's every split (brute force) within the limits, proven by the memory
check; its bounds are below every split's step; a limit nothing meets is E830 naming the closest."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from tables import random_layer_table

from pipec.driver import build, read_source
from pipec.errors import PipecError
from pipec.partition.problem import Problem
from pipec.passes.compiler import compile_schedule
from pipec.planner import Candidate, Inputs, microbatch_counts, plan, prove
from pipec.planner.bounds import layer_bound, path_bound, rows_of, universal_bound, work_bound
from pipec.planner.report import explain, megatron_settings, pareto
from pipec.planner.search import _Builder
from pipec.planner.space import layer_kinds, megatron_split, rank_orders, scaled, with_memops

pytest.importorskip("ortools")


def _inputs(table, p=2, limit=math.nan, ms=(2, 4), schedules=("1f1b", "gpipe", "zb-h1"), speed=None):
    return Inputs(
        replace(table, microbatches=4),
        p,
        global_batch=8,
        table_mbs=2.0,
        speed=tuple(speed or (1.0,) * p),
        limit=(limit,) * p,
        microbatches=tuple(ms),
        schedules=tuple(schedules),
    )


def _splits(L: int, S: int):
    for cut in itertools.combinations(range(1, L), S - 1):
        yield (0, *cut, L)


def _brute(inputs: Inputs, cands) -> float:
    """The least simulated step of every split of every candidate that fits: what the plan must find."""
    b = _Builder(inputs)
    best = math.inf
    for c in cands:
        try:
            pb = b.problem(c)
        except PipecError:
            continue
        for bounds in _splits(pb.L, pb.S):
            got = pb.evaluate(bounds)
            if got.fits:
                best = min(best, got.step)
    return best


def test_microbatch_counts_divide_the_batch_and_start_at_p():
    assert microbatch_counts(32, 4) == [4, 8, 16, 32]
    assert microbatch_counts(24, 4) == [4, 8, 24]  # multiples of p dividing 24, each at least twice the last
    assert microbatch_counts(6, 4) == [6]  # no multiple of p divides it: the divisors from p up
    assert microbatch_counts(16, 4, [8, 4]) == [4, 8]


def test_scaled_table_scales_times_and_activations_not_parameters():
    t = random_layer_table(np.random.default_rng(0), 4)
    s = scaled(t, 0.5)
    assert np.allclose(s.F, t.F / 2) and np.allclose(s.act_bytes, t.act_bytes / 2)
    assert np.array_equal(s.param_bytes, t.param_bytes) and np.array_equal(s.state_bytes, t.state_bytes)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved-1f1b", "dualpipe-v"])
@pytest.mark.parametrize("kind", ["recompute", "offload"])
def test_memops_compile_on_the_chosen_ranks_only(name, kind):
    """Memory ops land on ranks 0..k-1 only, outside overlapped pairs, and the schedule still compiles."""
    sched = build(read_source(name), {"p": 4, "m": 8})
    got = with_memops(sched, kind, 2)
    compile_schedule(got)  # the checks: no E30x/E40x
    assert all(len(got.memops[r]) == 0 for r in (2, 3))
    assert all(len(got.memops[r]) > 0 for r in (0, 1)) or kind == "offload"
    ops = {"recompute": {"RECOMPUTE"}, "offload": {"OFFLOAD", "RELOAD"}}[kind]
    assert {x.op for r in (0, 1) for x in got.memops[r]} <= ops


def test_megatron_split_puts_embedding_first_and_head_last():
    assert megatron_split(10, 4) == (0, 3, 5, 7, 10)  # 1 + 2, 2, 2, 2 + 1 of the 8 blocks
    assert megatron_split(5, 4) == (0, 1, 2, 3, 5)  # too few blocks: every layer evenly
    assert layer_kinds(["embed", "b0", "b1", "head"]) == ["E", "t", "t", "L"]
    assert layer_kinds(["a", "b"]) == ["t", "t"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_is_the_best_of_every_candidate_and_split(seed):
    """Brute force over every split of every candidate (schedule x m x memory ops) that fits: the plan's step
    is that least step, its bound is at most it, and its memory passes the memory check."""
    rng = np.random.default_rng(seed)
    table = random_layer_table(rng, 5)
    free = _inputs(table)
    first = plan(free, time_limit=30)
    limit = float(np.median([max(p.split.memory) for p in first.points if p.split]))
    inputs = _inputs(table, limit=limit)
    got = plan(inputs, time_limit=30)
    cands = [Candidate(s, m) for s in inputs.schedules for m in inputs.microbatches]
    for s, m, k, r in itertools.product(inputs.schedules, inputs.microbatches, inputs.memops, (1, 2)):
        cands.append(Candidate(s, m, 0, k, r))
    brute = _brute(inputs, cands)
    assert got.best.step <= brute + 1e-12  # at least as good as every split the brute force sees that it tries
    screened = {p.candidate for p in got.points}
    assert got.lower_bound <= got.best.step + 1e-12
    assert all(max(p.split.memory) <= limit + 1e-6 for p in got.points if p.split is not None)
    if all(c in screened for c in cands):
        assert got.best.step == pytest.approx(brute, rel=1e-9)
    prove(got.problems[got.best.candidate], got.best.split)  # E402 would raise


def test_path_bound_is_below_every_split():
    rng = np.random.default_rng(5)
    table = random_layer_table(rng, 6)
    for name, params in (("1f1b", {"p": 3, "m": 4}), ("zb-h1", {"p": 2, "m": 4}), ("zb-v", {"p": 2, "m": 4})):
        sched = build(read_source(name), params)
        p = sched.num_ranks
        pb = Problem(sched, compile_schedule(sched).program, table, rng.uniform(0.5, 1.5, p), np.full(p, np.nan))
        steps = [pb.evaluate(b).step for b in _splits(pb.L, pb.S)]
        bound, infeasible = path_bound(pb, rows_of(pb, [pb.uniform()]), max(steps), 12)
        assert not infeasible and bound <= min(steps) + 1e-12


def test_path_bound_proves_no_split_fits_when_a_memory_row_cannot():
    table = random_layer_table(np.random.default_rng(3), 5)
    sched = build(read_source("1f1b"), {"p": 2, "m": 4})
    pb = Problem(sched, compile_schedule(sched).program, table, np.ones(2), np.full(2, 1.0))
    _, infeasible = path_bound(pb, rows_of(pb, [pb.uniform()]), None)
    assert infeasible


@pytest.mark.parametrize("seed", [4, 8])
def test_work_and_layer_bounds_hold_for_every_split_of_every_candidate(seed):
    """Brute force: every split of every candidate steps at least its m's `layer_bound` and the work bound."""
    table = random_layer_table(np.random.default_rng(seed), 5)
    inputs = _inputs(table, speed=(1.0, 0.5), schedules=("1f1b", "zb-h1", "interleaved-1f1b"))
    b = _Builder(inputs)
    floor = universal_bound(inputs)
    for s, m in itertools.product(inputs.schedules, inputs.microbatches):
        pb = b.problem(Candidate(s, m, 2 if s == "interleaved-1f1b" else 0))
        least = min(pb.evaluate(x).step for x in _splits(pb.L, pb.S))
        assert work_bound(inputs) <= floor <= layer_bound(inputs, m, pb.sched.split_backward) <= least + 1e-12


def test_no_fit_names_the_closest_and_how_far_over():
    table = random_layer_table(np.random.default_rng(6), 5)
    with pytest.raises(PipecError) as e:
        plan(_inputs(table, limit=10.0), time_limit=10)
    d = e.value.diagnostics[0]
    assert d.code == "E830"
    assert "no plan fits the memory limits" in d.message and "over its limit of 10 B" in d.message


def test_report_why_and_pareto_and_megatron_layout():
    rng = np.random.default_rng(7)
    rows = random_layer_table(rng, 6)
    table = replace(rows, names=("embed", "b0", "b1", "b2", "b3", "head"))
    got = plan(_inputs(table, schedules=("1f1b", "interleaved-1f1b", "zb-h1")), time_limit=20)
    front = pareto(got.points)
    assert front[0].step == got.best.step
    assert all(a.step <= b.step and a.peak > b.peak for a, b in zip(front, front[1:]))
    w = explain(got.problems[got.best.candidate], got.best.split)
    assert w.step == pytest.approx(got.best.step) and 0 <= w.bubble < 1 and w.imbalance >= 0
    flags, _ = megatron_settings(got, got.problems[got.best.candidate], 8)
    layout = flags.split('--pipeline-model-parallel-layout "')[1].split('"')[0]
    assert layout.startswith("E") and layout.endswith("L")
    assert layout.count("|") == got.problems[got.best.candidate].S - 1


def test_the_synthesized_candidate_is_simulated_and_written_as_a_schedule():
    """pipec.synth's heuristic on the incumbent's stage costs joins the candidates (p <= 8), and its .pipe,
    written by the plan's outputs, builds back to the same orders."""
    from pipec.errors import Source
    from pipec.frontend.load import evaluate_source
    from pipec.planner.outputs import Outputs

    table = random_layer_table(np.random.default_rng(9), 6)
    got = plan(_inputs(table, schedules=("1f1b", "zb-h1")), time_limit=20)
    synth = [p for p in got.points if p.candidate.schedule == "synth"]
    assert len(synth) == 1 and synth[0].split is not None and synth[0].lower_bound <= synth[0].step + 1e-12
    out = Outputs(got, _inputs(table, schedules=("1f1b", "zb-h1")))
    text = out.pipe_text(synth[0])
    sched = evaluate_source(Source("synth.pipe", text), [])
    want = got.problems[synth[0].candidate].sched
    assert all(np.array_equal(a.kind, b.kind) and np.array_equal(a.mb, b.mb) for a, b in zip(sched.ranks, want.ranks))


def test_rank_orders_only_where_the_ranks_differ():
    assert rank_orders((1.0, 1.0, 1.0), (math.nan,) * 3) == [()]
    assert rank_orders((1.0, 1.0, 0.5, 0.5), (math.nan,) * 4) == [(), (3, 2, 1, 0)]  # fastest first: as given
    assert rank_orders((0.5, 1.0, 0.5, 1.0), (math.nan,) * 4) == [(), (3, 2, 1, 0), (1, 3, 0, 2), (2, 0, 3, 1)]
    assert rank_orders((0.5, 1.0), (math.nan,) * 2) == [(), (1, 0)]  # reversed is the fastest first
    assert rank_orders((1.0, 1.0), (8.0, 16.0)) == [(), (1, 0)]  # memory alone differs


def test_a_heavy_last_layer_goes_to_the_fast_rank_by_reordering_the_ranks():
    """Ranks of two speeds, the last layer ten times heavier than the rest: every library schedule here keeps
    the last stage on pipeline rank p - 1, the slow one as given; the plan runs the pipeline on the ranks in
    the other order, at least as fast as every split of every candidate in both orders (brute force),
    while (b) stays on the ranks as given (`pipec partition` does not reorder them)."""
    rng = np.random.default_rng(12)
    t = random_layer_table(rng, 5)
    heavy = replace(t, F=t.F * np.r_[1, 1, 1, 1, 10], B=t.B * np.r_[1, 1, 1, 1, 10], W=t.W * np.r_[1, 1, 1, 1, 10])
    heavy = replace(heavy, full_backward=t.full_backward * np.r_[1, 1, 1, 1, 10])
    inputs = _inputs(heavy, speed=(1.0, 0.5), schedules=("1f1b", "zb-h1"))
    got = plan(inputs, time_limit=30)
    assert got.best.candidate.ranks == (1, 0)
    assert got.problems[got.best.candidate].speed.tolist() == [0.5, 1.0]
    assert got.library is not None and got.library.candidate.ranks == () and got.library.step > got.best.step
    # (b) is refined (or proven by its bound) although it cannot beat the plan: it is a baseline
    assert got.library.refined or got.library.lower_bound >= got.library.step
    lib = [Candidate(s, m) for s in inputs.schedules for m in inputs.microbatches]
    assert got.library.step == pytest.approx(_brute(inputs, lib), rel=1e-9)
    cands = [Candidate(s, m, ranks=o) for s in inputs.schedules for m in inputs.microbatches for o in ((), (1, 0))]
    assert got.best.step <= _brute(inputs, cands) + 1e-12
    assert universal_bound(inputs) <= got.lower_bound <= got.best.step + 1e-12


@pytest.mark.parametrize("seed", [3, 10])
def test_the_bound_on_unscreened_memory_op_variants_is_below_their_every_split(seed):
    """`_variants_bound` (a base's paths without its memory rows) is at most the step of every split, fitting
    or not, of every recompute and offload variant of the base (brute force)."""
    from pipec.planner.search import _variants_bound

    table = random_layer_table(np.random.default_rng(seed), 5)
    free = _inputs(table, schedules=("1f1b", "zb-h1"))
    peaks = [max(_Builder(free).problem(Candidate("1f1b", 4)).evaluate(b).memory) for b in _splits(5, 2)]
    inputs = _inputs(table, limit=float(np.median(peaks)), schedules=("1f1b", "zb-h1"))
    b = _Builder(inputs)
    bases = [Candidate("1f1b", 4), Candidate("zb-h1", 2)]
    for c in bases:
        b.problem(c)
    steps = [
        b.problem(Candidate(c.schedule, c.m, 0, kind, k)).evaluate(x).step
        for c in bases
        for kind in ("recompute", "offload")
        for k in (1, 2)
        for x in _splits(5, 2)
    ]
    bound = _variants_bound(inputs, b, bases, max(steps), math.inf)
    assert 0 < bound <= min(steps) + 1e-12
    assert bound >= min(layer_bound(inputs, c.m, b.problem(c).sched.split_backward) for c in bases) - 1e-12
