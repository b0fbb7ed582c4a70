"""The dry run's witness check: a proposed execution (the lowering's global order) verified against the
rendezvous rules instead of replayed. It must never prove a Program that the replay finds stuck, and
the lowering's own witness must hold for what it compiles (or the fast path is never taken)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipec.driver import build
from pipec.errors import PipecError
from pipec.frontend import library
from pipec.ir.program import RankProgram
from pipec.passes import dryrun
from pipec.passes.deadlock import global_order
from pipec.passes.lower import lower, op_times

CASES = [
    ("1f1b", {"p": 4, "m": 8}),
    ("gpipe", {"p": 3, "m": 5}),
    ("interleaved-1f1b", {"p": 4, "v": 2, "m": 8}),
    ("zb-h1", {"p": 4, "m": 8}),
    ("zb-v", {"p": 4, "m": 8}),
    ("dualpipe-v", {"p": 4, "m": 10}),
]


def _witness(sched) -> np.ndarray:
    """The round of every compute op in the schedule's global order, by op key (what the lowering passes)."""
    return op_times(sched, global_order(sched))


def _compiled(name: str, params: dict):
    sched = build(library.read(name), params)
    return sched, lower(sched)


@pytest.mark.parametrize("name", library.names())
def test_the_lowering_s_witness_proves_every_library_schedule(name):
    """Every library schedule at its defaults takes the fast path, and the replay agrees."""
    sched, prog = _compiled(name, {})
    cols = dryrun._columns(prog)
    assert dryrun._witnessed(cols, _witness(sched)), name
    assert dryrun._rendezvous_replay(prog, cols).completed


def test_a_witness_that_fails_falls_back_to_the_replay_with_its_verdict():
    sched, prog = _compiled("1f1b", {"p": 4, "m": 8})
    backwards = _witness(sched)[::-1].copy()  # rounds that contradict every rank's order
    assert not dryrun._witnessed(dryrun._columns(prog), backwards)
    assert dryrun.dry_run(prog, witness=backwards).completed


def _move(rp: RankProgram, src: int, dst: int) -> RankProgram:
    """The rank's stream with instruction `src` moved to position `dst`, all groups of it undone."""
    order = list(range(len(rp)))
    order.insert(dst, order.pop(src))
    idx = np.asarray(order)
    group = rp.group.copy()
    group[max(src - 1, 0) : src + 1] = False  # src neither binds nor is bound any more
    return RankProgram(rp.op[idx], rp.mb[idx], rp.stage[idx], rp.peer[idx], group[idx])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(CASES), st.data())
def test_a_witness_never_proves_a_program_whose_replay_gets_stuck(case, data):
    """Move one instruction of a compiled Program somewhere else on its rank (many such Programs
    deadlock) and keep the original witness: the witness check may pass only when the replay finishes."""
    sched, prog = _compiled(*case)
    r = data.draw(st.integers(0, prog.num_ranks - 1))
    n = len(prog.ranks[r])
    src, dst = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n - 1))
    ranks = list(prog.ranks)
    ranks[r] = _move(ranks[r], src, dst)
    bad = dataclasses.replace(prog, ranks=tuple(ranks))
    try:
        dryrun.validate(bad)
        dryrun.check_channels(bad)
    except PipecError:
        assume(False)
    cols = dryrun._columns(bad)
    finished = dryrun._rendezvous_replay(bad, cols).completed
    if dryrun._witnessed(cols, _witness(sched)):
        assert finished, (case, r, src, dst)
    assert dryrun.dry_run(bad, witness=_witness(sched)).completed == finished


def _stuck_variants(name: str, params: dict):
    """Programs one move away from a compiled one that pass every static check and still get stuck."""
    sched, prog = _compiled(name, params)
    for r, rp in enumerate(prog.ranks):
        for src in range(len(rp)):
            for dst in range(len(rp)):
                ranks = list(prog.ranks)
                ranks[r] = _move(rp, src, dst)
                bad = dataclasses.replace(prog, ranks=tuple(ranks))
                try:
                    run = dryrun.dry_run(bad)
                except PipecError:
                    continue
                if not run.completed:
                    yield sched, bad, run


def test_the_stuck_ranks_are_reported_alike_with_or_without_a_witness():
    count = 0
    for sched, bad, plain in _stuck_variants("1f1b", {"p": 2, "m": 3}):
        assert not dryrun._witnessed(dryrun._columns(bad), _witness(sched))
        assert dryrun.dry_run(bad, witness=_witness(sched)) == plain
        count += 1
    assert count >= 5  # moves that deadlock under rendezvous sends exist, and each was refused
