"""pipec profile's data-parallel collectives: the ring model's fit (exact on synthetic timings), one real
gloo measurement (positive, finite numbers; their size depends on the machine, so it is not asserted),
and the keys the cost file gets from them."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from runtime_harness import ROOT  # noqa: E402

from pipec.api import load  # noqa: E402
from pipec.ir.opcodes import REDUCE_GRAD, UNSHARD  # noqa: E402
from pipec.passes.compiler import compile_schedule  # noqa: E402
from pipec.runtime import load_model  # noqa: E402
from pipec.runtime.profile.collectives import (  # noqa: E402
    COLLECTIVES,
    Collectives,
    fit_ring,
    measure_collectives,
    ring_terms,
)
from pipec.runtime.profile.stages import profile, summary_lines  # noqa: E402
from pipec.sim.cost_files import dump_costs  # noqa: E402
from pipec.sim.costs import cost_model, ring_time  # noqa: E402

MODEL = str(ROOT / "examples" / "mlp.py")
SIZES = [4096 * 4**k for k in range(7)]


def model_time(kind: str, n: int, nbytes: float, latency: float, bandwidth: float) -> float:
    """The simulator's ring formula (pipec.sim.costs.ring_time) on n equal hops, bandwidth in bit/s."""
    return float(ring_time(kind, n, nbytes, [(latency, bandwidth / 8)] * n))


def test_ring_terms_are_the_simulators_model():
    # all-reduce 2(N-1) a + 2(N-1)/N B/b; all-gather and reduce-scatter (N-1) a + (N-1)/N B/b
    assert ring_terms("all_reduce", 4) == (6, 1.5)
    assert ring_terms("all_gather", 4) == ring_terms("reduce_scatter", 4) == (3, 0.75)
    assert model_time("all_reduce", 2, 1e6, 1e-4, 8e9) == pytest.approx(2 * 1e-4 + 1e6 * 8 / 8e9)
    with pytest.raises(ValueError, match="unknown collective"):
        ring_terms("broadcast", 2)
    # the fitted model predicts with the simulator's formula, bandwidth in bit/s
    c = Collectives(4, "ddp", 1e-4, 8e9, {}, {}, [], "synthetic")
    assert c.predict("all_reduce", 1e6) == pytest.approx(6 * 1e-4 + 1.5 * 1e6 * 8 / 8e9)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("latency,bandwidth", [(50e-6, 10e9), (2e-6, 1.6e12), (10e-3, 1e8)])
def test_the_fit_recovers_the_latency_and_bandwidth_of_synthetic_timings(n, latency, bandwidth):
    samples = [(k, n, b, model_time(k, n, b, latency, bandwidth)) for k in COLLECTIVES for b in SIZES]
    a, b = fit_ring(samples)
    assert a == pytest.approx(latency, rel=1e-9) and b == pytest.approx(bandwidth, rel=1e-9)
    # one kind alone determines them too
    a, b = fit_ring([s for s in samples if s[0] == "all_gather"])
    assert a == pytest.approx(latency, rel=1e-9) and b == pytest.approx(bandwidth, rel=1e-9)


def test_the_fit_keeps_both_terms_non_negative():
    # times that fall with size (noise on a busy machine) would fit a negative bandwidth: latency only
    samples = [("all_reduce", 2, b, 1e-3 - i * 1e-5) for i, b in enumerate(SIZES)]
    a, b = fit_ring(samples)
    assert a > 0 and b == math.inf
    # times proportional to size: no latency
    samples = [("all_gather", 2, b, b * 8 / 1e9 / 2) for b in SIZES]
    a, b = fit_ring(samples)
    assert a == pytest.approx(0, abs=1e-15) and b == pytest.approx(1e9)
    with pytest.raises(ValueError, match="no timed collective"):
        fit_ring([("all_reduce", 1, 4096, 1e-3)])


def _collectives(kind: str) -> Collectives:
    times = {k: {b: model_time(k, 2, b, 1e-4, 4e9) for b in (4096, 1000, 3000)} for k in COLLECTIVES}
    per_kind = {k: (1e-4, 4e9) for k in COLLECTIVES}
    return Collectives(2, kind, 1e-4, 4e9, times, per_kind, [1000, 3000], "synthetic")


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_the_cost_keys_of_the_collectives(kind):
    c = _collectives(kind)
    keys = c.cost_keys([1000, 3000])
    assert keys["param_bytes"] == [1000, 3000]
    assert keys["dp_latency"] == 1e-4 and keys["dp_bandwidth"] == 4e9
    reduce = "all_reduce" if kind == "ddp" else "reduce_scatter"
    assert keys["reduce_grad"] == pytest.approx([model_time(reduce, 2, b, 1e-4, 4e9) for b in (1000, 3000)], rel=1e-5)
    assert ("unshard" in keys) == (kind == "fsdp")
    if kind == "fsdp":
        assert keys["unshard"] == pytest.approx([model_time("all_gather", 2, b, 1e-4, 4e9) for b in (1000, 3000)])
    assert c.worst_fit_error() == pytest.approx(0, abs=1e-12)
    table = c.measured()
    assert table["bytes"] == [1000, 3000, 4096] and len(table["all_reduce_s"]) == 3


def test_the_cost_file_carries_the_collectives(small_mlp):
    """A profile with collectives writes them with the one writer (pipec.sim.cost_files.dump_costs)."""
    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    prof = profile(prog, load_model(MODEL), reps=1, warmup=0, comm=False, threads=1, concurrent=False)
    # 4 blocks of Linear(16, 16) and a Linear(16, 1), float64, over two stages
    assert prof.param_bytes == [2 * (16 * 16 + 16) * 8, (2 * (16 * 16 + 16) + 16 + 1) * 8]
    prof.collectives = _collectives("fsdp")
    doc = tomllib.loads(dump_costs(prof.cost_doc()))
    assert doc["param_bytes"] == prof.param_bytes and doc["dp_latency"] == 1e-4 and doc["dp_bandwidth"] == 4e9
    assert len(doc["reduce_grad"]) == len(doc["unshard"]) == 2
    assert doc["measured"]["collectives"]["how"] == "synthetic"
    assert "collectives on a data-parallel group of 2" in doc["comment"]
    for key in ("param_bytes", "dp_latency", "dp_bandwidth", "reduce_grad", "unshard", "dp_blocking"):
        assert key in doc["keys"]
    assert doc["dp_blocking"] == 1  # timed on gloo: FSDP2's collectives block the rank there
    assert "step" not in doc and "step_overhead" not in doc  # measured in situ only


def test_the_cost_file_carries_the_in_situ_steps(small_mlp):
    """An in-situ profile writes each stage's STEP time and the step's time outside the instructions."""
    from pipec.ir.program import BWD, FWD

    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    prof = profile(prog, load_model(MODEL), reps=1, warmup=0, comm=False, threads=1, concurrent=False)
    ops = {(FWD, 0): 1e-3, (FWD, 1): 1e-3, (BWD, 0): 2e-3, (BWD, 1): 2e-3}
    coll = {(REDUCE_GRAD, 0): 4e-3, (REDUCE_GRAD, 1): 5e-3}
    prof.in_situ = dict(ops=ops, overhead=None, step_s=0.02, steps=3, step={0: 3e-4, 1: 2e-4})
    prof.in_situ.update(collectives=coll, outside_s=1.5e-3)
    doc = read_cost_text(dump_costs(prof.cost_doc()))
    assert doc["step"] == [3e-4, 2e-4] and doc["step_overhead"] == 1.5e-3
    assert "dp_blocking" not in doc  # no collectives timed
    raw = tomllib.loads(dump_costs(prof.cost_doc()))
    assert raw["measured"]["in_situ"]["reduce_grad"] == [4e-3, 5e-3] and "unshard" not in raw["measured"]["in_situ"]


def test_with_more_processes_than_cpus_the_in_situ_costs_are_the_ops_cpu_shared_out(small_mlp):
    """Where the in-situ run's processes outnumbered the CPUs (`shared`), F and B are the CPU the ops took,
    the cost file says how many processes share how many cores (the simulator shares them out) and the
    overhead is the one with the stalls. Otherwise the wall-time medians and no sharing; `measured.in_situ`
    keeps the medians, the means and the CPU either way."""
    from pipec.ir.program import BWD, FWD

    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    prof = profile(prog, load_model(MODEL), reps=1, warmup=0, comm=False, threads=1, concurrent=False)
    prof.ranks_per_node, prof.cores_per_node = 2, 1
    ops = {(FWD, 0): 1e-3, (FWD, 1): 1e-3, (BWD, 0): 2e-3, (BWD, 1): 2e-3}
    means = {k: 1.5 * v for k, v in ops.items()}
    cpu = {k: 0.5 * v for k, v in ops.items()}
    prof.in_situ = dict(ops=ops, ops_mean=means, ops_cpu=cpu, overhead=5e-5, overhead_with_stalls=4e-4)
    prof.in_situ.update(step_s=0.02, steps=3)
    for shared, F, B in ((False, [1e-3, 1e-3], [2e-3, 2e-3]), (True, [5e-4, 5e-4], [1e-3, 1e-3])):
        prof.in_situ["shared"] = shared
        raw = tomllib.loads(dump_costs(prof.cost_doc()))
        assert raw["F"] == pytest.approx(F) and raw["B"] == pytest.approx(B)
        assert ("cores_per_node" in raw) == shared and ("CPU they took" in raw["comment"]) == shared
        if shared:
            assert (raw["ranks_per_node"], raw["cores_per_node"]) == (2, 1)
        situ = raw["measured"]["in_situ"]
        assert situ["forward"] == pytest.approx([1e-3, 1e-3]) and situ["forward_cpu"] == pytest.approx([5e-4, 5e-4])
        assert situ["forward_mean"] == pytest.approx([1.5e-3, 1.5e-3])
        assert (situ["overhead"], situ["overhead_with_stalls"]) == (5e-5, 4e-4)
    costs = cost_model(load("1f1b", p=2, m=2), [read_cost_text(dump_costs(prof.cost_doc()))])
    assert (costs.ranks_per_node, costs.cores_per_node) == (2, 1)  # the simulator reads the sharing


def test_a_real_gloo_measurement_gives_positive_finite_numbers():
    c = measure_collectives(2, kind="fsdp", sizes=(4096, 262144), stage_bytes=[10000], reps=3, warmup=1)
    assert c.size == 2 and set(c.times) == set(COLLECTIVES)
    for per in c.times.values():
        assert sorted(per) == [4096, 10000, 262144]
        assert all(0 < t < 10 and math.isfinite(t) for t in per.values())
    assert 0 <= c.latency < 1 and math.isfinite(c.latency)
    assert c.bandwidth > 0  # inf when the sizes' times did not grow (noise on a busy machine)
    assert c.stage_times("all_gather") == [c.times["all_gather"][10000]]
    assert "gloo, 1 group(s) of 2 local processes" in c.how


def test_the_profile_of_a_program_without_data_parallelism_has_no_collectives(small_mlp, no_link):
    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    prof = profile(prog, load_model(MODEL), reps=1, warmup=0, comm=True, threads=1, concurrent=False, dp=1)
    assert prof.collectives is None
    doc = prof.cost_doc()
    assert "dp_latency" not in doc and "param_bytes" not in doc


def test_dp_must_be_a_size_and_a_kind():
    from pipec.runtime.errors import PipelineError

    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    with pytest.raises(PipelineError, match="dp_kind one of ddp, fsdp"):
        profile(prog, load_model(MODEL), comm=False, dp=2, dp_kind="zero3")


@pytest.fixture
def no_link(monkeypatch):
    """The point-to-point link's measurement (tested in tests/runtime/test_runtime_profile.py) left out."""
    monkeypatch.setattr("pipec.runtime.profile.stages.measure_link", lambda *a, **k: (None, None, None, "not measured"))


def test_profile_with_dp_times_the_collectives_of_each_stage(small_mlp, no_link, monkeypatch):
    monkeypatch.setattr(
        "pipec.runtime.profile.collectives.COLLECTIVE_SIZES", (4096, 65536)
    )  # the stages' sizes are timed too
    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    said: list[str] = []
    prof = profile(
        prog,
        load_model(MODEL),
        reps=1,
        warmup=0,
        threads=1,
        concurrent=False,
        dp=2,
        dp_kind="ddp",
        progress=said.append,
    )
    assert prof.collectives is not None and prof.collectives.stage_bytes == prof.param_bytes
    assert said[-1] == "timing all-reduce, all-gather and reduce-scatter on a data-parallel group of 2 gloo processes"
    doc = prof.cost_doc()
    assert doc["param_bytes"] == prof.param_bytes and "unshard" not in doc  # ddp: no all-gather
    assert all(t > 0 for t in doc["reduce_grad"]) and doc["dp_latency"] >= 0 and doc["dp_bandwidth"] > 0
    assert "bound as 4 ranks of a run" in prof.info["collectives"]  # p=2 x dp=2 on this machine
    text = "\n".join(summary_lines(prof))
    assert "collectives (gloo" in text and "reduce_grad ms" in text


@pytest.mark.slow  # in situ: test_runtime_profile's; dp collectives: test_profile_with_dp_times_the_collectives
def test_in_situ_profile_of_a_pp_x_dp_program_runs_every_replica(small_mlp):
    """--in-situ with data parallelism runs the p x dp processes on a ("pp", "dp") mesh, as pipec run --dp
    does, and takes the ops from replica 0."""
    from pipec.api import compile as compile_program
    from pipec.ir.dataparallel import DataParallel
    from pipec.ir.program import BWD, FWD
    from pipec.runtime.errors import PipelineError
    from pipec.runtime.profile.insitu import profile_in_situ

    prog = compile_program("1f1b", {"p": 2, "m": 2}, data_parallel=DataParallel(2, "fsdp"))
    situ = profile_in_situ(prog, MODEL, reps=1, warmup=0, timeout=120)
    assert situ["steps"] == 1 and situ["step_s"] > 0
    assert sorted(situ["ops"]) == [(FWD, 0), (FWD, 1), (BWD, 0), (BWD, 1)]  # both stages' F and B
    # and what the run adds around them: each stage's STEP, its collectives, the time outside
    assert sorted(situ["step"]) == [0, 1] and all(t > 0 for t in situ["step"].values())
    assert sorted(situ["collectives"]) == [(REDUCE_GRAD, 0), (REDUCE_GRAD, 1), (UNSHARD, 0), (UNSHARD, 1)]
    assert all(t > 0 for t in situ["collectives"].values())
    assert 0 < situ["outside_s"] < situ["step_s"]
    # each replica's own op times, replica 0's first (they are the cost keys)
    assert len(situ["ops_by_replica"]) == 2 and situ["ops_by_replica"][0] == situ["ops"]
    assert sorted(situ["ops_by_replica"][1]) == sorted(situ["ops"])
    assert all(t > 0 for t in situ["ops"].values())
    with pytest.raises(PipelineError, match="--in-situ runs the Program as compiled"):
        profile(prog, load_model(MODEL), comm=False, in_situ=True, dp=1)


def read_cost_text(text: str) -> dict:
    import tempfile

    from pipec.sim.cost_files import read_cost_file

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.toml"
        path.write_text(text)
        return read_cost_file(path)


def test_an_ops_cpu_counts_the_transfer_threads_cpu_for_its_all_to_alls():
    from pipec.ir.opcodes import BWD, FWD
    from pipec.runtime.profile.insitu import ops_cpu

    # rank 0, one step: F(mb 0, stage 1) 2 ms of its own and two all-to-alls of 0.25 ms on the transfer
    # thread; F(mb 1, stage 1) 4 ms and none; B(mb 0, stage 1) 3 ms and one of 0.5 ms; another op's all-to-all
    # (mb 1 of stage 0) is not theirs.
    evs = [
        ("compute", FWD, 0, 1, 0.0, 0.01, 0.002),
        ("alltoall", FWD, 0, 1, 0, 0.0, 0.005, 64, 0.00025),
        ("alltoall", FWD, 0, 1, 1, 0.005, 0.01, 64, 0.00025),
        ("compute", FWD, 1, 1, 0.01, 0.02, 0.004),
        ("compute", BWD, 0, 1, 0.02, 0.03, 0.003),
        ("alltoall", BWD, 0, 1, 0, 0.02, 0.03, 64, 0.0005),
        ("alltoall", FWD, 1, 0, 0, 0.02, 0.03, 64, 0.001),
    ]
    got = ops_cpu([[evs]])
    assert got[(FWD, 1)] == pytest.approx((0.0025 + 0.004) / 2)
    assert got[(BWD, 1)] == pytest.approx(0.0035)
    assert (FWD, 0) not in got


def test_the_pairs_handoff_is_the_mean_wake_up_and_none_without_pairs():
    from pipec.runtime.profile.insitu import handoff

    assert handoff([[[("handoff", 0.001), ("compute", 0, 0, 0, 0.0, 1.0, 1.0)]], [[("handoff", 0.003)]]]) == 0.002
    assert handoff([[[("compute", 0, 0, 0, 0.0, 1.0, 1.0)]]]) is None
