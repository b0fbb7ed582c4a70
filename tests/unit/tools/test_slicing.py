"""pipec slice (pipec.slicing): TeraPipe's dynamic program against every slicing of short sequences, the
schedule it writes, the uniform baselines, and the diagnostics of what cannot be sliced."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from repo import ROOT

from pipec.api import simulate
from pipec.cli.app import main
from pipec.driver import build
from pipec.errors import PipecError, Source
from pipec.ir.schedule import Slicing
from pipec.slicing import (
    best_uniform,
    choose,
    slice_costs,
    slice_schedule,
    tokens_expr,
    uniform,
    write_schedule,
)

# A sliced schedule in GPipe order over (sequence, slice), and one with a split backward (every W last);
# the costs come from the tests' cost documents.
TEXT = """schedule "tp" (p: int = 2, m: int = 1, n: int = 2, L: int = 8) {
    stages p
    slices n
    seqlen L
    ops F, B
    rank r {
        for i in 0 .. m { for j in 0 .. n { F(i, slice: j) } }
        for i in 0 .. m { for j in 0 .. n { B(i, slice: n - 1 - j) } }
    }
}
"""
SPLIT = (
    TEXT.replace("ops F, B", "ops F, B, W")
    .replace('"tp"', '"tp-split"')
    .replace(
        "B(i, slice: n - 1 - j) } }",
        "B(i, slice: n - 1 - j) } }\n        for i in 0 .. m { for j in 0 .. n { W(i, slice: j) } }",
    )
)


def _src(text: str = TEXT, path: str = "tp.pipe") -> Source:
    return Source(path, text)


def _compositions(cells: int):
    """Every cut of `cells` grid cells into slices, as cell counts."""
    for bars in itertools.product((0, 1), repeat=cells - 1):
        out, run = [], 1
        for b in bars:
            if b:
                out.append(run)
                run = 1
            else:
                run += 1
        yield (*out, run)


CASES = [
    # (params, cost document)
    ({"p": 2, "L": 8}, {"F": 1.0, "B": 2.0, "attn": 0.6}),
    ({"p": 4, "L": 8}, {"F": 1.0, "B": 2.0, "W": 1.0, "attn": 0.3, "op_fixed": 0.05}),
    ({"p": 3, "m": 2, "L": 9}, {"F": [1.0, 1.5, 0.5], "B": 2.0, "attn": [0.9, 0.2, 0.5], "op_fixed": 0.02}),
    ({"p": 4, "L": 8, "split": True}, {"F": 1.0, "B": 1.0, "W": 1.0, "attn": 0.8, "op_fixed": 0.2}),
    ({"p": 2, "m": 2, "L": 7, "split": True}, {"F": 1.0, "B": 1.0, "W": 0.5, "attn": 0.4, "op_fixed": 0.1}),
    ({"p": 1, "L": 6}, {"F": 1.0, "B": 2.0, "attn": 0.5, "op_fixed": 0.1}),
]


@pytest.mark.parametrize("params,doc", CASES)
def test_the_dynamic_program_finds_the_best_of_every_slicing(params, doc):
    params = dict(params)
    sched = build(_src(SPLIT if params.pop("split", False) else TEXT), params)
    assert sched.split_backward == (sched.name == "tp-split")
    costs = slice_costs(sched, [dict(doc, _from="test")], granularity=1)
    every = {toks: costs.estimate(toks) for toks in _compositions(costs.seqlen)}
    best = min(every.values())
    got = choose(costs)
    assert got.estimate == pytest.approx(best, rel=1e-9)
    assert costs.estimate(got.tokens) == pytest.approx(got.estimate, rel=1e-9)
    assert sum(got.tokens) == costs.seqlen
    # the fewest slices among the optimal cuts, and of those the most even slice times
    optimal = [t for t, v in every.items() if v <= best * (1 + 1e-9)]
    assert len(got.tokens) == min(map(len, optimal))
    squares = {t: float((costs.stage_times(t).max(axis=0) ** 2).sum()) for t in optimal if len(t) == len(got.tokens)}
    assert squares[got.tokens] == pytest.approx(min(squares.values()), rel=1e-9)
    for k in (1, 2, 3):  # and with at most k slices
        limited = min(v for t, v in every.items() if len(t) <= k)
        assert choose(costs, max_slices=k).estimate == pytest.approx(limited, rel=1e-9)


def test_a_coarser_grid_searches_its_own_steps_exactly():
    sched = build(_src(), {"p": 4, "L": 12})
    costs = slice_costs(sched, [{"F": 1.0, "B": 2.0, "attn": 0.7, "op_fixed": 0.03}], granularity=2)
    best = min(costs.estimate(tuple(2 * c for c in cut)) for cut in _compositions(6))
    got = choose(costs)
    assert got.estimate == pytest.approx(best, rel=1e-9) and all(t % 2 == 0 for t in got.tokens)


def test_grid_prices_equal_the_cost_models_slice_times():
    """The grid prices a slice by prefix sums of its cells' weights: the same as the cost model pricing
    that slice itself (Slicing.weight on the cut [c, l, rest])."""
    sched = build(_src(), {"p": 3, "L": 10})
    docs = [{"F": [1.0, 2.0, 0.5], "B": 2.0, "attn": [0.4, 0.9, 0.1], "op_fixed": 0.07}]
    costs = slice_costs(sched, docs, granularity=1)
    for c, n in [(0, 10), (0, 3), (3, 4), (9, 1), (5, 5), (2, 7)]:
        cut = tuple(x for x in (c, n, 10 - c - n) if x)
        direct = costs.stage_times(cut).max(axis=0)[1 if c else 0]
        assert costs.grid[c, c + n] == pytest.approx(direct, rel=1e-12)
    weights = Slicing(1, 3, 10, (2, 5, 3), (10,)).weight(0.4)
    assert weights.sum() == pytest.approx(1.0)


def test_a_slice_pays_its_messages_overhead_and_the_search_takes_fewer_slices():
    """`overhead` (per send and per receive) is a slice's cost whatever its length: a middle stage of three
    receives and sends in F and in B (4 messages), an end stage 2; with it the search cuts fewer slices."""
    sched = build(_src(), {"p": 3, "L": 64})
    doc = {"F": 1.0, "B": 2.0, "attn": 0.6, "op_fixed": 0.002}
    plain = slice_costs(sched, [doc], granularity=4)
    paid = slice_costs(sched, [{**doc, "overhead": 0.01}], granularity=4)
    cut = (16, 16, 32)
    assert (paid.stage_times(cut) - plain.stage_times(cut))[:, 0] == pytest.approx([0.02, 0.04, 0.02])
    dear = slice_costs(sched, [{**doc, "overhead": 0.05}], granularity=4)
    finite = np.isfinite(plain.grid)
    assert np.allclose(paid.grid[finite] - plain.grid[finite], 0.04)
    assert len(choose(dear).tokens) < len(choose(plain).tokens)


def test_longer_slices_first_when_attention_dominates():
    """TeraPipe's shape: with attention's cost growing along the sequence, later slices are shorter."""
    sched = build(_src(), {"p": 4, "L": 256})
    costs = slice_costs(sched, [{"F": 1.0, "B": 2.0, "attn": 0.8, "op_fixed": 0.01}], granularity=8)
    got = choose(costs)
    assert len(got.tokens) > 2 and list(got.tokens) == sorted(got.tokens, reverse=True)
    assert got.tokens[0] > got.tokens[-1]
    assert got.estimate < costs.estimate(uniform(256, len(got.tokens)))
    assert got.tried <= got.bounds


def test_the_written_schedule_parses_checks_and_simulates_to_the_printed_step(tmp_path, capsys):
    doc = {"F": 1.0, "B": 2.0, "attn": 0.5, "op_fixed": 0.02}
    path = tmp_path / "tp.pipe"
    path.write_text(TEXT)
    out = tmp_path / "sliced.pipe"
    rc = main(
        ["slice", str(path), "-D", "p=4", "-D", "L=64", "--cost", "F=1,B=2,attn=0.5,op_fixed=0.02", "-o", str(out)]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    res = slice_schedule(_src(TEXT, str(path)), {"p": 4, "L": 64}, [doc])
    written = build(Source(str(out), out.read_text()), ())  # parses, evaluates and checks alone
    assert out.read_text() == res.text
    assert written.slicing.tokens == res.choice.tokens
    assert dict(written.params)["n"] == len(res.choice.tokens) and dict(written.params)["p"] == 4
    step = simulate(str(out), cost=doc).stats.makespan
    assert step == pytest.approx(res.rows[0]["step"], rel=1e-12)
    assert f"{step:.6g}" in printed and ", ".join(map(str, res.choice.tokens)) in printed
    # the uniform rows are the language's own even cut at that count
    even = build(_src(), {"p": 4, "L": 64, "n": res.rows[1]["slices"]})
    assert tuple(res.rows[1]["tokens"]) == even.slicing.tokens
    assert res.rows[1]["step"] == pytest.approx(simulate(even, cost=doc).stats.makespan)
    assert res.rows[0]["step"] <= res.rows[1]["step"] and res.rows[0]["step"] <= res.rows[3]["step"]


def test_json_output(tmp_path, capsys):
    path = tmp_path / "tp.pipe"
    path.write_text(TEXT)
    assert main(["slice", str(path), "-D", "L=16", "--cost", "attn=0.5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sum(doc["tokens"]) == 16 and doc["slices"] == len(doc["tokens"])
    assert [r["slicing"] for r in doc["compare"]][0] == "TeraPipe DP"


def test_uniform_baselines():
    assert uniform(10, 3) == (4, 3, 3) and uniform(8, 8) == (1,) * 8 and uniform(7, 1) == (7,)
    sched = build(_src(), {"p": 4, "L": 24})
    costs = slice_costs(sched, [{"F": 1.0, "B": 2.0, "attn": 0.5, "op_fixed": 0.05}], granularity=1)
    best = best_uniform(costs, 10)
    assert costs.estimate(best) == min(costs.estimate(uniform(24, n)) for n in range(1, 11))
    assert choose(costs, 10).estimate <= costs.estimate(best)


def test_many_distinct_lengths_write_a_parseable_expression():
    tokens = tuple(range(1, 121))  # 120 runs: nested as a chain, deeper than the parser allows
    text = write_schedule(_src(), {"L": sum(tokens)}, tokens)
    sched = build(Source("many.pipe", text), ())
    assert sched.slicing.tokens == tokens
    assert tokens_expr((5, 5, 3)) == "if j < 2 then 5 else 3"


def _code(fn) -> tuple[str, str]:
    with pytest.raises(PipecError) as e:
        fn()
    d = e.value.diagnostics[0]
    return d.code, d.format()


def test_a_schedule_without_slices():
    code, text = _code(lambda: slice_schedule(Source("1f1b.pipe", build_text_1f1b()), {}, [{"attn": 0.5}]))
    assert code == "E807" and "has no token slices" in text


def build_text_1f1b() -> str:
    from pipec.frontend.library import read

    return read("1f1b").text


def test_slices_not_set_by_a_parameter_is_located():
    text = TEXT.replace("slices n", "slices 2")
    code, out = _code(lambda: slice_schedule(_src(text), {}, [{"attn": 0.5}]))
    assert code == "E807" and out.startswith("tp.pipe:3:5: error[E807]") and "slices n" in out


def test_costs_without_attn():
    code, out = _code(lambda: slice_schedule(_src(), {}, [{"F": 1.0, "B": 2.0}]))
    assert code == "E808" and "pipec profile" in out
    # a schedule's own `cost attn` is enough
    res = slice_schedule(_src(TEXT.replace("ops F, B", "ops F, B\n    cost attn = 0.4")), {"p": 2}, [])
    assert sum(res.choice.tokens) == 8


def test_a_granularity_that_does_not_divide_the_sequence():
    code, out = _code(lambda: slice_schedule(_src(), {"L": 10}, [{"attn": 0.5}], granularity=4))
    assert code == "E809" and "does not divide" in out and "e.g. 1" in out
    code, out = _code(lambda: slice_schedule(_src(), {"L": 2048}, [{"attn": 0.5}], granularity=2))
    assert code == "E809" and "1,024 positions" in out and "e.g. 4 (512 positions)" in out
    code, out = _code(lambda: slice_schedule(_src(), {}, [{"attn": 0.5}], max_slices=0))
    assert code == "E809" and "at least one slice" in out


def test_progress_is_reported_on_long_work():
    said: list[str] = []
    slice_schedule(_src(), {"p": 2, "L": 16}, [{"attn": 0.5}], progress=said.append)
    assert said and "positions" in said[0]
    assert np.isfinite(slice_costs(build(_src(), {}), [{"attn": 0.5}]).grid[0, 8])


def test_an_unmet_expectation_of_the_written_file_is_a_warning(tmp_path, capsys):
    text = TEXT.replace("    stages p", '    expect bubble <= 0.01, "a bubble this small"\n    stages p')
    path, out = tmp_path / "tp.pipe", tmp_path / "sliced.pipe"
    path.write_text(text)
    assert main(["slice", str(path), "-D", "L=16", "--cost", "attn=0.5", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{out}:2:5: warning[E405]: expectation not met: a bubble this small" in err
    assert out.exists()


# ---- pipec profile --slices (runtime/profile/stages.py): the grid, the fit, the measurement -----------------------


def test_the_fit_recovers_the_cost_models_attn_and_op_fixed():
    from pipec.runtime.profile.slices import fit_slices, slice_points

    L = 64
    points = slice_points(L, 8)
    # 36 slices between eighths, then 4 tokens (half an eighth) at the start and at the end
    assert len(points) == 38 and points[-2:] == [(4, 0), (4, 60)]
    assert slice_points(L, 8, contexts=False) == [(8 * k, 0) for k in range(1, 9)] + [(4, 0)]
    assert all(c + n <= L and n > 0 for n, c in points)
    attn, fixed, T = 0.35, 0.004, 0.2  # one slice: F and its backward, two ops of `fixed` each
    # the cost model's time of the middle slice of the cut (c, n, rest), F and backward
    weights = [Slicing(1, 3, L, (c, n, L - c - n), (L,)).weight(attn)[1] for n, c in points]
    times = [2 * fixed + (T - 2 * fixed) * w for w in weights]
    got_attn, got_fixed, rms, worst = fit_slices(L, points, times)
    assert got_attn == pytest.approx(attn, rel=1e-9) and got_fixed == pytest.approx(fixed, rel=1e-9)
    assert rms < 1e-9 and worst < 1e-9
    noisy = [t * (1.1 if k % 2 else 0.9) for k, t in enumerate(times)]
    assert fit_slices(L, points, noisy)[2] > 0.05  # the residual says when the form does not fit


MODEL_WITHOUT_CACHE = """
import torch
from torch import nn
from torch.nn import functional as F

dtype = torch.float64

def build_stage(stage, num_stages):
    torch.manual_seed(stage)
    if stage == 0:
        return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    return nn.Sequential(nn.Linear(8, 10) if stage == num_stages - 1 else nn.Linear(8, 8))

def loss_fn(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 10, (2, 12), generator=g)
    return x, torch.roll(x, -1, dims=1)
"""


def test_profile_times_slices_through_the_cache_interface_and_writes_the_keys(monkeypatch):
    from pipec.api import compile as compile_
    from pipec.runtime.model.contract import load_model
    from pipec.runtime.profile.slices import measure_slices

    monkeypatch.setenv("GPT_CONTEXT", "12")
    monkeypatch.setenv("GPT_LAYERS", "2")
    monkeypatch.setenv("GPT_WIDTH", "16")
    monkeypatch.setenv("GPT_BATCH", "2")
    model = load_model(str(ROOT / "examples" / "gpt.py"))
    prog = compile_("gpipe", {"p": 2, "m": 1})
    fit = measure_slices(prog, model, 3, reps=1, warmup=0)
    assert fit.how.startswith("key/value cache") and fit.seqlen == 12
    assert fit.points == [(4, 0), (8, 0), (12, 0), (4, 4), (8, 4), (4, 8)]
    assert all(len(x) == 6 and min(x) > 0 for x in fit.forward + fit.backward)
    assert all(0 <= a <= 1 for a in fit.attn) and all(o >= 0 for o in fit.op_fixed)
    assert set(fit.measured()) >= {"lengths", "contexts", "forward", "backward", "fit_residual"}


def test_profile_without_the_cache_interface_times_prefixes(tmp_path):
    from pipec.api import compile as compile_
    from pipec.runtime.model.contract import load_model
    from pipec.runtime.profile.slices import measure_slices

    path = tmp_path / "nocache.py"
    path.write_text(MODEL_WITHOUT_CACHE)
    fit = measure_slices(compile_("gpipe", {"p": 2, "m": 1}), load_model(str(path)), 4, reps=1, warmup=0)
    assert fit.how.startswith("prefixes") and [c for _, c in fit.points] == [0, 0, 0, 0]
    from pipec.runtime.errors import PipelineError

    with pytest.raises(PipelineError, match="3 or more slice lengths"):
        measure_slices(compile_("gpipe", {"p": 2, "m": 1}), load_model(str(path)), 2, reps=1, warmup=0)
