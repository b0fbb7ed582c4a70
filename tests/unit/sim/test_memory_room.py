"""The memory walk's room (`pipec.sim.memory`): every consumer of the memory model equals the walk, memory
ops (RECOMPUTE, OFFLOAD, RELOAD), split backward and token slices included.

- partition: `Problem.memory` of a split (random layer table) equals `rank_memory` of the split's bytes;
- policy: the list scheduler's peaks equal the walk of the orders it derived;
- synth: the solver's cumulative demands (`memory_demands`), placed at a simulated Timeline's times, are
  `pipec.sim.memtime`'s device and host curves at every instant;
- expect: `in_flight(r)` is the count of pairs between F and their last backward piece (memory ops move
  pairs between the pools, never out of them), `peak_memory(r)` the walk's peak.

Plus the issue's "done when" at p=4 m=8 on every library schedule, and `pipec partition --memory-limit`
accepting the 1F1B-recompute split the memory model says fits (the search once counted a recomputed
micro-batch's whole `act` from its F and refused it)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tables import random_layer_table

from pipec.api import load
from pipec.errors import PipecError
from pipec.formats.partition_files import write_json
from pipec.frontend import library
from pipec.ir.opcodes import CODE
from pipec.ir.schedule import Policy, RankOps, Schedule
from pipec.passes.compiler import compile_schedule
from pipec.passes.expect import Metrics, in_flight
from pipec.passes.policy import PolicyStuck, derive, machine
from pipec.sim.costs import cost_model
from pipec.sim.memory import memory_model, rank_memory, walk
from pipec.sim.memtime import memory_curves
from pipec.sim.simulate import simulate
from pipec.synth import memory_demands

LIBRARY = library.names()  # every schedule of the standard library
MEMOPS = ("1f1b-recompute", "1f1b-offload", "zb-v-recompute")
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _load(name: str, p: int, m: int, n: int = 2) -> Schedule:
    return load(name, p=p, m=m, **({"n": n} if name == "terapipe" else {}))


def _drawn(name: str, p: int, m: int) -> Schedule:
    """A drawn library schedule; sizes its own `require`s refuse (E202) are not drawn."""
    try:
        return _load(name, p, m)
    except PipecError as e:
        assume(e.code != "E202")
        raise


def _sized(sched: Schedule, rng: np.random.Generator) -> Schedule:
    """The schedule with random per-stage memory sizes as its declarations (units)."""
    S = sched.num_stages
    mem = {k: tuple(float(x) for x in rng.integers(1, 20, S) / 4) for k in ("act", "wact", "ckpt", "params")}
    return dataclasses.replace(sched, memory=mem)


# ---- partition ---------------------------------------------------------------------------------------


def _partition_agrees(sched: Schedule, rng: np.random.Generator, splits: int = 3) -> None:
    from pipec.partition.problem import Problem

    pb = Problem(
        sched,
        compile_schedule(sched).program,
        random_layer_table(rng, sched.num_stages + int(rng.integers(0, 5))),
        np.ones(sched.num_ranks),
        np.full(sched.num_ranks, np.nan),
    )
    for j in range(splits):
        cuts = sorted(rng.choice(np.arange(1, pb.L), pb.S - 1, replace=False).tolist())
        bounds = pb.uniform() if j == 0 else (0, *cuts, pb.L)
        want = [r.peak for r in rank_memory(pb.memory_schedule(bounds))]
        assert np.allclose(pb.memory(bounds), want, rtol=1e-12, atol=1e-6), (sched.name, bounds)


@SETTINGS
@given(name=st.sampled_from(LIBRARY), p=st.integers(2, 4), extra=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_partition_memory_is_the_walk(name, p, extra, seed):
    _partition_agrees(_drawn(name, p, p + extra), np.random.default_rng(seed))


def test_partition_memory_rows_hold_the_walk():
    """The branch and bound's memory rows (`Problem.memory_rows`) let through every split that fits and only
    those (exact rows without slices), on the memory-op schedules."""
    from pipec.partition.problem import Problem

    rng = np.random.default_rng(11)
    for name in MEMOPS:
        sched = _load(name, 3 if name != "zb-v-recompute" else 2, 4)
        table = random_layer_table(rng, sched.num_stages + 3)
        none = np.full(sched.num_ranks, np.nan)
        pb0 = Problem(sched, compile_schedule(sched).program, table, np.ones(sched.num_ranks), none)
        splits = [(0, *c, pb0.L) for c in itertools.combinations(range(1, pb0.L), pb0.S - 1)]
        limit = float(np.median([pb0.memory(b).max() for b in splits]))
        pb = Problem(sched, pb0.program, table, np.ones(sched.num_ranks), np.full(sched.num_ranks, limit))
        for b in splits:
            rows_ok = all(
                sum(int(wq[s, b[s + 1]] - wq[s, b[s]]) for s in range(pb.S)) <= lim
                for r in range(pb.R)
                for wq, lim in pb.memory_rows(r)
            )
            assert rows_ok == bool((pb.memory(b) <= limit + 1e-9).all()), (name, b)


def _without_memops(pb, bounds) -> float:
    """The largest per-rank peak when every F holds its stage's whole act until its B: the count the search
    made before it read the walk (memory ops ignored)."""
    b = pb.stage_bytes(bounds)
    worst = 0.0
    for r, ops in enumerate(pb.sched.ranks):
        live, peak = 0.0, 0.0
        for k, s in zip(ops.kind.tolist(), ops.stage.tolist()):
            live += b["act"][s] if k == 0 else -b["act"][s]
            peak = max(peak, live)
        worst = max(worst, peak + sum(b["params"][s] for s in pb.sched.stages_of(r)))
    return worst


def test_partition_accepts_the_recompute_split_that_fits(tmp_path, capsys):
    """`pipec partition 1f1b-recompute -D p=3 -D m=4 --memory-limit L` with L the least peak any split has
    under the memory model (below what counting whole activations from each F gives): it answers a split
    within L whose memory is the model's, and refuses L - 1 with E806."""
    pytest.importorskip("ortools")
    from pipec.cli.app import main
    from pipec.partition.problem import Problem

    rng = np.random.default_rng(27)
    table = random_layer_table(rng, 7)
    sched = _load("1f1b-recompute", 3, 4)
    pb = Problem(sched, compile_schedule(sched).program, table, np.ones(3), np.full(3, np.nan))
    splits = [(0, *c, pb.L) for c in itertools.combinations(range(1, pb.L), pb.S - 1)]
    least = min(splits, key=lambda b: pb.memory(b).max())
    fit = int(np.ceil(max(r.peak for r in rank_memory(pb.memory_schedule(least)))))  # the memory model's peak
    assert _without_memops(pb, least) > fit  # what the search once counted: it refused every split
    layers = str(tmp_path / "layers.json")
    write_json(layers, table.to_json())
    args = ["partition", "1f1b-recompute", "-D", "p=3", "-D", "m=4", "--layers-cost", layers, "--time-limit", "5"]
    assert main([*args, "--json", "--memory-limit", str(fit)]) == 0
    doc = json.loads(capsys.readouterr().out)
    sizes = doc["predicted"]["layers_per_stage"]
    bounds = tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)]))
    model = [r.peak for r in rank_memory(pb.memory_schedule(bounds))]
    assert max(model) <= fit and np.allclose(doc["predicted"]["memory"], model)
    assert main([*args, "--memory-limit", str(fit - 1)]) != 0
    assert "E806" in capsys.readouterr().err


# ---- policy ------------------------------------------------------------------------------------------


def _policy_agrees(sched: Schedule, rng: np.random.Generator) -> None:
    sched = _sized(dataclasses.replace(sched, memops=tuple(() for _ in sched.ranks)), rng)
    model = memory_model(sched)
    mc = machine(sched, cost_model(sched), model)
    kinds = ["B", "F", "W"] if sched.split_backward else ["B", "F"]
    rng.shuffle(kinds)
    pol = Policy(prefer=tuple(kinds), inflight=tuple(float(x) for x in rng.integers(1, 6, sched.num_ranks)))
    try:
        d = derive(mc, pol)
    except PolicyStuck:
        return
    ranks = []
    for order in d.orders:
        a = np.asarray(order, dtype=np.int64).reshape(-1, 3)
        z = np.zeros(len(a), np.int64)
        ranks.append(RankOps(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), z, np.zeros(len(a), bool)))
    derived = dataclasses.replace(sched, ranks=tuple(ranks), spans=())
    assert np.allclose(d.peak, [w.peak for w in walk(derived, model)], rtol=1e-12, atol=1e-9), sched.name


@SETTINGS
@given(name=st.sampled_from([n for n in LIBRARY if n != "terapipe"]), p=st.integers(2, 4), seed=st.integers(0, 2**16))
def test_policy_memory_is_the_walk(name, p, seed):
    _policy_agrees(_drawn(name, p, p + 2), np.random.default_rng(seed))


# ---- synth -------------------------------------------------------------------------------------------


def _synth_agrees(sched: Schedule, rng: np.random.Generator) -> None:
    """memory_demands of every pair, at the simulated times of its instructions, sum to memtime's curves."""
    sched = _sized(sched, rng)
    prog = compile_schedule(sched).program
    tl = simulate(prog, cost_model(sched))
    model = memory_model(sched)
    curves = memory_curves(tl, prog, model)
    when: dict[tuple[int, int, str, str], float] = {}
    for op, i, s, a, b in zip(tl.op.tolist(), tl.mb.tolist(), tl.stage.tolist(), tl.start.tolist(), tl.end.tolist()):
        name = next(n for n, c in CODE.items() if c == op)
        when[i, s, name, "start"], when[i, s, name, "end"] = a, b
    h_rank = getattr(tl, "host_rank", np.zeros(0))
    for k in range(len(h_rank)):
        name = next(n for n, c in CODE.items() if c == int(tl.host_op[k]))
        i, s = int(tl.host_mb[k]), int(tl.host_stage[k])
        when[i, s, name, "start"], when[i, s, name, "end"] = float(tl.host_start[k]), float(tl.host_end[k])
    variant = {}
    for rank in sched.memops:
        for x in rank:
            if x.op in ("RECOMPUTE", "OFFLOAD"):
                variant[x.mb, x.stage] = x.op
    holds: list[list[tuple[str, float, float, float]]] = [[] for _ in range(sched.num_ranks)]
    for s, r in enumerate(sched.placement):
        for i in range(sched.num_microbatches):
            v = variant.get((i, s))
            for hold, _ in memory_demands(model, s, i, sched.split_backward, (v,)):
                a, e = when[i, s, *hold.since], when[i, s, *hold.until]
                holds[r].append((hold.pool, hold.amount, a, e))  # (token shares: the model's unit_share)
    for r in range(sched.num_ranks):
        base = float(np.asarray(model["params"])[list(sched.stages_of(r))].sum())
        for pool, (times, values), b in (("device", curves.device[r], base), ("host", curves.host[r], 0.0)):
            for t in np.unique([x[2] for x in holds[r]] + [x[3] for x in holds[r]]):
                at = values[np.searchsorted(times, t, side="right") - 1] if len(times) else b
                mine = sum(x[1] for x in holds[r] if x[0] == pool and x[2] <= t < x[3])
                assert np.isclose(at - b, mine, rtol=1e-9, atol=1e-9), (sched.name, r, pool, t, at - b, mine)


@SETTINGS
@given(name=st.sampled_from(LIBRARY), p=st.integers(2, 4), extra=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_synth_demands_are_the_walk(name, p, extra, seed):
    _synth_agrees(_drawn(name, p, p + extra), np.random.default_rng(seed))


# ---- expect ------------------------------------------------------------------------------------------


def _count(sched: Schedule, r: int) -> int:
    """The pairs between F and their last backward piece, from the ops alone (memory ops move pairs between
    the pools, never out of them)."""
    ops = sched.ranks[r]
    last = 2 if sched.split_backward else 1
    delta = np.where(ops.kind == 0, 1, np.where(ops.kind == last, -1, 0))
    return int(max(np.cumsum(delta).max(initial=0), 0))


def _expect_agrees(sched: Schedule) -> None:
    metrics = Metrics(sched)
    peaks = [w.peak for w in walk(sched, memory_model(sched))]
    for r in range(sched.num_ranks):
        assert in_flight(sched, r) == _count(sched, r), (sched.name, r)
        assert metrics.peak_memory(r) == pytest.approx(peaks[r], abs=1e-12)


@SETTINGS
@given(name=st.sampled_from(LIBRARY), p=st.integers(2, 5), extra=st.integers(0, 4))
def test_expect_reads_the_walk(name, p, extra):
    _expect_agrees(_drawn(name, p, p + extra))


# ---- done when: every library schedule at p=4 m=8 --------------------------------------------------------


@pytest.mark.parametrize("name", LIBRARY)
def test_every_consumer_agrees_at_p4_m8(name):
    sched = _load(name, 4, 8, n=4)
    rng = np.random.default_rng(sum(map(ord, name)))
    _partition_agrees(sched, rng, splits=2)
    _synth_agrees(sched, rng)
    _expect_agrees(sched)
    if sched.slicing is None or sched.slicing.slices == 1:  # an `order` block derives no token slices yet
        _policy_agrees(sched, rng)


def _one_rank_curve(times, delta, base):
    """The curve of one rank as memory_curves defined it before it took all ranks at once: by time, at one
    instant in instruction order, from (0, base); its peak; then collapsed to the last value at each
    instant and to the points where the value moves."""
    o = np.lexsort((np.arange(len(times)), times))
    t = np.concatenate([[0.0], times[o]])
    v = base + np.concatenate([[0.0], np.cumsum(delta[o])])
    peak = v.max()
    if len(t) > 1:
        last = np.append(t[1:] != t[:-1], True)
        t, v = t[last], v[last]
        moved = np.concatenate(([True], v[1:] != v[:-1]))
        t, v = t[moved], v[moved]
    return t, v, peak


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(st.sampled_from([0.0, 0.5, 1.0, 1.5, 3.0]), st.sampled_from([-2.0, -1.0, 0.0, 1.0, 0.125, 2.0]))
        ),
        min_size=1,
        max_size=5,
    )
)
def test_the_curves_of_all_ranks_at_once_are_each_ranks_own_exactly(ranks):
    from pipec.sim.memtime import _curves

    times = [np.array([t for t, _ in r], dtype=float) for r in ranks]
    deltas = [np.array([d for _, d in r], dtype=float) for r in ranks]
    bases = np.arange(len(ranks), dtype=float) * 0.3
    curves, peaks = _curves(times, deltas, bases)
    for r in range(len(ranks)):
        t, v, peak = _one_rank_curve(times[r], deltas[r], bases[r])
        assert curves[r][0].tolist() == t.tolist() and curves[r][1].tolist() == v.tolist()
        assert peaks[r] == peak
