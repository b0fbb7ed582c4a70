"""The dependency rule's room (`pipec.ir.rules`): the rule it derives from the opcode table is DESIGN.md's (as
the testing kit's independent oracle, `pipec.testing.listing.deps`, writes it), and every consumer orders ops
by it: the checks (E304), the deadlock rounds, the list scheduler, the partition graph, the dry run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import library_schedules

from pipec.errors import PipecError
from pipec.ir.rules import RULES, active, dependencies, feeds, needs
from pipec.ir.schedule import RankOps, Schedule
from pipec.passes import dryrun
from pipec.passes.checks import check_schedule
from pipec.passes.compiler import compile_schedule
from pipec.passes.deadlock import global_order
from pipec.testing.listing import deps as oracle

KINDS = ("F", "B", "W")
LIBRARY = (
    "1f1b",
    "gpipe",
    "zb-h1",
    "zb-h2",
    "zb-v",
    "interleaved-1f1b",
    "terapipe",
    "1f1b-recompute",
    "1f1b-offload",
    "zb-v-recompute",
    "v-half",
    "looped-bfs",
)


def library() -> st.SearchStrategy[Schedule]:
    """A library schedule: sliced (terapipe), with memory ops, split backward, V and looped placements."""
    return library_schedules(LIBRARY)


def _ops(sched: Schedule):
    """Every op as (kind, unit, stage) -> (rank, position)."""
    return {
        (k, i, s): (r, j)
        for r, ops in enumerate(sched.ranks)
        for j, (k, i, s) in enumerate(zip(ops.kind.tolist(), ops.mb.tolist(), ops.stage.tolist()))
    }


@given(
    st.sampled_from([0, 1, 2]),
    st.integers(0, 40),
    st.integers(1, 6),
    st.data(),
    st.booleans(),
    st.sampled_from([1, 2, 3, 5]),
)
def test_the_rule_is_the_oracles(k, u, S, data, split, slices):
    s = data.draw(st.integers(0, S - 1))
    kinds = 3 if split else 2
    assume(k < kinds)
    rules = active(kinds, slices)
    got = needs(k, u, s, S, rules, slices)
    want = [(KINDS.index(a), i, t) for a, i, t in oracle(KINDS[k], u, s, S, split, slices)]
    assert sorted(got) == sorted(want)
    for op in got:  # feeds is needs turned round
        assert (k, u, s) in [x for _, x in feeds(*op, S, rules, slices)]
    # the vectorised form says the same
    one = np.array([k])
    vec = [
        (int(dk[0]), int(dm[0]), int(ds[0]))
        for _, dk, dm, ds, ok in dependencies(one, np.array([u]), np.array([s]), S, split, slices)
        if ok[0]
    ]
    assert sorted(vec) == sorted(got)


def test_rules_come_from_the_table():
    # F <- F(s-1) by the activation, B <- F and B(s+1) by the gradient, W <- B; two slice rules.
    assert [(r.kind, r.needs, r.stage, r.unit) for r in RULES] == [
        (0, 0, -1, 0),
        (1, 0, 0, 0),
        (1, 1, 1, 0),
        (2, 1, 0, 0),
        (0, 0, 0, -1),
        (1, 1, 0, 1),
    ]
    assert all(r.why for r in RULES if r.is_slice)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(library(), st.data())
def test_checks_reject_exactly_a_broken_rule(sched, data):
    """Moving an op to just before an input of it on its rank is E304 (the checks hold the rule), and the
    moved op's input is one the oracle names."""
    where = _ops(sched)
    n = sched.slicing.slices if sched.slicing else 1
    local = [
        (op, dep)
        for op, (r, j) in where.items()
        for dep in oracle(KINDS[op[0]], op[1], op[2], sched.num_stages, sched.split_backward, n)
        if (d := where[(KINDS.index(dep[0]), dep[1], dep[2])])[0] == r and d[1] < j
    ]
    assume(local and not any(r.paired.any() for r in sched.ranks) and not any(sched.memops))
    op, dep = data.draw(st.sampled_from(local))
    r, j = where[op]
    d = where[(KINDS.index(dep[0]), dep[1], dep[2])][1]
    ops = sched.ranks[r]
    order = list(range(len(ops)))
    order.insert(d, order.pop(j))
    moved = RankOps(*(np.asarray(a)[order] for a in (ops.kind, ops.mb, ops.stage, ops.sid, ops.paired)))
    bad = dataclasses.replace(sched, ranks=tuple(moved if x == r else o for x, o in enumerate(sched.ranks)))
    with pytest.raises(PipecError) as e:
        check_schedule(bad)
    assert e.value.code == "E304"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(library())
def test_consumers_order_by_the_rule(sched):
    """The deadlock rounds' global order, the partition graph's data predecessors and the dry run's inputs
    are the oracle's."""
    from pipec.partition.graph import _Graph
    from pipec.sim.costs import cost_model

    S, n = sched.num_stages, (sched.slicing.slices if sched.slicing else 1)
    where = _ops(sched)
    times = global_order(sched)
    graph = _Graph(sched, cost_model(sched), 1.0)
    ident = {op: v for v, op in enumerate(op for op in _flat(sched))}
    for op, (r, j) in where.items():
        inputs = [(KINDS.index(a), i, s) for a, i, s in oracle(KINDS[op[0]], op[1], op[2], S, sched.split_backward, n)]
        for dep in inputs:  # the rounds run every input first
            rd, jd = where[dep]
            assert times[rd][jd] < times[r][j]
        remote = [ident[dep] for dep in inputs if where[dep][0] != r]
        assert graph.data_pred[ident[op]] == (remote[0] if remote else -1)  # at most one: the table's `needs`

    prog = compile_schedule(sched).program
    cols = dryrun._columns(prog)
    assert dryrun.dry_run(prog).completed
    # The dry run's remote inputs: a compute waits for the message of its input from another rank.
    m = prog.num_microbatches
    placement = np.asarray(prog.placement)
    from pipec.ir.opcodes import KIND_OF, PRODUCER_KIND

    op = np.concatenate([rp.op for rp in prog.ranks])
    kind = KIND_OF[op]
    for g in np.flatnonzero(kind >= 0).tolist():
        k, i, s, r = int(kind[g]), int(cols.own[g] % m), int(cols.own[g] // m % S), int(cols.rank[g])
        inputs = [(KINDS.index(a), u, t) for a, u, t in oracle(KINDS[k], i, s, S, sched.split_backward, n)]
        remote = [(a, u, t) for a, u, t in inputs if placement[t] != r]
        if remote:
            a, u, t = remote[0]
            msg = int(np.flatnonzero(PRODUCER_KIND == a)[0])
            assert cols.msg[g] == (msg * S + t) * m + u
        else:
            assert cols.recv[g] == -1


def _flat(sched: Schedule):
    for ops in sched.ranks:
        yield from zip(ops.kind.tolist(), ops.mb.tolist(), ops.stage.tolist())
