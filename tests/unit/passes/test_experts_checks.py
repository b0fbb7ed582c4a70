"""Expert parallelism's checks (pipec/passes/experts.py, pipec/passes/checks.py's pairs) and the Program's
experts (pipec/ir/program.py, pipec/formats/program_file.py): each diagnostic located, before any step."""

from __future__ import annotations

from dataclasses import replace

import pytest
from cli_helpers import run_cli

from pipec.driver import build, check_program, compiled
from pipec.errors import PipecError, Source
from pipec.formats.program_file import from_json, from_text, to_json, to_text
from pipec.frontend.library import read
from pipec.ir.dataparallel import DataParallel
from pipec.ir.experts import Experts, a2a_sequence
from pipec.passes.compiler import compile_schedule
from pipec.passes.experts import order_error, rank_sequence


def load(name: str, **params):
    return build(read(name), params)


def dualpipe(layers=(1,), ep=2, dp=2):
    s = load("dualpipe-v", p=2, m=4)
    return compile_schedule(s, None, DataParallel(dp), Experts(ep, 2 * ep), tuple(layers) * (4 // len(layers)))


# ---- options: E425 at the command line, before anything is lowered


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--ep", "2", "--experts", "3", "--dp", "2"], "multiple of --ep"),
        (["--ep", "4", "--experts", "4", "--dp", "2"], "must divide the data-parallel replicas"),
        (["--ep", "2", "--experts", "4", "--dp", "2", "--moe-layers", "1,2,3"], "name 3 stages"),
    ],
)
@pytest.mark.parametrize("command", ["check", "simulate"])
def test_bad_expert_options_are_located_at_the_command_line(command, argv, says):
    rc, out, err = run_cli(command, "1f1b", *argv)
    assert rc == 1 and "<command line>: error[E425]" in err and says in err


def test_a_recompute_of_a_stage_with_moe_layers_is_refused_at_its_statement():
    s = load("1f1b-recompute", p=2, m=4)
    with pytest.raises(PipecError) as e:
        compile_schedule(s, None, DataParallel(2), Experts(2, 2), (1, 1))
    d = e.value.diagnostics[0]
    assert d.code == "E425" and d.span is not None and "RECOMPUTE" in d.message
    compile_schedule(s, None, DataParallel(2), Experts(2, 2), (0, 0))  # no MoE layer: nothing to issue again


# ---- a pair whose ops need each other: E304 at the `&`

INTERLEAVED_PAIR = """schedule "pairi" (p: int = 2, m: int = 1) {
    stages 2 * p
    place s -> s % p
    ops F, B
    rank r {
        if r == 0 {
            F(0, stage: 2)
            F(0, stage: 0) & B(0, stage: 2)
            B(0, stage: 0)
        } else {
            F(0, stage: 1)  F(0, stage: 3)  B(0, stage: 3)  B(0, stage: 1)
        }
    }
}"""


def test_a_pair_needing_itself_through_other_ranks_is_E304_at_the_ampersand():
    with pytest.raises(PipecError) as e:
        build(Source("pairi.pipe", INTERLEAVED_PAIR))
    d = e.value.diagnostics[0]
    assert d.code == "E304" and "needs F(0, stage 0), which is overlapped with it" in d.message
    assert (d.span.line, d.span.col, d.span.end_col) == (8, 28, 29)  # the `&`
    assert INTERLEAVED_PAIR.splitlines()[7][27] == "&"


def test_a_pair_of_one_stage_and_micro_batch_is_E304_at_the_ampersand():
    text = 'schedule "x" (p: int = 1, m: int = 2) {\n  stages 1\n  rank r { F(0) & B(0)  F(1)  B(1) }\n}'
    with pytest.raises(PipecError) as e:
        build(Source("x.pipe", text))
    d = e.value.diagnostics[0]
    assert d.code == "E304" and text.splitlines()[2][d.span.col - 1] == "&"


# ---- the Program carries its experts; another setting is refused (E426)


def test_program_files_carry_the_experts_and_refuse_another_setting():
    c = dualpipe(layers=(1, 2))
    prog = c.program
    assert prog.experts == Experts(2, 4) and prog.moe_layers == (1, 2, 1, 2)
    for back in (from_json(to_json(prog)), from_text(to_text(prog))):
        assert back == prog
    check_program(prog, None, "p.json", DataParallel(2), Experts(2, 4), (1, 2, 1, 2))
    with pytest.raises(PipecError, match="E426") as e:
        check_program(prog, None, "p.json", DataParallel(2), Experts(2, 8))
    assert "--ep 2 --experts 4 --moe-layers 1,2,1,2" in e.value.diagnostics[0].message
    with pytest.raises(PipecError, match="E426"):
        check_program(prog, None, "p.json", None, None, (1, 1, 1, 1))


def test_a_program_without_experts_is_written_as_before():
    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    assert "experts" not in to_json(prog) and "moe_layers" not in to_text(prog)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda t: t.replace('"moe_layers":[1,2,1,2]', '"moe_layers":[1,2]'), "name 2 stages"),
        (lambda t: t.replace('"size":2', '"size":3'), "multiple of --ep"),
        (lambda t: t.replace('"dp":2', '"dp":3'), "must divide"),
    ],
)
def test_a_program_file_with_bad_experts_is_refused(edit, says):
    text = edit(to_json(dualpipe(layers=(1, 2)).program))
    with pytest.raises(PipecError, match=says):
        from_json(text, "p.json")


# ---- the all-to-all order of an expert group (E427)


def test_an_odd_moe_layer_count_orders_the_pairs_all_to_alls_and_passes():
    c = dualpipe(layers=(1, 3))  # odd counts, unequal across the stages a pair computes
    seq = rank_sequence(c.program, 0, c.program.moe_layers)
    # rank 0 holds stages 0 (1 layer) and 3 (3 layers): F and B of 4 micro-batches each, 2 per layer
    assert len(seq) == sum(4 * 2 * 2 * c.program.moe_layers[s] for s in (0, 3)) == 64
    assert order_error(c.program, 0, {0: (1, 3, 1, 3), 1: (1, 3, 1, 3)}, c.schedule) is None


def test_replicas_that_built_other_moe_layers_are_E427_naming_ranks_and_the_source_line():
    c = dualpipe(layers=(1, 1))
    e = order_error(c.program, 0, {0: (1, 1, 1, 1), 1: (1, 1, 1, 2)}, c.schedule)
    assert e is not None
    d = e.diagnostics[0]
    assert d.code == "E427" and "ranks 0 and 1" in d.message and "pipeline rank 0" in d.message
    assert d.span is not None and d.source is not None  # the op that issues the first differing all-to-all
    assert any("rank 1: " in n for n in d.notes)


def test_the_sequence_follows_pair_order():
    # F (1 layer: 2 all-to-alls) & B (2 layers: 4): F0 B0 F1 B1 B2 B3
    seq = a2a_sequence([("F", 5, 0, True), ("B", 1, 1, False)], (1, 2))
    assert [(k, i) for k, _, _, i in seq] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("B", 2), ("B", 3)]
    assert a2a_sequence([("W", 0, 0, False)], (3,)) == []


def test_the_simulation_refuses_a_program_for_other_experts_through_the_driver():
    prog = dualpipe().program
    with pytest.raises(PipecError, match="E426"):
        compiled(prog, None, "p.json", DataParallel(2), None, Experts(2, 2))
    assert compiled(replace(prog), None, "p.json", DataParallel(2), None, Experts(2, 4)).program == prog


# ---- the `overlap_gain` expect metric


def test_overlap_gain_is_the_simulated_gain_of_the_pairs():
    from pipec.driver import metrics, simulation

    assert metrics(load("1f1b", p=2, m=4)).overlap_gain == 0.0  # no pair
    s = load("combined-1f1b", p=2, v=1, m=4)
    doc = [{"a2a": 1.0 / 3, "_from": "t"}]  # one forward segment of a stage's F = 1 (T_F = 1, one stage a rank)
    on, off = (simulation(s, doc, None, None, None, DataParallel(2), Experts(2, 2), (1,), ov) for ov in (True, False))
    assert metrics(s).overlap_gain == pytest.approx(1 - on.stats.makespan / off.stats.makespan)
    assert metrics(s).overlap_gain > 0


def test_overlap_gain_reads_the_schedules_moe_layers_and_a2a():
    from pipec.driver import metrics, simulation

    text = read("combined-1f1b").text.replace(
        "    stages p * v\n", "    stages p * v\n    cost moe_layers = 2\n    cost a2a = 5\n"
    )
    s = build(Source("c.pipe", text), {"p": 2, "v": 1, "m": 4})
    on, off = (simulation(s, [], None, None, None, DataParallel(2), Experts(2, 2), None, ov) for ov in (True, False))
    assert metrics(s).overlap_gain == pytest.approx(1 - on.stats.makespan / off.stats.makespan)


def test_a_broken_overlap_promise_is_E405():
    text = read("combined-1f1b").text.replace(
        "    stages p * v\n", '    stages p * v\n    expect overlap_gain > 0.9, "too much"\n'
    )
    with pytest.raises(PipecError, match="E405") as e:
        from pipec.driver import check_expectations

        check_expectations(build(Source("c.pipe", text), {"p": 2, "v": 1, "m": 4}))
    assert "too much" in e.value.diagnostics[0].message


def test_the_python_api_takes_experts_as_the_command_line_does():
    """`pipec.compile`/`check`/`simulate` take `experts`, `moe_layers` and `overlap` (`--ep`/`--experts`,
    `--moe-layers`, `--no-overlap`): the same Program and makespans, and the same E425 for bad sizes."""
    import json

    import pipec

    moe = dict(data_parallel=pipec.DataParallel(2), experts=pipec.Experts(2, 4), moe_layers=[1, 1, 1, 1])
    prog = pipec.compile("dualpipe-v", p=2, m=4, **moe)
    assert prog == dualpipe(layers=(1,)).program
    flags = ["-D", "p=2", "-D", "m=4", "--dp", "2", "--ep", "2", "--experts", "4", "--moe-layers", "1"]
    for overlap in (True, False):
        no = [] if overlap else ["--no-overlap"]
        rc, out, err = run_cli("simulate", "dualpipe-v", *flags, "--cost", "a2a=0.2", "--json", *no)
        assert rc == 0, err
        sim = pipec.simulate("dualpipe-v", p=2, m=4, cost="a2a=0.2", overlap=overlap, **moe)
        assert sim.stats.makespan == pytest.approx(json.loads(out)["results"][0]["makespan"])
    with pytest.raises(PipecError, match=r"E425.*must divide the data-parallel replicas"):
        pipec.check("dualpipe-v", p=2, m=4, data_parallel=pipec.DataParallel(2), experts=pipec.Experts(4, 4))
