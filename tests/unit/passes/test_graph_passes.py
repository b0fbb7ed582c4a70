"""Stage graphs through the compiler (issue 42): `edge` declarations, the rules on a graph (E304), deadlock
rounds with several remote inputs (E401), the lowering's transfer per remote edge, and the dry run's proof
of a fan-in (every input awaited, E403) and of each channel's order (E404).

The oracle here is independent of pipec.ir.rules: it restates "F(i, v) needs F(i, u) for every edge (u, v);
B(i, u) needs B(i, v) for every edge (u, v)" over the Program's instructions directly.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from graphs import edge_decls
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipec.driver import build
from pipec.errors import PipecError, Source
from pipec.ir.graph import StageGraph
from pipec.ir.program import RankProgram
from pipec.passes.compiler import compile_schedule
from pipec.passes.dryrun import dry_run

ONE_F_ONE_B = """
    ops F, B
    rank r {
        let warm = min(p - 1 - r, m)
        for i in 0 .. warm      { F(i) }
        for i in 0 .. m - warm  { F(i + warm)  B(i) }
        for i in m - warm .. m  { B(i) }
    }
"""

UNET = (
    """schedule "unet" (p: int = 4, m: int = 4) {
    stages p
    place s -> s
    edge s -> if s < p - 1 then s + 1 else -1
    edge s -> if s < p / 2 - 1 then p - 1 - s else -1
"""
    + ONE_F_ONE_B
    + "}\n"
)

# Two encoders (stages 0-1 on ranks 0-1, stages 2-3 on ranks 2-3) fan into a decoder (stage 4, rank 4);
# each encoder runs its micro-batches on its own ranks, in parallel with the other.
TWO_ENCODERS = """schedule "two-encoders" (m: int = 4) {
    stages 5
    ranks 5
    place s -> s
    edge s -> if s == 0 or s == 2 then s + 1 else (if s == 1 or s == 3 then 4 else -1)
    ops F, B
    rank r {
        for i in 0 .. m { F(i) }
        for i in 0 .. m { B(i) }
    }
}
"""


def _compile(text: str, **params):
    return compile_schedule(build(Source("g.pipe", text), {k: str(v) for k, v in params.items()})).program


_DOWNSTREAM = {"SEND_ACT": True, "RECV_GRAD": True, "RECV_ACT": False, "SEND_GRAD": False}


def _other(ins) -> int:
    """A transfer's stage at the other end: its own column, or on a chain Program the neighbour."""
    if ins.other >= 0:
        return ins.other
    return ins.stage + 1 if _DOWNSTREAM[ins.op] else ins.stage - 1


def _message_edges(prog):
    """Every transfer as (message, mb, edge (u, v), side), read from the Program's columns (no rules)."""
    out = []
    for rp in prog.ranks:
        for ins in rp.instructions():
            if ins.op in _DOWNSTREAM:
                edge = (ins.stage, _other(ins)) if _DOWNSTREAM[ins.op] else (_other(ins), ins.stage)
                out.append((ins.op[-3:], ins.mb, edge, ins.op[:4]))
    return out


def _oracle_order(prog) -> None:
    """On each rank, a compute comes after the receive of every remote input and after every local input."""
    g, place = prog.graph, prog.placement
    done: set = set()
    for r, rp in enumerate(prog.ranks):
        for ins in rp.instructions():
            if ins.op.startswith("RECV"):
                done.add((ins.op, ins.mb, ins.stage, _other(ins)))
            elif ins.op in ("FWD", "BWD"):
                kind = "F" if ins.op == "FWD" else "B"
                ins_of = g.inputs(ins.stage) if kind == "F" else g.outputs(ins.stage)
                for t in ins_of:
                    if place[t] == r:
                        assert (kind, ins.mb, t) in done, f"rank {r}: {ins} before its input {kind}({ins.mb}, {t})"
                    else:
                        recv = "RECV_ACT" if kind == "F" else "RECV_GRAD"
                        assert (recv, ins.mb, ins.stage, t) in done, f"rank {r}: {ins} before its input from {t}"
                done.add((kind, ins.mb, ins.stage))


def test_unet_compiles_with_a_transfer_per_remote_edge():
    prog = _compile(UNET, p=6, m=4)
    assert prog.graph is not None and set(prog.graph.edges) == {(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (0, 5), (1, 4)}
    msgs = _message_edges(prog)
    for kind in ("ACT", "RAD"):
        for side in ("SEND", "RECV"):
            got = sorted((mb, e) for k, mb, e, sd in msgs if k == kind and sd == side)
            assert got == sorted((i, e) for i in range(4) for e in prog.graph.edges), (kind, side)
    _oracle_order(prog)


def test_two_encoders_run_in_parallel_and_fan_in():
    prog = _compile(TWO_ENCODERS, m=3)
    assert prog.graph.inputs(4) == (1, 3)
    _oracle_order(prog)
    # The decoder's first forward waits for both encoders: both its receives come before it.
    dec = [str(i) for i in prog.ranks[4].instructions()]
    assert dec.index("RECV_ACT 0 4 1 1") < dec.index("FWD 0 4") and dec.index("RECV_ACT 0 4 3 3") < dec.index("FWD 0 4")
    # Neither encoder waits on the other: their ranks exchange nothing.
    for r in (0, 1):
        assert not {ins.peer for ins in prog.ranks[r].instructions()} & {2, 3}


def test_a_chain_declared_as_edges_is_the_chain():
    text = UNET.replace("    edge s -> if s < p / 2 - 1 then p - 1 - s else -1\n", "")
    chain = _compile(text.replace("    edge s -> if s < p - 1 then s + 1 else -1\n", ""), p=4, m=4)
    declared = _compile(text, p=4, m=4)
    assert declared.graph is None and declared == chain


@pytest.mark.parametrize(
    ("edge", "says"),
    [
        ("edge s -> if s == 2 then 1 else s + 1", "goes back"),
        ("edge s -> if s < 3 then s + 1 else 9", "outside 0..3"),
        ("edge s -> if s == 1 then -1 else (if s < 3 then s + 1 else -1)", "stage 1 has no outputs"),
    ],
)
def test_bad_edges_are_e216_at_the_declaration(edge, says):
    text = f'schedule "g" (p: int = 4, m: int = 2) {{\n    stages p\n    {edge}\n' + ONE_F_ONE_B + "}\n"
    with pytest.raises(PipecError) as e:
        _compile(text)
    d = e.value.diagnostics[0]
    assert d.code == "E216" and says in d.message and d.span.line == 3


def test_an_edge_declared_twice_is_e216():
    text = (
        'schedule "g" (p: int = 3, m: int = 2) {\n    stages p\n    edge s -> if s < 2 then s + 1 else -1\n'
        "    edge s -> if s == 0 then 1 else (if s == 1 then 2 else -1)\n" + ONE_F_ONE_B + "}\n"
    )
    with pytest.raises(PipecError) as e:
        _compile(text)
    assert e.value.code == "E216" and "declared twice" in str(e.value) and e.value.diagnostics[0].span.line == 4


def test_a_skip_input_out_of_order_on_one_rank_is_e304():
    text = """schedule "g" (m: int = 1) {
    stages 4
    ranks 1
    place s -> 0
    edge s -> if s < 3 then s + 1 else -1
    edge s -> if s == 0 then 3 else -1
    ops F, B
    rank r {
        for i in 0 .. m { F(i, stage: 0) F(i, stage: 1) F(i, stage: 3) F(i, stage: 2) }
        for i in 0 .. m { B(i, stage: 3) B(i, stage: 2) B(i, stage: 1) B(i, stage: 0) }
    }
}
"""
    with pytest.raises(PipecError) as e:
        _compile(text)
    assert e.value.code == "E304" and "F(0, stage 3) on rank 0 needs F(0, stage 2)" in str(e.value)


def test_a_fan_in_wait_cycle_is_e401_through_the_second_input():
    # Stage 2 (rank 2) reads stages 0 and 1. Rank 1 runs micro-batch 1 first, and its B(1, 1) needs the
    # gradient rank 2 sends only after F(0, 2), which waits for F(0, 1): a cycle through the second input.
    text = """schedule "g" (m: int = 2) {
    stages 3
    ranks 3
    place s -> s
    edge s -> if s < 2 then 2 else -1
    ops F, B
    rank r {
        if r == 1 { F(1) B(1) F(0) B(0) }
        else { for i in 0 .. m { F(i) }  for i in 0 .. m { B(i) } }
    }
}
"""
    with pytest.raises(PipecError) as e:
        _compile(text)
    assert e.value.code == "E401" and "ranks" in str(e.value)
    assert "from rank 1" in str(e.value) and "from rank 2" in str(e.value)


def _move(rp: RankProgram, src: int, dst: int) -> RankProgram:
    order = list(range(len(rp)))
    order.insert(dst, order.pop(src))
    idx = np.asarray(order)
    return RankProgram(rp.op[idx], rp.mb[idx], rp.stage[idx], rp.peer[idx], rp.group[idx] & False, rp.other[idx])


def test_the_dry_run_awaits_every_input_of_a_fan_in():
    prog = _compile(TWO_ENCODERS, m=1)
    dec = [str(i) for i in prog.ranks[4].instructions()]
    # Move the receive of the second encoder's activation after the decoder's forward that needs it.
    src, fwd = dec.index("RECV_ACT 0 4 3 3"), dec.index("FWD 0 4")
    bad = replace(prog, ranks=(*prog.ranks[:4], _move(prog.ranks[4], src, fwd)))
    run = dry_run(bad)
    assert not run.completed
    assert any(w.rank == 4 and "edge 3 -> 4" in w.what for w in run.waits), [w.describe() for w in run.waits]


def test_swapped_messages_on_a_shared_channel_are_e404_naming_the_edges():
    # U-Net p=4 on 2 ranks: stages 0, 3 on rank 0 and 1, 2 on rank 1; edges 0->1 and 2->3 share the pair.
    text = UNET.replace("place s -> s", "ranks 2\n    place s -> if s == 0 or s == 3 then 0 else 1")
    text = text.replace(
        ONE_F_ONE_B,
        """
    ops F, B
    rank r {
        if r == 0 {
            for i in 0 .. m { F(i, stage: 0) }
            for i in 0 .. m { F(i, stage: 3)  B(i, stage: 3) }
            for i in 0 .. m { B(i, stage: 0) }
        } else {
            for i in 0 .. m { F(i, stage: 1)  F(i, stage: 2) }
            for i in 0 .. m { B(i, stage: 2)  B(i, stage: 1) }
        }
    }
""",
    )
    prog = _compile(text, p=4, m=2)
    r0 = [str(i) for i in prog.ranks[0].instructions()]
    a = next(j for j, x in enumerate(r0) if x.startswith("SEND_ACT 0 0 1 1"))
    b = next(j for j, x in enumerate(r0) if x.startswith("SEND_ACT 1 0 1 1"))
    bad = replace(prog, ranks=(_move(prog.ranks[0], b, a), prog.ranks[1]))
    with pytest.raises(PipecError) as e:
        dry_run(bad)
    assert e.value.code == "E404" and "`SEND_ACT 1 0 1 1` (edge 0 -> 1)" in str(e.value)


@st.composite
def _dags(draw):
    S = draw(st.integers(2, 6))
    edges = set()
    for u in range(S - 1):
        outs = draw(st.sets(st.integers(u + 1, S - 1), min_size=1, max_size=min(3, S - 1 - u)))
        edges |= {(u, v) for v in outs}
    p = draw(st.integers(1, S))
    place = [draw(st.integers(0, p - 1)) for _ in range(S)]
    for r in range(p):  # every rank owns a stage
        if r not in place:
            place[draw(st.integers(0, S - 1))] = r
    if set(place) != set(range(p)):
        p = len(set(place))
        ranks = sorted(set(place))
        place = [ranks.index(x) for x in place]
    m = draw(st.integers(1, 3))
    return S, sorted(edges), p, place, m


def _schedule_text(S, edges, p, place, m) -> str:
    """A GPipe order on any graph and placement: one global order (every F by micro-batch then stage, every
    B by micro-batch then stage downwards), each rank its projection."""
    order = [("F", i, s) for i in range(m) for s in range(S)] + [
        ("B", i, s) for i in range(m) for s in range(S - 1, -1, -1)
    ]
    blocks = []
    for r in range(p):
        ops = " ".join(f"{k}({i}, stage: {s})" for k, i, s in order if place[s] == r)
        blocks.append(f"if r == {r} {{ {ops} }}")
    place_expr = "0"
    for s in range(S - 1, -1, -1):
        place_expr = f"(if s == {s} then {place[s]} else {place_expr})"
    return (
        f'schedule "dag" (m: int = {m}) {{\n    stages {S}\n    ranks {p}\n    place s -> {place_expr}\n'
        + edge_decls(S, edges)
        + "    ops F, B\n    rank r {\n        "
        + "\n        ".join(blocks)
        + "\n    }\n}\n"
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_dags())
def test_any_graph_and_placement_compiles_and_is_proven(case):
    S, edges, p, place, m = case
    prog = _compile(_schedule_text(S, edges, p, place, m))
    graph = prog.graph if prog.graph is not None else StageGraph.chain(S)
    assert graph.edges == tuple(edges)
    _oracle_order(replace(prog, graph=graph))
    remote = [(u, v) for u, v in edges if place[u] != place[v]]
    assert len(_message_edges(prog)) == 4 * m * len(remote)
    assert dry_run(prog).completed


def test_stages_names_the_stage_count_after_its_declaration():
    """docs/language.md section 19 writes the chain as `edge s -> if s < stages - 1 then s + 1 else -1`: after a
    `stages` declaration the name is its count, so that edge gives the same graph as `p - 1` at p = stages."""
    body = "    edge s -> if s < {n} - 1 then s + 1 else -1\n    edge s -> if s == 0 then {n} - 1 else -1\n"
    head = 'schedule "g" (p: int = 4, m: int = 4) {\n    stages p\n'
    by_name = _compile(head + body.format(n="stages") + ONE_F_ONE_B + "}\n")
    by_param = _compile(head + body.format(n="p") + ONE_F_ONE_B + "}\n")
    assert by_name.graph is not None and by_name.graph.edges == by_param.graph.edges
    assert (0, 3) in by_name.graph.edges
    before = 'schedule "g" (p: int = 4, m: int = 4) {\n    place s -> s % stages\n    stages p\n' + ONE_F_ONE_B + "}\n"
    with pytest.raises(PipecError) as e:
        _compile(before)
    assert e.value.code == "E101" and "`stages`" in str(e.value) and e.value.diagnostics[0].span.line == 2
