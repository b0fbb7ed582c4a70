"""The simulator on stage graphs (issue 42): skip connections, fan-in and fan-out.

An op with several remote inputs waits for all of them; each edge's message travels on its own; a stage's
input from a stage on its own rank is handed over locally. Held against an independent replay written here
from the semantics alone (F(i, v) after F(i, u) for every edge (u, v); B(i, u) after F(i, u) and after
B(i, v) for every edge (u, v); free links but for a fixed `comm` per remote message), against closed forms
computed by hand on tiny cases, against `pipec.ir.rules.dependencies` on the graph (every op starts after all
its inputs), and the event pass against the fast pass. Random DAGs (edges u < v, every stage but the last
with an output) with GPipe-like orders (per rank, all F in stage order, then all B in reverse stage order).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipec.api import load
from pipec.errors import PipecError
from pipec.ir.graph import StageGraph
from pipec.ir.opcodes import ACT_MSG, GRAD_MSG, KIND_OF
from pipec.ir.rules import dependencies
from pipec.ir.schedule import RankOps, Schedule
from pipec.passes.compiler import compile_schedule
from pipec.sim.cost_files import normalize
from pipec.sim.costs import cost_model
from pipec.sim.memory import memory_model, program_memory
from pipec.sim.simulate import simulate

# Two encoders (stages 0-1 and 2-3) fanning into a decoder (stage 4).
TWO_ENCODERS = "edge s -> if s == 1 or s == 3 then 4 else (if s == 0 or s == 2 then s + 1 else -1)"
UNET_EDGES = "edge s -> if s < p - 1 then s + 1 else -1\n    edge s -> if s < p / 2 - 1 then p - 1 - s else -1"
GPIPE_BODY = "for i in 0 .. m { F(i) }  for i in 0 .. m { B(i) }"


def _text(name: str, stages: str, edges: str, body: str, params: str = "p: int = 4, m: int = 4") -> str:
    return (
        f'schedule "{name}" ({params}) {{\n    stages {stages}\n    place s -> s\n    {edges}\n'
        f"    ops F, B\n    rank r {{ {body} }}\n}}\n"
    )


def _load(tmp_path, text: str, **params) -> Schedule:
    path = tmp_path / "g.pipe"
    path.write_text(text)
    return load(str(path), **params)


def _schedule(S: int, edges, placement, m: int) -> Schedule:
    """A schedule over this graph: per rank all F (its stages in order, micro-batches in order), then all B
    (its stages in reverse order)."""
    R = max(placement) + 1
    ranks = []
    for r in range(R):
        mine = [s for s in range(S) if placement[s] == r]
        ops = [(0, i, s) for s in mine for i in range(m)] + [(1, i, s) for s in reversed(mine) for i in range(m)]
        a = np.array(ops, dtype=np.int64).reshape(-1, 3)
        n = len(a)
        ranks.append(RankOps(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), np.zeros(n, np.int64), np.zeros(n, bool)))
    return Schedule(
        name="graph-gpipe",
        params=(("m", m),),
        num_stages=S,
        num_ranks=R,
        num_microbatches=m,
        kinds=("F", "B"),
        placement=tuple(placement),
        ranks=tuple(ranks),
        graph=StageGraph.of(S, edges),
    )


def _replay(sched: Schedule, edges, F, B, comm: float) -> dict[tuple[int, int, int], tuple[float, float]]:
    """Independent of the simulator and of pipec.ir.rules: each rank runs its ops in order, each as soon as
    its rank is free and its inputs are done (+ `comm` when the input's stage is on another rank)."""
    ins = {s: [u for u, v in edges if v == s] for s in range(sched.num_stages)}
    outs = {s: [v for u, v in edges if u == s] for s in range(sched.num_stages)}
    place = sched.placement
    ops = [list(zip(rk.kind.tolist(), rk.mb.tolist(), rk.stage.tolist())) for rk in sched.ranks]
    done: dict[tuple[int, int, int], tuple[float, float]] = {}
    pos, free = [0] * len(ops), [0.0] * len(ops)
    moved = True
    while moved:
        moved = False
        for r, mine in enumerate(ops):
            while pos[r] < len(mine):
                k, i, s = mine[pos[r]]
                needs = [(0, i, u) for u in ins[s]] if k == 0 else [(0, i, s)] + [(1, i, v) for v in outs[s]]
                if any(d not in done for d in needs):
                    break
                ready = max((done[d][1] + (comm if place[d[2]] != r else 0.0) for d in needs), default=0.0)
                start = max(free[r], ready)
                done[(k, i, s)] = (start, start + (F[s] if k == 0 else B[s]))
                free[r] = done[(k, i, s)][1]
                pos[r] += 1
                moved = True
    assert all(p == len(o) for p, o in zip(pos, ops)), "the replay is stuck: not a valid order"
    return done


def _rows(tl) -> dict[tuple[int, int, int], tuple[float, float]]:
    kind = KIND_OF[tl.op]
    return {
        (int(k), int(i), int(s)): (float(a), float(b)) for k, i, s, a, b in zip(kind, tl.mb, tl.stage, tl.start, tl.end)
    }


def _assert_inputs_first(tl, graph: StageGraph, placement, comm: float = 0.0) -> int:
    """Every op starts after every op it needs by pipec.ir.rules on the graph (its remote inputs' `comm`
    later); returns how many (op, input) pairs were checked."""
    kind, S = KIND_OF[tl.op], graph.num_stages
    end = {k: e for k, (_, e) in _rows(tl).items()}
    place = np.asarray(placement)
    checked = 0
    for _, nk, nmb, nst, valid in dependencies(kind, tl.mb, tl.stage, S, False, graph=graph):
        for j in np.flatnonzero(valid).tolist():
            need = (int(nk[j]), int(nmb[j]), int(nst[j]))
            late = comm if place[nst[j]] != place[tl.stage[j]] else 0.0
            assert tl.start[j] >= end[need] + late - 1e-9, (int(kind[j]), int(tl.mb[j]), int(tl.stage[j]), need)
            checked += 1
    return checked


def _same_passes(prog, costs):
    a, b = simulate(prog, costs), simulate(prog, costs, _events=True)
    for x in ("start", "end", "msg_send", "msg_arrival", "msg_bytes"):
        assert np.allclose(getattr(a, x), getattr(b, x), rtol=1e-12, atol=1e-9), x
    return a


# ---------------------------------------------------------------- tiny cases by hand


@pytest.mark.parametrize("m", [1, 2, 4])
def test_two_encoders_gpipe_makespan_by_hand(tmp_path, m):
    """F = 1, full B = 2. The encoders run side by side: F(i) ends at i + 1 on stages 0, 2, at i + 2 on 1, 3,
    at i + 3 on the decoder; its B(i) ends at m + 2 + 2(i + 1), the encoders' B 2 and 4 later: the last at
    3m + 6 = (m + 2)(F + B), where a five-stage chain takes (m + 4)(F + B)."""
    sched = _load(tmp_path, _text("two-encoders", "p", TWO_ENCODERS, GPIPE_BODY, "p: int = 5, m: int = 4"), m=m)
    assert sched.graph.edges == ((0, 1), (1, 4), (2, 3), (3, 4))
    prog = compile_schedule(sched).program
    tl = _same_passes(prog, cost_model(sched))
    assert tl.makespan == 3 * m + 6
    rows = _rows(tl)
    assert rows[(0, m - 1, 4)] == (m + 1, m + 2)  # the decoder's last F: after both encoders' F(m - 1)
    assert rows[(1, 0, 1)][0] == rows[(1, 0, 3)][0] == m + 4  # both encoders take the decoder's gradient at once
    assert _assert_inputs_first(tl, sched.graph, sched.placement) == 2 * m * 4 + m * 5
    assert len(tl.msg_kind) == 2 * 4 * m  # one activation and one gradient per edge and micro-batch


def test_two_encoders_with_comm_by_hand(tmp_path):
    """m = 1 with `comm` c on every message: three F and three B on the critical path, four messages on it:
    3 * 1 + 3 * 2 + 4c."""
    sched = _load(tmp_path, _text("two-encoders", "p", TWO_ENCODERS, GPIPE_BODY, "p: int = 5, m: int = 4"), m=1)
    prog = compile_schedule(sched).program
    tl = _same_passes(prog, cost_model(sched, [normalize({"comm": 0.25})]))
    assert tl.makespan == pytest.approx(9 + 4 * 0.25)
    _assert_inputs_first(tl, sched.graph, sched.placement, comm=0.25)


@pytest.mark.parametrize("p", [4, 6])
def test_unet_1f1b_equals_the_replay_and_its_closed_form(tmp_path, p):
    """U-Net, encoder stage s also feeding decoder stage p - 1 - s, under 1F1B with warm-up p - 1 - r: the
    skips add no depth, so the makespan is the chain's (m + p - 1)(F + B); with `comm` the replay's."""
    warm = "let warm = min(p - 1 - r, m)  for i in 0 .. warm { F(i) }"
    body = f"{warm}  for i in 0 .. m - warm {{ F(i + warm)  B(i) }}  for i in m - warm .. m {{ B(i) }}"
    sched = _load(tmp_path, _text("unet-1f1b", "p", UNET_EDGES, body, "p: int = 4, m: int = 8"), p=p)
    skips = [(s, p - 1 - s) for s in range(p // 2 - 1)]
    assert sched.graph.edges == tuple(sorted([(s, s + 1) for s in range(p - 1)] + skips))
    prog = compile_schedule(sched).program
    tl = _same_passes(prog, cost_model(sched))
    assert tl.makespan == (8 + p - 1) * 3
    F, B = [1.0] * p, [2.0] * p
    for comm in (0.0, 0.5):
        tl = _same_passes(prog, cost_model(sched, [normalize({"comm": comm})]))
        want = _replay(sched, sched.graph.edges, F, B, comm)
        got = _rows(tl)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], abs=1e-9), k
        assert _assert_inputs_first(tl, sched.graph, sched.placement, comm) > 0
        assert len(tl.msg_kind) == 2 * 8 * sched.graph.num_edges


def test_a_fan_out_sends_its_activation_on_every_edge_and_takes_its_gradients_back(tmp_path):
    """Stage 0 of the U-Net feeds 1 and 3: its activation of each micro-batch travels both edges (act_bytes of
    the sender each), and each consumer sends back the gradient of that activation (by default as large);
    B(i, 0) waits for both gradients."""
    sched = _load(tmp_path, _text("unet", "p", UNET_EDGES, GPIPE_BODY), p=4, m=2)
    prog = compile_schedule(sched).program
    costs = cost_model(sched, [normalize({"act_bytes": [100.0, 200.0, 300.0, 0.0], "bandwidth": "800bps"})])
    tl = _same_passes(prog, costs)
    act = tl.msg_kind == ACT_MSG
    from_0 = act & (tl.msg_stage == 0)
    assert sorted(tl.msg_dst[from_0].tolist()) == [1, 1, 3, 3] and (tl.msg_bytes[from_0] == 100).all()
    to_0 = (tl.msg_kind == GRAD_MSG) & (tl.msg_dst == 0)
    assert sorted(tl.msg_stage[to_0].tolist()) == [1, 1, 3, 3] and (tl.msg_bytes[to_0] == 100).all()
    into_2 = (tl.msg_kind == GRAD_MSG) & (tl.msg_dst == 2)  # the gradient of stage 2's output, on edge (2, 3)
    assert (tl.msg_bytes[into_2] == 300).all()
    rows = _rows(tl)
    for i in range(2):
        last = max(tl.msg_arrival[to_0 & (tl.msg_mb == i)])
        assert rows[(1, i, 0)][0] >= last - 1e-9
    _assert_inputs_first(tl, sched.graph, sched.placement)


def test_grad_bytes_given_are_per_sending_stage_on_every_edge(tmp_path):
    sched = _load(tmp_path, _text("unet", "p", UNET_EDGES, GPIPE_BODY), p=4, m=1)
    prog = compile_schedule(sched).program
    doc = {"act_bytes": 8.0, "grad_bytes": [0.0, 10.0, 20.0, 30.0], "bandwidth": "8bps"}
    tl = _same_passes(prog, cost_model(sched, [normalize(doc)]))
    grad = tl.msg_kind == GRAD_MSG
    assert {(int(s), float(b)) for s, b in zip(tl.msg_stage[grad], tl.msg_bytes[grad])} == {(1, 10), (2, 20), (3, 30)}


def test_the_chain_declared_as_edges_simulates_as_the_chain(tmp_path):
    """`edge s -> s + 1` is the chain: a graph Program whose messages are keyed by edge, with the chain's times."""
    warm = "let warm = min(p - 1 - r, m)  for i in 0 .. warm { F(i) }"
    body = f"{warm}  for i in 0 .. m - warm {{ F(i + warm)  B(i) }}  for i in m - warm .. m {{ B(i) }}"
    edge = "edge s -> if s < p - 1 then s + 1 else -1"
    graph = _load(tmp_path, _text("chain", "p", edge, body), p=4, m=6)
    chain = load("1f1b", p=4, m=6)
    doc = [normalize({"comm": 0.1, "act_bytes": 1e5, "bandwidth": "1Gbps", "overhead": 0.01})]
    a = simulate(compile_schedule(graph).program, cost_model(graph, doc))
    b = simulate(compile_schedule(chain).program, cost_model(chain, doc))
    for x in ("rank", "op", "mb", "stage", "start", "end", "msg_send", "msg_arrival", "msg_bytes"):
        assert np.array_equal(getattr(a, x), getattr(b, x)), x


def test_several_edges_between_two_ranks_share_their_channel(tmp_path):
    """Stages 0, 1 on rank 0 and 2, 3 on rank 1, edges 0->2, 1->3 (and the chain's 0->1, 2->3): both
    activations of a micro-batch cross the one channel 0 -> 1, one after the other on its wire."""
    sched = _schedule(4, [(0, 1), (0, 2), (1, 3), (2, 3)], [0, 0, 1, 1], m=2)
    prog = compile_schedule(sched).program
    costs = cost_model(sched, [normalize({"act_bytes": 1.0, "grad_bytes": 1.0, "bandwidth": "8bps"})])
    tl = _same_passes(prog, costs)
    act = np.flatnonzero(tl.msg_kind == ACT_MSG)
    assert len(act) == 4 and (tl.msg_src[act] == 0).all()
    arrivals = np.sort(tl.msg_arrival[act])
    assert (np.diff(arrivals) >= 1 - 1e-9).all()  # one second each on the wire, never two at once
    _assert_inputs_first(tl, sched.graph, sched.placement)


# ---------------------------------------------------------------- random graphs


@st.composite
def graphs(draw):
    """A random stage graph of 2..7 stages (edges u < v, fan-out up to 3, every stage but the last feeding a
    later one), placed on 1..S ranks (every rank holds a stage), with costs per stage."""
    S = draw(st.integers(2, 7))
    edges = set()
    for u in range(S - 1):
        later = list(range(u + 1, S))
        k = draw(st.integers(1, min(3, len(later))))
        edges |= {(u, v) for v in draw(st.lists(st.sampled_from(later), min_size=k, max_size=k, unique=True))}
    if draw(st.booleans()):  # a stage per rank
        placement = list(range(S))
    else:
        R = draw(st.integers(1, S))
        placement = draw(st.lists(st.integers(0, R - 1), min_size=S, max_size=S))
        assume(set(placement) == set(range(R)))
    m = draw(st.integers(1, 4))
    F = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=S, max_size=S))
    B = draw(st.lists(st.sampled_from([1.0, 1.5, 3.0]), min_size=S, max_size=S))
    if draw(st.booleans()):  # the same costs on every stage
        F, B = [F[0]] * S, [B[0]] * S
    comm = draw(st.sampled_from([0.0, 0.25]))
    return S, sorted(edges), placement, m, F, B, comm


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_random_graphs_simulate_as_the_replay(case):
    """Over random DAGs: both passes agree, equal the independent replay op for op, every op starts after all
    its inputs by pipec.ir.rules, and each remote edge carries one activation and one gradient per micro-batch."""
    S, edges, placement, m, F, B, comm = case
    sched = _schedule(S, edges, placement, m)
    try:
        prog = compile_schedule(sched).program
    except PipecError as e:  # a GPipe order over a DAG is always valid: the compiler must take it
        raise AssertionError(f"{edges} on {placement}: {e}") from None
    costs = cost_model(sched, [normalize({"F": F, "B": B, "comm": comm})])
    tl = _same_passes(prog, costs)
    want = _replay(sched, edges, F, B, comm)
    got = _rows(tl)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-9), (k, edges, placement)
    _assert_inputs_first(tl, sched.graph, placement, comm)
    remote = sum(placement[u] != placement[v] for u, v in edges)
    assert len(tl.msg_kind) == 2 * m * remote
    if len(set(placement)) == S and len(set(F)) == len(set(B)) == 1 and comm == 0:
        # one stage per rank, uniform costs: (m + d)(F + B), d the longest path's edges
        depth = [0] * S
        for u, v in edges:
            depth[v] = max(depth[v], depth[u] + 1)
        assert tl.makespan == pytest.approx((m + depth[-1]) * (F[0] + B[0]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(), st.sampled_from([0.0, 0.01]), st.sampled_from([0.0, 4.0]))
def test_random_graphs_both_passes_with_overhead_and_bytes(case, overhead, nbytes):
    """The event pass is the fast pass on graphs with the per-transfer overhead and bytes on the wire too."""
    S, edges, placement, m, F, B, comm = case
    sched = _schedule(S, edges, placement, m)
    prog = compile_schedule(sched).program
    doc = {"F": F, "B": B, "comm": comm, "overhead": overhead, "act_bytes": nbytes, "bandwidth": "16bps"}
    tl = _same_passes(prog, cost_model(sched, [normalize(doc)]))
    _assert_inputs_first(tl, sched.graph, placement, comm)


# ---------------------------------------------------------------- memory


def test_memory_walk_on_a_graph_counts_each_stage_once_per_micro_batch(tmp_path):
    """The walk is per stage: with GPipe each rank holds all m of its stage's activations at its peak, fan-in
    or fan-out alike (received inputs are the receiver's act, a fan-out's output the sender's, counted once),
    and each is freed at its own B, which on a fan-out comes after every consumer's B."""
    sched = _load(tmp_path, _text("two-encoders", "p", TWO_ENCODERS, GPIPE_BODY, "p: int = 5, m: int = 4"), m=3)
    prog = compile_schedule(sched).program
    reports = program_memory(prog, sched)
    assert [r.peak for r in reports] == [3.0] * 5
    assert all(set(r.live_act) == {(i, r.rank) for i in range(3)} for r in reports)
    tl = simulate(prog, cost_model(sched))
    rows = _rows(tl)
    for i in range(3):  # stage 1's B (what frees its act) after the decoder's
        assert rows[(1, i, 1)][0] >= rows[(1, i, 4)][1]
    assert memory_model(sched)["act"].tolist() == [1.0] * 5
