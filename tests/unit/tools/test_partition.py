"""`pipec partition`: the search is optimal against brute force, respects memory limits and rank speeds;
the layer table and partition file read back and refuse what they must; `pipec run --partition` trains
the split model with gradients equal to the reference."""

from __future__ import annotations

import itertools
import json
import tempfile

import numpy as np
import pytest
from tables import random_layer_table

from pipec.api import load
from pipec.errors import PipecError
from pipec.formats.partition_files import (
    Ranks,
    make_table,
    parse_ranks,
    partition_doc,
    read_partition,
    read_table,
    write_json,
)
from pipec.partition import partition
from pipec.partition.bounds import _work_bound, fluid_bound
from pipec.partition.branch import _propagate, _Rows
from pipec.partition.problem import Problem
from pipec.partition.search import search
from pipec.passes.compiler import compile_schedule
from pipec.sim.memory import rank_memory

pytest.importorskip("ortools")

CASES = [
    ("1f1b", {"p": 3, "m": 4}),
    ("zb-h1", {"p": 2, "m": 4}),
    ("interleaved-1f1b", {"p": 2, "v": 2, "m": 4}),
    ("zb-v", {"p": 2, "m": 4}),
]


def _brute(pb: Problem):
    """Every contiguous split, simulated: the best that fits, or None."""
    best = None
    for cuts in itertools.combinations(range(1, pb.L), pb.S - 1):
        sp = pb.evaluate((0, *cuts, pb.L))
        if sp.fits and (best is None or sp.step < best.step):
            best = sp
    return best


@pytest.mark.parametrize("name,params", CASES)
def test_optimal_against_brute_force(name, params):
    rng = np.random.default_rng(sum(map(ord, name)))
    sched = load(name, **params)
    prog = compile_schedule(sched).program
    R = sched.num_ranks
    for trial in range(3):
        table = random_layer_table(rng, int(rng.integers(sched.num_stages + 1, 9)))
        speed = rng.choice([0.5, 1.0, 2.0], size=R)
        limit = np.full(R, np.nan)
        pb0 = Problem(sched, prog, table, speed, limit)
        if trial == 2:  # a limit that cuts off some splits, but not all
            peaks = sorted(max(pb0.memory((0, *c, pb0.L))) for c in itertools.combinations(range(1, pb0.L), pb0.S - 1))
            limit = np.full(R, peaks[len(peaks) // 2])
        pb = Problem(sched, prog, table, speed, limit)
        res = search(pb, time_limit=60)
        want = _brute(pb)
        assert res.optimal
        assert res.best.step == want.step, (trial, res.best.sizes, want.sizes)
        assert res.lower_bound == res.best.step
        assert res.best.fits and all(m <= x for m, x in zip(res.best.memory, limit) if not np.isnan(x))


def test_memory_is_the_memory_model():
    """The search's per-rank peaks equal pipec.sim.memory's for the split's bytes."""
    rng = np.random.default_rng(5)
    for name, params in CASES:
        sched = load(name, **params)
        pb = Problem(
            sched,
            compile_schedule(sched).program,
            random_layer_table(rng, 8),
            np.ones(sched.num_ranks),
            np.full(sched.num_ranks, np.nan),
        )
        for bounds in ((0, *range(1, pb.S), pb.L), pb.uniform()):
            want = [r.peak for r in rank_memory(pb.memory_schedule(bounds))]
            assert np.allclose(pb.memory(bounds), want, rtol=0, atol=1e-6)


def test_graph_is_the_simulator_with_free_communication():
    """The premise of the termination argument: with free messages the longest dependency path is the
    simulated step, on random splits."""
    rng = np.random.default_rng(7)
    for name, params in CASES:
        sched = load(name, **params)
        pb = Problem(
            sched,
            compile_schedule(sched).program,
            random_layer_table(rng, 9),
            rng.choice([0.5, 1.0], sched.num_ranks),
            np.full(sched.num_ranks, np.nan),
        )
        for _ in range(4):
            cuts = sorted(rng.choice(np.arange(1, pb.L), pb.S - 1, replace=False).tolist())
            bounds = (0, *cuts, pb.L)
            length, _ = pb.graph.paths(pb.stage_units(bounds))
            assert length * pb.unit == pb.evaluate(bounds).step


def test_slow_ranks_get_less_work():
    rows = [{"name": f"l{i}", "F": 1.0, "B": 2.0, "W": 1.0, "full_backward": 3.0} for i in range(16)]
    sched = load("1f1b", p=4, m=8)
    prog = compile_schedule(sched).program
    out = partition(sched, prog, make_table(rows), Ranks(speed=(1, 1, 0.5, 0.5)))
    sizes = out.result.best.sizes
    assert out.result.optimal
    assert sizes[2] + sizes[3] < sizes[0] + sizes[1]
    assert out.result.best.step < out.result.uniform.step


def test_no_split_fits_names_the_closest():
    rng = np.random.default_rng(3)
    sched = load("1f1b", p=2, m=4)
    with pytest.raises(PipecError) as e:
        partition(sched, compile_schedule(sched).program, random_layer_table(rng, 6), limit=10.0)
    assert e.value.code == "E806"
    assert "the closest" in str(e.value) and "on rank" in str(e.value)


def test_a_split_that_fits_is_found_when_the_starts_do_not_fit():
    """Rank 0 holds one layer's weights and gradients at most: the uniform, bottleneck and fluid splits give
    it three, so none of the search's starts fits. With no time for the branch and bound the search used to
    say E806 and name a split that fits as the closest; it starts from that split instead."""
    rows = [
        {"name": f"l{i}", "F": 1.0, "B": 2.0, "W": 1.0, "full_backward": 3.0, "param_bytes": 1000} for i in range(12)
    ]
    sched = load("1f1b", p=4, m=8)
    pb = Problem(
        sched, compile_schedule(sched).program, make_table(rows), np.ones(4), np.array([2000.0, 1e9, 1e9, 1e9])
    )
    assert not pb.evaluate(pb.uniform()).fits
    res = search(pb, time_limit=0.001)
    assert res.best.fits and res.best.sizes[0] == 1
    assert search(pb, time_limit=30).best.step <= res.best.step


def test_no_split_fits_is_proven_before_the_branch_and_bound():
    """One layer's weights alone are over rank 0's limit: E806 at once, from the closest split proven."""
    rows = [
        {"name": f"l{i}", "F": 1.0, "B": 2.0, "W": 1.0, "full_backward": 3.0, "param_bytes": 1000} for i in range(6)
    ]
    sched = load("1f1b", p=2, m=4)
    pb = Problem(sched, compile_schedule(sched).program, make_table(rows), np.ones(2), np.array([1500.0, 1e9]))
    with pytest.raises(PipecError) as e:
        search(pb, time_limit=0.001)
    assert e.value.code == "E806" and "rank 0" in str(e.value) and "not proven" not in str(e.value)


def test_more_stages_than_layers():
    sched = load("1f1b", p=4, m=4)
    with pytest.raises(PipecError) as e:
        partition(sched, compile_schedule(sched).program, random_layer_table(np.random.default_rng(0), 3))
    assert e.value.code == "E805"


def test_files_round_trip_and_refusals(tmp_path):
    table = random_layer_table(np.random.default_rng(1), 5)
    path = str(tmp_path / "t.json")
    write_json(path, table.to_json())
    back = read_table(path)
    assert back.names == table.names and back.fingerprint == table.fingerprint
    assert np.array_equal(back.F, table.F) and np.array_equal(back.act_bytes, table.act_bytes)

    doc = partition_doc(table, "1f1b", {"p": 2, "m": 4}, [["l0", "l1"], ["l2", "l3", "l4"]])
    ppath = str(tmp_path / "p.json")
    write_json(ppath, doc)
    part = read_partition(ppath)
    assert part.stages == (("l0", "l1"), ("l2", "l3", "l4"))
    part.check_model(table.fingerprint, table.names, "m.py")  # the same model: accepted
    part.check_stages(2, "1f1b")
    other = random_layer_table(np.random.default_rng(2), 5)  # same names, other shapes? same shapes: change a shape
    shapes = make_table([{"name": n, "params": [["weight", [9, 9]]]} for n in table.names])
    for fp, names in (
        (shapes.fingerprint, shapes.names),
        (random_layer_table(np.random.default_rng(2), 4).fingerprint, other.names[:4]),
    ):
        with pytest.raises(PipecError) as e:
            part.check_model(fp, names, "m.py")
        assert e.value.code == "E804"
    with pytest.raises(PipecError) as e:
        part.check_stages(4, "1f1b")
    assert e.value.code == "E805"

    bad = {
        "notjson.json": "{",
        "format.json": json.dumps({**doc, "format": "pipec-costs"}),
        "order.json": json.dumps({**doc, "stages": [["l1", "l0"], ["l2", "l3", "l4"]]}),
        "empty.json": json.dumps({**doc, "stages": [["l0", "l1", "l2", "l3", "l4"], []]}),
    }
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(PipecError) as e:
            read_partition(str(tmp_path / name))
        assert e.value.code == ("E810" if name == "order.json" else "E803"), name
    tdoc = table.to_json()
    tdoc["layers"][0]["F"] = -1
    (tmp_path / "neg.json").write_text(json.dumps(tdoc))
    with pytest.raises(PipecError) as e:
        read_table(str(tmp_path / "neg.json"))
    assert e.value.code == "E803"


def test_ranks_description(tmp_path):
    r = parse_ranks("speed=1,1,0.5,0.5 mem=16GiB,16GiB,8GiB,-")
    assert r.speeds(4).tolist() == [1, 1, 0.5, 0.5]
    assert r.limits(4)[:3].tolist() == [2.0**34, 2.0**34, 2.0**33] and np.isnan(r.limits(4)[3])
    (tmp_path / "r.toml").write_text('speed = [1, 0.5]\nmem = ["1GiB", "2GiB"]\n')
    assert parse_ranks(str(tmp_path / "r.toml")).limits(2).tolist() == [2.0**30, 2.0**31]
    for text in ("speed=0", "speed=1,x", "fast=1", "mem=lots"):
        with pytest.raises(PipecError) as e:
            parse_ranks(text)
        assert e.value.code == "E803", text
    with pytest.raises(PipecError):
        parse_ranks("speed=1,1,1").speeds(4)


def test_profile_partition_and_run_check(tmp_path, monkeypatch, capsys):
    """The whole path on the uneven example, small: profile its layers, partition, then train the split
    model in one process (2 ranks) with gradients equal to the single-process reference."""
    pytest.importorskip("torch")
    from pipec.cli.app import main

    monkeypatch.setenv("UNEVEN_BATCH", "16")
    monkeypatch.setenv("UNEVEN_HEAD", "256")
    from pipec.runtime.model.contract import load_model
    from pipec.runtime.profile.layers import profile_layers

    part, layers = str(tmp_path / "part.json"), str(tmp_path / "layers.json")
    write_json(layers, profile_layers(load_model("examples/uneven.py"), 2, reps=1, warmup=0, threads=1).to_json())
    args = ["partition", "1f1b", "-D", "p=2", "-D", "m=2", "--layers-cost", layers]
    assert main([*args, "-o", part]) == 0
    table = read_table(layers)
    assert table.names[0] == "embed" and table.names[-1] == "head"
    assert (table.act_bytes > 0).all() and (table.param_bytes > 0).all()
    out = capsys.readouterr().out
    assert "predicted step" in out and "uniform split" in out
    doc = json.loads(open(part).read())
    assert doc["format"] == "pipec-partition" and doc["model"]["fingerprint"] == table.fingerprint
    run = ["run", "1f1b", "-D", "p=2", "-D", "m=2", "--model", "examples/uneven.py", "--partition", part]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the run's model file goes
    assert main([*run, "--local", "--check", "--steps", "1"]) == 0
    assert "OK: largest relative error" in capsys.readouterr().out
    assert not list(tmp_path.glob("pipec-partition-*"))  # the run removed its folder (no atexit: os._exit)
    wrong = ["run", "1f1b", "-D", "p=3", "-D", "m=2", "--model", "examples/uneven.py", "--partition", part]
    assert main([*wrong, "--local", "--steps", "1"]) == 1
    assert "error[E805]" in capsys.readouterr().err
    monkeypatch.setenv("UNEVEN_HEAD", "128")  # other shapes: another model
    assert main([*run, "--local", "--steps", "1"]) == 1
    assert "error[E804]" in capsys.readouterr().err


def test_optimal_with_message_latency():
    """With a fixed latency on every message the bound closes too (within the rounding of the unit)."""
    from pipec.sim.cost_files import parse_overrides

    rng = np.random.default_rng(11)
    for name, params in CASES[1:3]:
        sched = load(name, **params)
        R = sched.num_ranks
        pb = Problem(
            sched,
            compile_schedule(sched).program,
            random_layer_table(rng, 7),
            np.ones(R),
            np.full(R, np.nan),
            [parse_overrides("latency=0.37")],
        )
        res = search(pb, time_limit=60)
        assert res.optimal and res.best.step == _brute(pb).step
        assert (
            res.best.step
            > Problem(sched, pb.program, pb.table, np.ones(R), np.full(R, np.nan)).evaluate(res.best.bounds).step
        )


def test_batched_lengths_are_the_graph_paths():
    """The local search's batched longest paths equal the graph's one-split `paths` (with latencies too)."""
    from pipec.sim.cost_files import parse_overrides

    rng = np.random.default_rng(13)
    for (name, params), docs in itertools.product(CASES, ((), (parse_overrides("latency=0.37"),))):
        sched = load(name, **params)
        R = sched.num_ranks
        pb = Problem(
            sched,
            compile_schedule(sched).program,
            random_layer_table(rng, 9),
            rng.choice([0.5, 1.0], R),
            np.full(R, np.nan),
            docs,
        )
        splits = np.array(
            [(0, *sorted(rng.choice(np.arange(1, pb.L), pb.S - 1, replace=False)), pb.L) for _ in range(6)]
        )
        want = [pb.graph.paths(pb.stage_units(b))[0] for b in splits]
        assert pb.graph.lengths(pb.batch_units(splits)).tolist() == want


def test_fluid_bound_is_below_every_split():
    """The fluid bound is a lower bound on the simulated step of every split (memory aside), above the
    work bound, and its rounded split is a split."""
    from pipec.sim.cost_files import parse_overrides

    rng = np.random.default_rng(17)
    for (name, params), docs in itertools.product(CASES, ((), (parse_overrides("latency=0.37"),))):
        sched = load(name, **params)
        prog = compile_schedule(sched).program
        R = sched.num_ranks
        for _ in range(2):
            pb = Problem(
                sched,
                prog,
                random_layer_table(rng, int(rng.integers(sched.num_stages + 1, 9))),
                rng.choice([0.5, 1.0, 2.0], R),
                np.full(R, np.nan),
                docs,
            )
            fb = fluid_bound(pb)
            steps = [pb.evaluate((0, *c, pb.L)).step for c in itertools.combinations(range(1, pb.L), pb.S - 1)]
            assert _work_bound(pb) <= fb.bound and fb.bound * pb.unit <= min(steps), (
                name,
                fb.bound * pb.unit,
                min(steps),
            )
            b = fb.rounded
            assert b[0] == 0 and b[-1] == pb.L and len(b) == pb.S + 1 and all(x < y for x, y in zip(b, b[1:]))


@pytest.mark.parametrize("time_limit", [0.0, 0.5])
def test_optimal_only_when_it_is(time_limit):
    """Whatever the time limit: "optimal" only when the split is brute force's best, and the bound always
    below brute force's best (a time limit of 0 leaves the starts and the fluid bound only)."""
    rng = np.random.default_rng(int(time_limit * 10) + 19)
    for name, params in CASES:
        sched = load(name, **params)
        prog = compile_schedule(sched).program
        R = sched.num_ranks
        for _ in range(2):
            pb = Problem(
                sched,
                prog,
                random_layer_table(rng, int(rng.integers(sched.num_stages + 2, 10))),
                rng.choice([0.5, 1.0, 2.0], R),
                np.full(R, np.nan),
            )
            res = search(pb, time_limit=time_limit)
            want = _brute(pb)
            assert res.lower_bound <= want.step <= res.best.step
            assert res.optimal == (res.lower_bound == res.best.step)
            if res.optimal:
                assert res.best.step == want.step


def test_optimal_with_message_overheads():
    """With a per-message overhead the simulator queues what the dependency graph does not (its paths
    fall short of the step), yet the branch and bound's exhausted tree is proof: brute force agrees."""
    from pipec.sim.cost_files import parse_overrides

    rng = np.random.default_rng(23)
    longer = 0
    for name, params in CASES:
        sched = load(name, **params)
        R = sched.num_ranks
        docs = [parse_overrides("overhead=0.3")]
        pb = Problem(
            sched, compile_schedule(sched).program, random_layer_table(rng, 7), np.ones(R), np.full(R, np.nan), docs
        )
        res = search(pb, time_limit=60)
        want = _brute(pb)
        assert res.optimal and res.best.step == want.step and res.lower_bound == want.step, name
        length = pb.graph.paths(pb.stage_units(want.bounds))[0] * pb.unit
        longer += want.step > length
    assert longer == len(CASES)  # in every case the graph alone could not have proven it


def test_propagation_keeps_every_split_within_the_budget():
    """`_propagate` removes a boundary value only when no split with it satisfies every row (paths of
    random splits, the rank chains, the fluid bound's weighted row, memory positions), says None exactly
    when no split satisfies them all, and its bound is at most every such split's longest path row."""
    rng = np.random.default_rng(29)
    removed = 0
    for name, params in CASES:
        sched = load(name, **params)
        prog = compile_schedule(sched).program
        R = sched.num_ranks
        table = random_layer_table(rng, int(rng.integers(sched.num_stages + 2, 9)))
        pb0 = Problem(sched, prog, table, rng.choice([0.5, 1.0, 2.0], R), np.full(R, np.nan))
        splits = [(0, *c, pb0.L) for c in itertools.combinations(range(1, pb0.L), pb0.S - 1)]
        peaks = sorted(max(pb0.memory(b)) for b in splits)
        pb = Problem(sched, prog, table, pb0.speed, np.full(R, peaks[len(peaks) // 2]))
        rows = _Rows(pb)
        fl = fluid_bound(pb)
        rows.add([(w, c, k) for w, (c, k) in zip(fl.weights, fl.paths)])
        for const, counts in pb.graph.rank_chains(R):
            rows.add([(1, const, counts)])
        for i in rng.choice(len(splits), min(3, len(splits)), replace=False).tolist():
            for const, counts in pb.graph.paths(pb.stage_units(splits[i]))[1]:
                rows.add([(1, const, counts)])
        rows.add_memory()
        s = np.arange(pb.S)
        paths = rows.weight > 0
        for budget in sorted(
            set(int(x) for x in np.quantile([pb.graph.paths(pb.stage_units(b))[0] for b in splits], [0, 0.3, 0.7]))
        ):
            lim = rows.limits(budget)
            allowed = np.zeros((pb.S + 1, pb.L + 1), dtype=bool)
            allowed[0, 0] = allowed[pb.S, pb.L] = True
            for t in range(1, pb.S):
                allowed[t, t : pb.L - pb.S + t + 1] = True
            before = allowed.copy()
            bound = _propagate(rows, allowed, budget)
            ok = []
            for b in splits:
                c = np.asarray(b)
                value = (rows.wq[:, s, c[1:]] - rows.wq[:, s, c[:-1]]).sum(axis=1)
                if np.all(value <= lim):
                    ok.append(b)
                    assert bound is not None and all(allowed[t, x] for t, x in enumerate(b)), (name, budget, b)
                    mean = -((-(value[paths] + rows.const[paths])) // rows.weight[paths])
                    assert bound <= mean.max()
            assert (bound is None) == (not ok), (name, budget)
            removed += int((before & ~allowed).sum()) if bound is not None else 1
    assert removed > 0  # the propagation did remove values: the check above is not vacuous


def test_without_or_tools_partition_says_which_extra_to_install(monkeypatch, tmp_path):
    """The quick start installs `.[runtime]` only: `pipec partition` then names the extra, before any work."""
    import importlib.util

    from cli_helpers import run_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ortools" else real(name, *a))
    table = tmp_path / "layers.json"
    write_json(str(table), random_layer_table(np.random.default_rng(0), 4).to_json())
    rc, out, err = run_cli("partition", "1f1b", "-D", "p=2", "-D", "m=4", "--layers-cost", str(table))
    assert rc == 2 and out == "", (rc, out, err)
    assert "needs OR-Tools" in err and "pip install 'pipec[synth]'" in err and "Traceback" not in err
