"""pipec profile: the cost file it writes is one the simulator reads, with the schedule's stages, its kind of
backward and the message sizes of the model (timings are not asserted: they depend on the machine)."""

from __future__ import annotations

import json
import math
import tomllib

import pytest

torch = pytest.importorskip("torch")

from runtime_harness import ROOT  # noqa: E402

from pipec.api import load  # noqa: E402
from pipec.cli.app import main  # noqa: E402
from pipec.passes.compiler import compile_schedule  # noqa: E402
from pipec.runtime import load_model  # noqa: E402
from pipec.runtime.profile.links import measure_link  # noqa: E402
from pipec.runtime.profile.stages import profile  # noqa: E402
from pipec.sim.cost_files import dump_costs, read_cost_file  # noqa: E402
from pipec.sim.costs import cost_model  # noqa: E402

MODEL = str(ROOT / "examples" / "mlp.py")


def _simulate(capsys, args: list[str]) -> dict:
    capsys.readouterr()
    assert main(["simulate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["results"][0]


@pytest.mark.parametrize(
    "name,params,split",
    [
        ("1f1b", ["p=2", "m=4"], False),
        ("zb-h1", ["p=2", "m=4"], True),
        ("interleaved-1f1b", ["p=2", "v=2", "m=4"], False),
    ],
)
def test_profile_round_trips_through_the_simulator(tmp_path, capsys, small_mlp, name, params, split):
    out = tmp_path / "costs.toml"
    defines = [x for kv in params for x in ("-D", kv)]
    argv = ["profile", name, *defines, "--model", MODEL, "-o", str(out), "--reps", "2", "--warmup", "0", "--no-comm"]
    argv.append("--one-process")  # the file's contents are the point here; the concurrent timing is tested below
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and f"pipec simulate {name}" in printed
    doc = read_cost_file(out)  # the simulator's own reader
    S = compile_schedule(load(name, **dict(kv.split("=") for kv in params))).program.num_stages
    assert len(doc["F"]) == len(doc["B"]) == S and all(x > 0 for x in doc["F"])
    assert ("W" in doc) == split  # without split backward, B is the full backward
    # 16 float64 columns, 2 rows per micro-batch, between every pair of neighbouring stages
    assert doc["act_bytes"] == [2 * 16 * 8] * (S - 1) + [0]
    assert doc["grad_bytes"] == [0] + [2 * 16 * 8] * (S - 1)
    assert "latency" not in doc and "overhead" not in doc  # --no-comm
    sim = _simulate(capsys, [name, *defines, "--cost", str(out)])
    costs = sim["costs"]
    as_list = lambda v: v if isinstance(v, list) else [v] * S  # noqa: E731
    assert as_list(costs["F"]) == pytest.approx(doc["F"])
    assert as_list(costs["B"]) == pytest.approx(doc["B"])
    assert costs["full_backward"] == (None if split else "B + W")
    if not split:
        assert as_list(costs["W"]) == [0.0] * S
    assert sim["makespan"] > 0 and math.isfinite(sim["makespan"])
    # the same numbers through the cost model directly
    cm = cost_model(load(name, **dict(kv.split("=") for kv in params)), [doc])
    assert list(cm.F) == pytest.approx(doc["F"])


def test_profile_json_and_measured_tables(tmp_path, capsys, small_mlp):
    out = tmp_path / "costs.json"
    argv = ["profile", "zb-v", "-D", "p=2", "-D", "m=4", "--model", MODEL, "-o", str(out), "--reps", "1"]
    assert main([*argv, "--warmup", "0", "--no-comm", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    doc = json.loads(out.read_text())
    assert doc["format"] == "pipec-costs" and doc["schedule"] == "zb-v"
    stages = doc["measured"]["stages"]
    for key in ("forward", "full_backward", "input_backward", "weight_backward", "optimizer_step"):
        assert len(stages[key]) == 4
    assert stages["input_backward"] == doc["B"] and stages["weight_backward"] == doc["W"]
    assert doc["measured"]["run"]["threads"] >= 1
    assert printed["costs"]["F"] == doc["F"]
    read_cost_file(out)


def test_profile_api_and_the_link(small_mlp):
    model = load_model(MODEL)
    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    prof = profile(prog, model, reps=1, warmup=0, comm=False, threads=1)
    assert prof.latency is None and len(prof.forward) == 2
    assert prof.info["threads"] == 1 and prof.info["dtype"] == "float64"
    # deliveries in runs of the runtime between two fresh processes (on its local transport): a positive
    # one-way time; the runtime's own time per send or receive instruction is positive, and far below a second
    latency, bandwidth, overhead, how = measure_link(4096, reps=3, gap=1e-4)
    assert how == "deliveries in runs of the runtime"  # every receiver waited: no fallback to a ping-pong
    assert latency is not None and 0 < latency < 1.0
    assert bandwidth is None or bandwidth > 0
    assert overhead is not None and 0 < overhead < 0.1


def test_profile_refuses_a_bad_model(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("def build_stage(stage):\n    pass\n")
    assert main(["profile", "1f1b", "-D", "p=2", "--model", str(bad), "--no-comm"]) == 1
    err = capsys.readouterr().err
    assert "pipec profile: error:" in err and "missing `loss_fn" in err


# ---- the overhead estimate and the in-situ profile --------------------------------------------------------


def _gpipe_step(grad1_sent: float = 0.00702, b1_start: float = 0.01108):
    """One hand-timed GPipe step (p=2, m=2; see `pipec compile gpipe -D p=2 -D m=2`). Rank 0's gap before
    FWD 1 holds one send (50 us), its gap before BWD 1 one receive (80 us), and rank 1's gap before BWD 1
    one send (60 us); the other gaps hold no transfer or a send and a receive together."""
    from pipec.runtime.exec.measure import timeline

    prog = compile_schedule(load("gpipe", p=2, m=2)).program
    r0 = [
        ("compute", 0, 0, 0, 0.0, 0.001),
        ("send", 0, 0, 0, 1, 0.00102, 8),
        ("compute", 0, 1, 0, 0.00105, 0.002),
        ("send", 0, 1, 0, 1, 0.00201, 8),
        ("recv", 1, 0, 1, 1, 0.0101),
        ("compute", 1, 0, 0, 0.0101, 0.011),
        ("recv", 1, 1, 1, 1, b1_start),
        ("compute", 1, 1, 0, b1_start, b1_start + 0.001),
    ]
    r1 = [
        ("recv", 0, 0, 0, 0, 0.003),
        ("compute", 0, 0, 1, 0.003, 0.004),
        ("recv", 0, 1, 0, 0, 0.004),
        ("compute", 0, 1, 1, 0.004, 0.005),
        ("compute", 1, 0, 1, 0.005, 0.006),
        ("send", 1, 0, 1, 0, 0.00602, 8),
        ("compute", 1, 1, 1, 0.00606, 0.007),
        ("send", 1, 1, 1, 0, grad1_sent, 8),
    ]
    return prog, timeline(prog, [r0, r1])


def test_the_overhead_is_the_mean_send_and_receive_gap_per_instruction():
    from pipec.runtime.profile.overhead import per_instruction

    prog, tl = _gpipe_step()
    assert per_instruction(prog, [tl]) == pytest.approx(((50e-6 + 60e-6) / 2 + 80e-6) / 2)
    # a receive gap whose message was sent just before the gap may hold a wait: left out
    prog, tl = _gpipe_step(grad1_sent=0.01095)
    assert per_instruction(prog, [tl]) == pytest.approx((50e-6 + 60e-6) / 2)
    # a gap of over 1 ms per instruction is a stall, not an overhead: left out
    prog, tl = _gpipe_step(b1_start=0.0125)
    assert per_instruction(prog, [tl]) == pytest.approx((50e-6 + 60e-6) / 2)
    # two steps: the means are over both
    prog, late = _gpipe_step(b1_start=0.01104)
    assert per_instruction(prog, [_gpipe_step()[1], late]) == pytest.approx((55e-6 + 60e-6) / 2)
    # where ranks share cores the stalls are part of the cost: with no stall bound the 1 ms gap counts
    prog, tl = _gpipe_step(b1_start=0.0125)
    assert per_instruction(prog, [tl], stall=math.inf) > per_instruction(prog, [tl]) + 1e-4


def test_in_situ_profile_takes_the_ops_from_runs_of_the_schedule(tmp_path, capsys, small_mlp):
    out = tmp_path / "costs.toml"
    argv = ["profile", "zb-h1", "-D", "p=2", "-D", "m=4", "--model", MODEL, "-o", str(out), "--reps", "3"]
    assert main([*argv, "--warmup", "1", "--no-comm", "--in-situ"]) == 0
    printed = capsys.readouterr().out
    assert "in situ, 3 steps of zb-h1" in printed and "(in situ)" in printed
    doc = tomllib.loads(out.read_text())
    situ = doc["measured"]["in_situ"]
    assert doc["F"] == situ["forward"] and doc["B"] == situ["backward"] and doc["W"] == situ["weight_backward"]
    assert situ["steps"] == 3 and situ["step"] > 0
    assert all(x > 0 for x in doc["F"] + doc["B"] + doc["W"])  # the first stage's BWD is tiny, but timed
    assert doc["measured"]["stages"]["forward"] != doc["F"]  # the one-op-at-a-time tables are kept apart
    for name in ("forward", "backward", "weight_backward"):  # the main thread's CPU per op: at most its time
        assert all(0 < c <= w + 1e-4 for c, w in zip(situ[f"{name}_cpu"], situ[f"{name}_mean"])), name
    assert 0 < doc["overhead"] < 0.1  # the overhead comes from the runs themselves
    # and the latency from the messages the run sent to a waiting receiver (no bandwidth measured: all of it)
    assert situ["deliveries"] > 0 and doc["latency"] == pytest.approx(situ["delivery_s"], rel=1e-5)
    assert "latency from" in doc["comment"]
    assert "in situ, medians over 3 steps" in doc["comment"]
    assert read_cost_file(out)["F"] == doc["F"]  # what the simulator reads
    sim = _simulate(capsys, ["zb-h1", "-D", "p=2", "-D", "m=4", "--cost", str(out)])
    assert sim["costs"]["overhead"] == pytest.approx(doc["overhead"])


def test_in_situ_profile_is_for_gloo_on_cpu(small_mlp):
    from pipec.runtime.errors import PipelineError

    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    with pytest.raises(PipelineError, match="--in-situ runs the schedule on gloo processes"):
        profile(prog, load_model(MODEL), device="cuda", in_situ=True, comm=False)


@pytest.mark.parametrize(
    "fault,culprit",
    [
        ("raise", "rank 1: RuntimeError: injected failure"),
        # a dead rank named: test_runtime_dist's test_rank_that_dies_stops_every_rank
        pytest.param("exit", "rank 1 died (exit status 3)", marks=pytest.mark.slow),
    ],
)
def test_in_situ_profile_names_the_rank_that_failed(monkeypatch, fault, culprit):
    from pipec.runtime.errors import PipelineError
    from pipec.runtime.profile.insitu import profile_in_situ

    for k, v in {"PIPEC_FAULT": fault, "PIPEC_FAULT_STAGE": "1", "PIPEC_FAULT_CALL": "2"}.items():
        monkeypatch.setenv(k, v)
    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    with pytest.raises(PipelineError) as err:
        profile_in_situ(prog, str(ROOT / "tests" / "models" / "faulty.py"), reps=2, warmup=1, timeout=60)
    message = str(err.value)
    assert message.startswith(f"the in-situ profile of 1f1b failed: {culprit}; rank 0: CommError: "), message


@pytest.mark.slow  # in situ faults: test_in_situ_profile_names_the_rank_that_failed
def test_in_situ_profile_gives_up_on_a_hung_rank_after_the_timeout(monkeypatch):
    import time

    from pipec.runtime.errors import PipelineError
    from pipec.runtime.profile.insitu import profile_in_situ

    for k, v in {"PIPEC_FAULT": "hang", "PIPEC_FAULT_STAGE": "1", "PIPEC_FAULT_CALL": "2"}.items():
        monkeypatch.setenv(k, v)
    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    t0 = time.monotonic()
    with pytest.raises(PipelineError) as err:
        profile_in_situ(prog, str(ROOT / "tests" / "models" / "faulty.py"), reps=2, warmup=1, timeout=5)
    message = str(err.value)
    assert "rank 0: CommError: " in message and "from rank 1 failed: timed out after 5 s" in message, message
    assert time.monotonic() - t0 < 40  # the timeout, start-up and teardown; not the hung rank's hour


@pytest.mark.slow  # the concurrent default runs in test_profile_json_and_measured_tables
def test_concurrent_timing_keeps_each_stages_times_from_its_owner(small_mlp):
    """The default on CPUs: one process per rank times every stage at once; each stage's times come from
    the process of the rank that owns it (zb-v, p=2: stages 0 and 3 on rank 0, 1 and 2 on rank 1)."""
    from pipec.runtime.profile.stages import Profile, merge_by_owner

    def fake(rank: int) -> Profile:
        t = [10.0 * rank + s for s in range(4)]
        return Profile("zb-v", (), True, t, t, t, t, t, [1, 1, 1, 0], [0, 1, 1, 1], {"rank": rank})

    merged = merge_by_owner([fake(0), fake(1)], (0, 1, 1, 0))
    assert merged.forward == merged.optimizer_step == [0.0, 11.0, 12.0, 3.0]
    assert merged.info == {"rank": 0} and merged.act_bytes == [1, 1, 1, 0]
    prog = compile_schedule(load("zb-v", p=2, m=4)).program
    said: list[str] = []
    prof = profile(prog, load_model(MODEL), reps=2, warmup=0, comm=False, concurrent=True, progress=said.append)
    assert said == ["timing each op of 4 stages in 2 processes at once, 0 + 2 rounds"]
    doc = prof.cost_doc()
    assert doc["measured"]["run"]["timing"] == "2 processes, one per rank, at once"
    assert len(doc["F"]) == 4 and all(x > 0 for x in doc["F"] + doc["W"])


def test_a_profile_taken_in_turns_says_the_ranks_share_the_cores_and_one_taken_at_once_does_not():
    from pipec.runtime.profile.stages import Profile

    t = [0.01, 0.02]
    prof = Profile("1f1b", (("p", 2),), False, t, t, t, t, t, [1, 0], [0, 1], {}, ranks_per_node=4, cores_per_node=2)
    doc = prof.cost_doc()
    assert (doc["ranks_per_node"], doc["cores_per_node"]) == (4, 2) and "4 processes share 2 cores" in doc["comment"]
    alone = Profile("1f1b", (("p", 2),), False, t, t, t, t, t, [1, 0], [0, 1], {})
    assert "cores_per_node" not in alone.cost_doc()


@pytest.mark.slow  # 4 spawned processes; the concurrent default runs in test_profile_json_and_measured_tables
def test_more_processes_than_cpus_time_in_turns_and_the_file_says_they_share_the_cores(
    small_mlp, monkeypatch, tmp_path
):
    """4 ranks on 2 CPUs: two processes time at once, then the other two (not four slowed by each other);
    the cost file records the sharing for the simulator (docs/simulate.md, "Ranks that share cores")."""
    from pipec.runtime.profile import stages

    monkeypatch.setattr(stages, "allowed_cpus", lambda: [0, 1])  # this machine's 2, whatever runs the test
    sched = load("1f1b", p=4, m=4)
    prof = profile(compile_schedule(sched).program, load_model(MODEL), reps=2, warmup=0, comm=False, concurrent=True)
    doc = prof.cost_doc()
    assert doc["measured"]["run"]["timing"] == "4 processes, one per rank, in turns of 2 (the CPUs)"
    assert (doc["ranks_per_node"], doc["cores_per_node"]) == (4, 2)
    (tmp_path / "costs.toml").write_text(dump_costs(doc))
    costs = cost_model(sched, [read_cost_file(tmp_path / "costs.toml")])
    assert costs.shares_cores and (costs.ranks_per_node, costs.cores_per_node) == (4, 2)


def test_a_delivery_counts_only_when_the_receiver_was_waiting():
    """Rank 1 computes until 1.0: a message sent at 0.5 and received at 1.2 says nothing about the link (it
    waited for the receiver); one sent at 2.0 and received at 2.5 took 0.5 to arrive."""
    from types import SimpleNamespace

    import numpy as np

    from pipec.runtime.profile.overhead import deliveries

    a = lambda *x: np.array(x, dtype=float)  # noqa: E731
    tl = SimpleNamespace(
        num_ranks=2,
        rank=np.array([0, 1, 1]),
        start=a(0.0, 0.0, 2.5),
        end=a(0.4, 1.0, 3.0),
        msg_dst=np.array([1, 1]),
        msg_send=a(0.5, 2.0),
        msg_arrival=a(1.2, 2.5),
        msg_bytes=a(100, 300),
    )
    assert deliveries([tl]) == {"median_s": 0.5, "bytes": 300.0, "count": 1}
    tl.msg_send = a(1.1, 2.0)  # sent after rank 1's compute ended: both count
    assert deliveries([tl])["count"] == 2
