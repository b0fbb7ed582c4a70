"""Data-parallel collectives written in the language (issue 17, part 4): `UNSHARD(stage: s)`,
`RESHARD(stage: s)` and `REDUCE_GRAD(stage: s)` in a rank block, `dc "name" replicas lo .. hi` in a
topology, and the ZeroPP-style library schedule that places them.

What a placed collective means (`Collective.before`: the ops of the rank emitted before it) is checked
here against the statements; that the lowering honours them and the validator proves them is
pipec.passes.lower's part, exercised at the end through `pipec.check(..., data_parallel=...)`.
"""

from __future__ import annotations

import pytest

from pipec.api import load
from pipec.driver import build
from pipec.errors import PipecError, Source
from pipec.frontend import library
from pipec.frontend.load import compile_source
from pipec.ir.schedule import Collective, Datacenter, Link

# Two ranks, two chunks each (stage c * p + r), one block of m forwards per chunk.
TWO_CHUNKS = """\
schedule "t" (p: int = 2, m: int = 2) {
    stages 2 * p
    place s -> s % p
    ops F, B
    rank r {
BODY
    }
}
"""

DEFAULT_BODY = """\
        UNSHARD(stage: r)
        for i in 0 .. m { F(i, stage: r) }
        UNSHARD(stage: p + r)
        RESHARD(stage: r)
        for i in 0 .. m { F(i, stage: p + r) }
        for i in 0 .. m { B(i, stage: p + r) }
        REDUCE_GRAD(stage: p + r)
        RESHARD(stage: p + r)
        UNSHARD(stage: r)
        for i in 0 .. m { B(i, stage: r) }
        REDUCE_GRAD(stage: r)
        RESHARD(stage: r)"""

ONE_STAGE = """\
schedule "t" (p: int = 2, m: int = 2) {
    stages p
    place s -> s
    ops F, B
    rank r {
BODY
    }
}
"""


def two_chunks(body: str = DEFAULT_BODY, **params: object):
    return build(Source("t.pipe", TWO_CHUNKS.replace("BODY", body)), params)


def one_stage(body: str, **params: object):
    return build(Source("t.pipe", ONE_STAGE.replace("BODY", body)), params)


def placed(sched, rank: int) -> list[tuple[str, int, int]]:
    return [(c.op, c.stage, c.before) for c in sched.collectives[rank]]


def error_of(fn, *args, **kwargs):
    with pytest.raises(PipecError) as e:
        fn(*args, **kwargs)
    return e.value.diagnostics[0]


# ---------------------------------------------------------------- placement


def test_before_counts_the_ops_emitted_so_far():
    s = two_chunks()
    for r in range(2):
        a, b = r, 2 + r
        assert placed(s, r) == [
            ("UNSHARD", a, 0),
            ("UNSHARD", b, 2),
            ("RESHARD", a, 2),
            ("REDUCE_GRAD", b, 6),
            ("RESHARD", b, 6),
            ("UNSHARD", a, 6),
            ("REDUCE_GRAD", a, 8),
            ("RESHARD", a, 8),  # before == len(ops): after the last op
        ]
        assert len(s.ranks[r]) == 8


def test_each_collective_keeps_its_statement_span():
    s = two_chunks()
    c = s.collectives[0][0]
    assert isinstance(c, Collective) and c.span is not None
    assert (c.span.line, c.span.col) == (6, 9)
    assert s.source.line(c.span.line)[c.span.col - 1 :].startswith("UNSHARD(stage: r)")


def test_the_stage_defaults_to_the_ranks_only_stage():
    s = one_stage("UNSHARD()\nfor i in 0 .. m { F(i) }\nfor i in 0 .. m { B(i) }\nREDUCE_GRAD()\nRESHARD()")
    assert placed(s, 1) == [("UNSHARD", 1, 0), ("REDUCE_GRAD", 1, 4), ("RESHARD", 1, 4)]


def test_loops_ifs_and_functions_place_like_ops():
    body = """\
        def gather(c) { UNSHARD(stage: c * p + r) }
        def free(c) = RESHARD(stage: c * p + r)
        for c in 0 .. 2 {
            gather(c)
            for i in 0 .. m { F(i, stage: c * p + r) }
            if c == 0 { free(c) }
        }
        for c in 0 .. 2 {
            if c == 1 { gather(0) }
            for i in 0 .. m { B(i, stage: (1 - c) * p + r) }
            REDUCE_GRAD(stage: (1 - c) * p + r)
            free(1 - c)
        }"""
    s = two_chunks(body)
    assert placed(s, 1) == [
        ("UNSHARD", 1, 0),
        ("RESHARD", 1, 2),
        ("UNSHARD", 3, 2),
        ("REDUCE_GRAD", 3, 6),
        ("RESHARD", 3, 6),
        ("UNSHARD", 1, 6),
        ("REDUCE_GRAD", 1, 8),
        ("RESHARD", 1, 8),
    ]


def test_a_collective_between_the_ops_of_a_while_loop():
    s = one_stage("while done(F, r) < m { UNSHARD()  F()  RESHARD() }\nfor i in 0 .. m { B(i) }")
    assert placed(s, 0) == [("UNSHARD", 0, 0), ("RESHARD", 0, 1), ("UNSHARD", 0, 1), ("RESHARD", 0, 2)]


def test_a_rank_that_places_none_has_an_empty_row():
    s = one_stage("if r == 0 { UNSHARD() }\nfor i in 0 .. m { F(i) }\nfor i in 0 .. m { B(i) }")
    assert placed(s, 0) == [("UNSHARD", 0, 0)] and s.collectives[1] == ()


def test_schedules_without_collectives_keep_the_plain_path():
    for name in library.names():
        code = compile_source(library.read(name))
        assert code.collectives == (name == "zeropp"), name
        assert "_coll" not in code.code or name == "zeropp"
    assert load("1f1b", p=4, m=8).collectives == ()
    # Placed on no rank for these parameters: still no collectives at all.
    assert one_stage("if r > 5 { UNSHARD() }\nfor i in 0 .. m { F(i) }\nfor i in 0 .. m { B(i) }").collectives == ()


def test_an_order_block_schedule_places_none():
    assert load("examples/1f1b-policy.pipe").collectives == ()


def test_evaluating_some_ranks_gives_rows_for_those_only():
    text = TWO_CHUNKS.replace("BODY", DEFAULT_BODY)
    from pipec.frontend.evaluate import evaluate

    src = Source("t.pipe", text)
    s = evaluate(compile_source(src), src, (), ranks=[1])
    assert s.collectives[0] == () and len(s.collectives[1]) == 8


# ---------------------------------------------------------------- diagnostics


def test_a_stage_on_another_rank_is_E301_at_the_statement():
    d = error_of(two_chunks, "UNSHARD(stage: 0)\n" + DEFAULT_BODY)
    assert d.code == "E301"
    assert (d.span.line, d.span.col) == (6, 1)
    assert "UNSHARD(stage 0) placed on rank 1, but stage 0 is placed on rank 0" in d.message
    assert d.notes == ("rank 1 owns stages 1, 3",)
    assert "^^^^^^^^^^^^^^^^^" in d.format()


def test_no_stage_on_a_rank_of_several_is_E308():
    d = error_of(two_chunks, "        RESHARD()\n" + DEFAULT_BODY)
    assert d.code == "E308" and "rank 0 owns stages [0, 2]" in d.message and "RESHARD(stage: s)" in d.message
    assert (d.span.line, d.span.col) == (6, 9)


def test_a_stage_out_of_range_is_E208():
    d = error_of(two_chunks, "        REDUCE_GRAD(stage: 9)\n" + DEFAULT_BODY)
    assert d.code == "E208" and "stage 9 is out of range 0..3" in d.message


def test_a_collective_outside_the_rank_block_is_E109():
    text = ONE_STAGE.replace("    rank r {\nBODY\n    }\n", "    UNSHARD(stage: 0)\n    rank r { F(0)  B(0) }\n")
    d = error_of(build, Source("t.pipe", text), {"m": 1})
    assert d.code == "E109" and (d.span.line, d.span.col) == (5, 5)


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        ("UNSHARD(0)", "E102", "takes no micro-batch, only a stage: write `UNSHARD(stage: s)`"),
        ("UNSHARD(mb: 0)", "E105", "has no argument `mb`"),
        ("UNSHARD(stage: 0, stage: 1)", "E105", "the stage given twice"),
        ("UNSHARD(stage: true)", "E103", "`stage:` needs int"),
        ("F(0) & UNSHARD()", "E111", "`UNSHARD` cannot be overlapped"),
        ("let u = UNSHARD", "E103", "`UNSHARD` is a collective"),
        ("let REDUCE_GRAD = 3", "E104", "built-in name"),
        ("def g() = UNSHARD()\nF(0) & g()", "E111", "a collective cannot be overlapped"),
    ],
)
def test_misused_collectives(body, code, words):
    d = error_of(one_stage, body + "\nfor i in 0 .. m { F(i) }\nfor i in 0 .. m { B(i) }")
    assert d.code == code and words in d.message, d.format()


# ---------------------------------------------------------------- where the replicas sit


def topo(items: str, p: int = 4):
    text = f'schedule "t" (p: int = {p}, m: int = 2) {{\n    stages p\n    topology {{ {items} }}\n'
    text += "    rank r { for i in 0 .. m { F(i) }  for i in 0 .. m { B(i) } }\n}\n"
    return build(Source("t.pipe", text), {})


def test_replica_datacenters_fill_replica_dcs():
    t = topo(
        'dc "west" ranks 0 .. 4  dc "west" replicas 0 .. 2  dc "east" replicas 2 .. 4\n'
        '    link "west" <-> "east" latency 30ms bandwidth 25Gbps'
    ).topology
    assert t.datacenters == (Datacenter("west", 0, 4),)
    assert t.replica_dcs == (Datacenter("west", 0, 2), Datacenter("east", 2, 4))
    assert t.links == (Link("west", "east", 0.03, 25e9),)


def test_replica_datacenters_alone_and_in_any_order():
    t = topo('dc "b" replicas 1 .. 2  dc "a" replicas 0 .. 1').topology
    assert t.datacenters == () and [d.name for d in t.replica_dcs] == ["a", "b"]
    assert topo("default link bandwidth 1Gbps").topology.replica_dcs == ()


def test_replicas_is_not_a_reserved_name():
    text = ONE_STAGE.replace("BODY", "let replicas = m\nfor i in 0 .. replicas { F(i) }\nfor i in 0 .. m { B(i) }")
    assert build(Source("t.pipe", text), {}).num_ops == 8


@pytest.mark.parametrize(
    ("items", "words"),
    [
        ('dc "a" replicas 0 .. 2  dc "a" replicas 2 .. 3', 'datacenter "a" declared twice for replicas'),
        ('dc "a" replicas 0 .. 2  dc "b" replicas 1 .. 3', 'replicas overlap those of "a"'),
        ('dc "a" replicas 0 .. 1  dc "b" replicas 2 .. 3', "replica 1 is in no datacenter"),
        ('dc "b" replicas 3 .. 4', "replicas 0..3 are in no datacenter"),
        ('dc "a" replicas 2 .. 2', "replicas 2..2: need 0 <= lo < hi"),
        ('dc "a" replicas 0 .. 1  link "a" <-> "z" latency 1ms', 'unknown datacenter "z"'),
        ('dc "a" replicas 0 .. true', "a replica bound needs int"),
    ],
)
def test_bad_replica_datacenters_are_E112(items, words):
    d = error_of(topo, items)
    assert d.code in ("E112", "E103") and words in d.message, d.format()


# ---------------------------------------------------------------- the ZeroPP-style library schedule


def zeropp_model(p: int, v: int, m: int, b: int, ahead: int, r: int) -> list[tuple[str, int, int]]:
    """The collectives zeropp.pipe's header promises, computed directly from the op order: chunk c is
    needed over each block's first..last op, gathered when needed within `ahead` ops, REDUCE_GRAD after
    a stage's last backward."""
    n = m * v
    warm = min((v - 1) * b + 2 * (p - 1 - r), n)
    order = [("F", k) for k in range(warm)]
    for k in range(n - warm):
        order += [("F", k + warm), ("B", k)]
    order += [("B", k) for k in range(n - warm, n)]

    def chunk(kind: str, k: int) -> int:
        return k // b % v if kind == "F" else v - 1 - k // b % v

    needed = [set() for _ in range(len(order) + ahead + 1)]
    for kind in "FB":
        pos = [t for t, (kd, _) in enumerate(order) if kd == kind]
        for j in range(n // b):
            lo, hi = pos[j * b], pos[j * b + b - 1]
            for t in range(lo, hi + 1):
                needed[t].add(chunk(kind, j * b))

    def gathered(t: int) -> set[int]:
        return set().union(*needed[t : t + ahead + 1]) if t >= 0 else set()

    out = []
    for t in range(len(order) + 1):
        was, now = gathered(t - 1), gathered(t)
        out += [("RESHARD", c * p + r, t) for c in range(v) if c in was - now]
        out += [("UNSHARD", c * p + r, t) for c in range(v) if c in now - was]
        if t < len(order) and order[t][0] == "B":
            k = order[t][1]
            c = chunk("B", k)
            if k + 1 + c * b == n:
                out.append(("REDUCE_GRAD", c * p + r, t + 1))
    # At one position the schedule issues RESHARDs, then UNSHARDs; a REDUCE_GRAD follows its backward.
    return sorted(out, key=lambda x: (x[2], {"REDUCE_GRAD": 0, "RESHARD": 1, "UNSHARD": 2}[x[0]], x[1]))


GRID = [
    dict(p=1, v=1, m=1, b=1, ahead=1),
    dict(p=2, v=2, m=4, b=2, ahead=1),
    dict(p=2, v=3, m=6, b=3, ahead=0),
    dict(p=3, v=2, m=6, b=3, ahead=2),
    dict(p=4, v=2, m=8, b=4, ahead=1),
    dict(p=4, v=2, m=16, b=8, ahead=1),
    dict(p=4, v=4, m=8, b=4, ahead=2),
    dict(p=4, v=4, m=16, b=4, ahead=3),
    dict(p=3, v=2, m=12, b=6, ahead=7),
    dict(p=2, v=3, m=4, b=2, ahead=40),  # lookahead past the last op
]


@pytest.mark.parametrize("params", GRID, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_zeropp_places_what_its_header_says(params):
    s = load("zeropp", **params)
    for r in range(params["p"]):
        assert placed(s, r) == zeropp_model(r=r, **params), r  # in the schedule's own order, too


@pytest.mark.parametrize("params", GRID, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_zeropp_windows_cover_every_compute(params):
    """Every op of stage s runs inside an UNSHARD s .. RESHARD s window; every stage is reduced once,
    after its last op; at most the forward, the backward and one prefetched chunk are gathered."""
    s = load("zeropp", **params)
    for r in range(s.num_ranks):
        ops, colls = s.ops(r), s.collectives[r]
        held: set[int] = set()
        reduced: dict[int, int] = {}
        j = 0
        for i in range(len(ops) + 1):
            while j < len(colls) and colls[j].before == i:
                c = colls[j]
                if c.op == "UNSHARD":
                    assert c.stage not in held
                    held.add(c.stage)
                elif c.op == "RESHARD":
                    held.remove(c.stage)
                else:
                    assert c.stage not in reduced
                    reduced[c.stage] = i
                j += 1
            assert len(held) <= (3 if params["ahead"] <= 2 else params["v"])
            if i < len(ops):
                assert ops[i].stage in held, (r, i, ops[i])
        assert not held
        last = {o.stage: i + 1 for i, o in enumerate(ops)}
        assert reduced == last


def test_zeropp_order_is_interleaved_1f1b_when_blocks_are_p():
    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 3, 16), (8, 2, 32)]:
        z, i = load("zeropp", p=p, v=v, m=m), load("interleaved-1f1b", p=p, v=v, m=m)
        assert [z.ops(r) for r in range(p)] == [i.ops(r) for r in range(p)]


def test_zeropp_requires():
    for params, words in [
        (dict(p=4, m=8, b=2), "b >= p"),
        (dict(p=4, m=12, b=8), "blocks of b"),
        (dict(p=4, m=8, ahead=-1), "ahead counts ops of lookahead"),
    ]:
        d = error_of(load, "zeropp", **params)
        assert d.code == "E202" and words in d.message


def test_zeropp_checks_and_compiles_with_fsdp():
    import pipec
    from pipec.ir.dataparallel import DataParallel

    for params in [dict(p=4, v=2, m=8), dict(p=4, v=4, m=16), dict(p=8, v=2, m=32, b=16)]:
        for dp in (DataParallel(2, "fsdp"), DataParallel(4, "fsdp", prefetch=0), DataParallel(2, "ddp")):
            c = pipec.check("zeropp", params, data_parallel=dp)
            prog = c.program
            assert prog.dp == dp.size and prog.dp_kind == dp.kind
            names = [str(ins).split()[0] for r in prog.ranks for ins in r.instructions()]
            z = load("zeropp", **params)
            mine = sum(len(row) for row in z.collectives)
            placed_windows = sum(1 for row in z.collectives for x in row if x.op != "REDUCE_GRAD")
            if dp.kind == "fsdp":
                assert names.count("UNSHARD") + names.count("RESHARD") == placed_windows
            else:  # ddp drops the schedule's UNSHARD/RESHARD: replicated parameters have nothing to gather
                assert names.count("UNSHARD") == names.count("RESHARD") == 0
            assert names.count("REDUCE_GRAD") == mine - placed_windows == z.num_stages


def test_the_replica_link_of_the_topology_prices_the_collectives():
    """`dc ... replicas` puts the two replicas in two datacenters: their link is the DP ring's (the simulator
    reads `replica_dcs`), so a slow link there slows the step and a fast one does not."""
    import pipec
    from pipec.ir.dataparallel import DataParallel

    def step(link: str) -> float:
        text = TWO_CHUNKS.replace("BODY", DEFAULT_BODY).replace(
            "    rank r {",
            f'    topology {{ dc "west" replicas 0 .. 1  dc "east" replicas 1 .. 2  link "west" <-> "east" {link} }}\n'
            "    rank r {",
        )
        sim = pipec.simulate(
            build(Source("t.pipe", text), {}),
            cost="param_bytes=100MB,F=1ms,B=2ms",
            data_parallel=DataParallel(2, "fsdp"),
        )
        return sim.stats.makespan

    slow, fast = step("latency 20ms bandwidth 10Gbps"), step("latency 1us bandwidth 1000Gbps")
    assert slow > 10 * fast
    assert slow > 0.02 * 4  # at least the latency of the exposed gathers and reductions


def test_a_schedule_declares_the_collectives_costs_and_the_simulator_charges_them(tmp_path):
    """`cost param_bytes` / `cost unshard` in the language reach the cost model (one key list for both)."""
    from pipec.api import simulate
    from pipec.ir.dataparallel import DataParallel

    path = tmp_path / "pb.pipe"
    path.write_text("""schedule "pb" (p: int = 2, m: int = 2) {
    stages p
    place s -> s
    cost unshard = 0.5
    rank r {
        for i in 0 .. m { F(i) }
        for i in 0 .. m { B(i) }
    }
}
""")
    plain = simulate(path).stats.makespan
    sharded = simulate(path, data_parallel=DataParallel(size=2, kind="fsdp")).stats.makespan
    assert sharded == plain + 0.5  # rank 0's first forward waits for its all-gather; nothing else moves
