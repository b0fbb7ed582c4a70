"""Mixture of experts on the runtime (issue 28): experts sharded over expert groups of 2 replicas (--ep 2,
folded into --dp 2) x a pipeline of 2 ranks, 4 gloo processes, examples/moe.py (routing included).

After 3 steps, gradients (every step) and parameters must equal a single-process float64 run of the same
MoE model over the whole batch to 1e-10 (`--check`), for 1F1B, dualpipe-v (overlapped F & B pairs) and an
combined 1F1B (schedules/combined-1f1b.pipe: interleaved 1F1B with pairs), with odd MoE layer counts (stages with
different counts, so a pair's two ops issue different numbers of all-to-alls). Overlapped and --no-overlap
runs give the same losses. Refusals come before any step, naming what is wrong. Unit cases check the baton
(pipec.runtime.exec.pairs) against pipec.ir.experts.pair_order with real threads, and the pieces of
pipec.runtime.exec.alltoall that need no process group.

The default run has two multi-process cases (dualpipe-v with an odd layer count, overlapped and not; the
members' layer mismatch); the rest is behind `-m slow`:

    pytest tests/runtime/test_moe.py -m slow -p no:cacheprovider -n 0
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from runtime_harness import ROOT, launch  # noqa: E402

from pipec.ir.experts import pair_order  # noqa: E402
from pipec.options import RunOptions  # noqa: E402
from pipec.runtime.errors import CollectiveError, PipelineError  # noqa: E402
from pipec.runtime.exec.alltoall import HEADER, ExpertGroup, _regroup  # noqa: E402
from pipec.runtime.exec.links import Links  # noqa: E402
from pipec.runtime.exec.pairs import Baton, PairRunner  # noqa: E402
from pipec.runtime.model.moe import check_experts, digest, expert_modules  # noqa: E402

MODEL = str(ROOT / "examples" / "moe.py")
EP = ["--dp", "2", "--ep", "2", "--experts", "4"]
SMALL = {"MOE_BATCH": "8", "MOE_CONTEXT": "6"}
COMPUTES = ("FWD", "BWD", "WGRAD")
STEP = re.compile(r"^step (\d+)/\d+: loss (\S+),", re.M)


def run_check(schedule: str, *extra: str, env: dict[str, str] | None = None, timeout: float = 240.0) -> str:
    """A 4-process --check run of examples/moe.py; its output (rank 0's), asserted OK at 1e-10."""
    argv = [schedule, "-D", "p=2", "-D", "m=4", "--model", MODEL, *EP, "--steps", "3", "--check", *extra]
    results, _, _ = launch(4, "launch", argv, env={**SMALL, **(env or {})}, timeout=timeout)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stdout}\n{r.stderr[-3000:]}"
    out = results[0].stdout
    assert re.search(r"OK: largest relative error \S+ \(tolerance 1e-10\)", out), out
    assert "experts over groups of 2 replicas" in out, out
    return out


def losses(out: str) -> list[str]:
    return [m.group(2) for m in STEP.finditer(out)]


def overlapping_ops(trace: str, rank: int = 0) -> int:
    """Pairs of compute ops of one rank whose measured spans intersect (a --trace file, Chrome format)."""
    with open(trace) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    computes = [e for e in events if e.get("ph") == "X" and e.get("pid") == rank and e.get("cat") in COMPUTES]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in computes)
    return sum(1 for a, b in zip(spans, spans[1:]) if b[0] < a[1])


def test_dualpipe_v_odd_layers_exact_overlapped_and_not(tmp_path):
    """3 MoE layers over 4 stages (1, 1, 1, 0): dualpipe-v's pairs join ops with 2 and 0 all-to-alls as well
    as 2 and 2. Both runs equal the reference, and each other step by step. Overlapped, the two ops of a
    pair run at once (their spans intersect, as the baton makes them: the second starts at the first's
    first all-to-all); with --no-overlap no two ops of a rank do."""
    env = {"MOE_LAYERS": "3"}
    over = run_check("dualpipe-v", "--trace", str(tmp_path / "over.json"), env=env)
    assert "(pairs overlapped)" in over
    plain = run_check("dualpipe-v", "--no-overlap", "--trace", str(tmp_path / "plain.json"), env=env)
    assert "(pairs one op after the other)" in plain
    assert losses(over) == losses(plain) and len(losses(over)) == 3, (over, plain)
    assert overlapping_ops(str(tmp_path / "over.json")) > 0
    assert overlapping_ops(str(tmp_path / "plain.json")) == 0


def test_members_building_different_moe_layers_are_refused_before_any_step():
    env = {**SMALL, "MOE_MISMATCH": "layers"}
    argv = ["1f1b", "-D", "p=2", "-D", "m=2", "--model", str(ROOT / "tests/models/moe_mismatch.py"), *EP]
    results, _, _ = launch(4, "launch", argv, env=env, timeout=120)
    assert all(r.returncode != 0 for r in results)
    text = "".join(r.stdout + r.stderr for r in results)
    # the compile-time check's diagnostic (pipec.passes.experts.order_error), located at the op of 1f1b's
    # source that issues the first all-to-all where the replicas part
    assert re.search(r"<library>/1f1b\.pipe:\d+:\d+: error\[E427\]: the ranks of an expert group would issue", text)
    assert "ranks 0 and 1 (replicas of pipeline rank 0)" in text and "rank 0 [1], rank 1 [2]" in text, text
    assert "step 1/" not in text, text


@pytest.mark.slow  # the default twin: test_dualpipe_v_odd_layers_exact_overlapped_and_not
def test_1f1b_exact():
    run_check("1f1b")


@pytest.mark.slow  # the default twin: test_dualpipe_v_odd_layers_exact_overlapped_and_not
def test_combined_1f1b_odd_layers_exact_overlapped_and_not():
    """The library's combined 1F1B (interleaved 1F1B whose steady state pairs F & B, v = 2), 5 MoE layers
    over 4 stages (2, 1, 1, 1)."""
    env = {"MOE_LAYERS": "5"}
    over = run_check("combined-1f1b", env=env)
    plain = run_check("combined-1f1b", "--no-overlap", env=env)
    assert losses(over) == losses(plain)


@pytest.mark.slow  # the default twin: test_dualpipe_v_odd_layers_exact_overlapped_and_not
def test_two_expert_groups_exact():
    """--dp 4 --ep 2 (8 processes): two expert groups per pipeline rank, whose members at one place sum
    their expert gradients (ExpertGrads' replica group) before the division by the dp size."""
    argv = ["1f1b", "-D", "p=2", "-D", "m=2", "--model", MODEL, "--dp", "4", "--ep", "2", "--experts", "4"]
    results, _, _ = launch(8, "launch", [*argv, "--steps", "2", "--check"], env=SMALL, timeout=300)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stdout}\n{r.stderr[-3000:]}"
    assert re.search(r"OK: largest relative error \S+ \(tolerance 1e-10\)", results[0].stdout), results[0].stdout


@pytest.mark.slow  # the default twin: test_dualpipe_v_odd_layers_exact_overlapped_and_not
def test_dualpipe_v_fsdp_exact():
    """FSDP composes: the non-expert parameters fully sharded over "dp", the experts left to the group."""
    out = run_check("dualpipe-v", "--dp-kind", "fsdp")
    assert "fsdp replicas" in out


@pytest.mark.slow  # the default twin: test_dualpipe_v_odd_layers_exact_overlapped_and_not
def test_dualpipe_v_fsdp_per_block_exact():
    """--dp-unit block: each Block of the stage's `blocks` ModuleList its own FSDP2 unit (a container has
    no forward for FSDP2 to gather it by), the experts inside them left to the group."""
    out = run_check("dualpipe-v", "--dp-kind", "fsdp", "--dp-unit", "block", env={"MOE_LAYERS": "3"})
    assert "fsdp replicas" in out


def test_per_block_units_are_a_containers_blocks():
    """`--dp-unit block`'s units of an examples/moe.py stage: the embedding and each Block of its ModuleList
    (fully_shard refuses a container without a forward), the stage keeping none of its own."""
    from pipec.runtime.exec.replicas import _units
    from pipec.runtime.model.contract import load_model

    model = load_model(MODEL)
    assert [n for n, _ in _units(model.build_stage(0, 2))] == ["embed", "blocks.0", "blocks.1"]
    last = model.build_stage(1, 2)
    assert [n for n, _ in _units(last)] == ["blocks.0", "blocks.1", "ln", "head"]
    dense = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    assert [u for u, _ in _units(dense)] == ["0", "1.0"]


@pytest.mark.slow  # the default twin: test_dualpipe_v_odd_layers_exact_overlapped_and_not
def test_emulated_expert_link_overlapped_and_not_stay_exact():
    topo = 'dc "east" replicas 0 .. 1  dc "west" replicas 1 .. 2  link "east" <-> "west" latency 5ms bandwidth 1Gbps'
    from pipec.api import load
    from pipec.frontend.topology import read_topology, with_topology
    from pipec.runtime.exec.links import links_of

    sched = load("dualpipe-v", p=2, m=4)
    sched = with_topology(sched, read_topology(topo, sched))
    links = links_of(sched, 1.0, 2)
    assert links.replica[0][1] == pytest.approx((0.005, 1e9 / 8))
    import json
    import tempfile

    path = tempfile.mktemp(suffix=".json")
    with open(path, "w") as f:
        f.write(links.to_json())
    over = run_check("dualpipe-v", "--links", path)
    plain = run_check("dualpipe-v", "--links", path, "--no-overlap")
    assert losses(over) == losses(plain)
    assert json.loads(links.to_json())["replica"][1][0] == [0.005, 1e9 / 8]


@pytest.mark.slow  # the default twin: test_members_building_different_moe_layers_are_refused_before_any_step
def test_an_op_issuing_more_all_to_alls_than_its_layers_is_named():
    env = {**SMALL, "MOE_MISMATCH": "calls"}
    argv = ["dualpipe-v", "-D", "p=2", "-D", "m=4", "--model", str(ROOT / "tests/models/moe_mismatch.py"), *EP]
    results, _, _ = launch(4, "launch", [*argv, "--timeout", "20"], env=env, timeout=120)
    assert all(r.returncode != 0 for r in results)
    text = "".join(r.stdout + r.stderr for r in results)
    assert re.search(r"instruction #\d+ `FWD \d+ \d+` \(stage \d+\) issues all-to-all #3 \(dispatch\), but", text), text


@pytest.mark.slow  # the default twin: test_members_building_different_moe_layers_are_refused_before_any_step
def test_a_model_without_moe_layers_is_refused_under_ep():
    argv = ["1f1b", "-D", "p=2", "-D", "m=2", "--model", str(ROOT / "examples/mlp.py"), "--dp", "2", "--ep", "2"]
    results, _, _ = launch(4, "launch", argv, env={"MLP_WIDTH": "8", "MLP_BATCH": "8"}, timeout=120)
    text = "".join(r.stdout + r.stderr for r in results)
    assert all(r.returncode != 0 for r in results)
    assert "--ep 2: the model has no MoE layer" in text and "step 1/" not in text


# ---- refusals without processes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"dp": 2, "ep": 3, "experts": 6}, "an expert group of 3 ranks (--ep) must divide the data-parallel replicas"),
        ({"dp": 2, "ep": 2, "experts": 3}, "3 experts cannot be sharded evenly over an expert group of 2 ranks"),
        ({"dp": 1, "ep": 2, "experts": 4}, "folded into data parallelism: it needs --dp 2"),
        ({"dp": 2, "ep": 2, "experts": 4, "checkpoint": "/tmp/x"}, "--checkpoint does not save expert shards"),
    ],
)
def test_pipec_run_refuses_expert_options_before_any_process(flags, words):
    from pipec.api import load
    from pipec.options import OptionError, dp_of
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime.job.run import run

    opts = RunOptions(model=MODEL, nproc=4, **flags)
    program = compile_schedule(load("1f1b", p=2, m=2), None, dp_of(opts)).program
    with pytest.raises(OptionError, match=re.escape(words)):
        run(opts, program)


def test_every_entry_builds_the_same_program_with_its_experts(tmp_path, monkeypatch):
    """`pipec run` (the launcher), a worker torchrun starts on the schedule, and a worker reading the
    launcher's Program file all build the Program in `run_program`: its experts included (the start-up
    check of the group's all-to-all order reads them), and a Program file against other flags is E426."""
    import pipec.runtime.job.run as job_run
    from pipec.cli.app import main
    from pipec.errors import PipecError
    from pipec.formats.program_file import write_json
    from pipec.ir.experts import Experts
    from pipec.runtime.job.launch import load_program

    seen = []
    monkeypatch.setattr(job_run, "run", lambda opts, program, links=None, sched=None: seen.append(program) or 0)
    argv = ["dualpipe-v", "-D", "p=2", "-D", "m=4", "--model", MODEL, *EP]
    assert main(["run", *argv]) == 0
    launcher = seen[0]
    assert launcher.experts == Experts(2, 4) and launcher.dp == 2
    opts = RunOptions(model=MODEL, dp=2, ep=2, experts=4)
    assert load_program("dualpipe-v", [("p", "2"), ("m", "4")], opts) == launcher  # torchrun on the schedule
    path = tmp_path / "program.json"
    with open(path, "w") as f:
        write_json(launcher, f)
    assert load_program(str(path), [], opts) == launcher  # what `pipec run` hands its workers
    assert load_program(str(path), [], RunOptions(model=MODEL)).experts == Experts(2, 4)  # no flag: its own
    with pytest.raises(PipecError, match=r"E426.*compiled for experts --ep 2 --experts 4"):
        load_program(str(path), [], RunOptions(model=MODEL, dp=2, ep=2, experts=8))


def test_the_start_up_layer_exchange_says_what_the_compile_time_check_says(tmp_path):
    """`layers_error` (the start-up exchange's verdict) is order_error's E427 word for word, located in the
    schedule the launcher hands its workers (`write_source`, `read_source`); other names or expert counts
    at the same layer counts are said naming both job ranks; equal digests pass."""
    from pipec.driver import target_of
    from pipec.passes.experts import order_error
    from pipec.runtime.job.program import read_source, run_program, write_source
    from pipec.runtime.model.moe import layers_error

    c = run_program(*target_of("dualpipe-v", [("p", "2"), ("m", "4")]), RunOptions(model=MODEL, dp=2, ep=2, experts=4))
    assert write_source(c.schedule, str(tmp_path / "source.json"))
    sched = read_source(str(tmp_path / "source.json"), 0)
    one, two = [("blocks.0.moe.experts", 4)], [("blocks.0.moe.experts", 4), ("blocks.1.moe.experts", 4)]
    digests = {4: {0: one, 3: one}, 5: {0: one, 3: two}}  # job ranks 4 and 5: pipeline rank 0's stages 0 and 3
    said = layers_error(c.program, 0, digests, sched)
    assert said == order_error(c.program, 0, {4: (1, 0, 0, 1), 5: (1, 0, 0, 2)}, c.schedule).diagnostics[0].format()
    assert re.match(r"<library>/dualpipe-v\.pipe:\d+:\d+: error\[E427\]: .* ranks 4 and 5", said), said
    assert "MoE layers of its stages [0, 3]: rank 4 [1, 1], rank 5 [1, 2]" in said
    assert layers_error(c.program, 0, {4: {0: one}, 5: {0: one}}, sched) == ""
    other = layers_error(c.program, 0, {5: {0: [("x", 4)], 3: one}, 4: {0: one, 3: one}}, None)
    assert other.startswith("the expert group's members build different MoE layers: job rank 4 builds stage 0 ")
    assert not write_source(run_program(c.program, "p.json", None).schedule, str(tmp_path / "none.json"))


def test_experts_modules_are_checked_against_the_group_and_the_flag(monkeypatch):
    from pipec.runtime.model.contract import load_model

    model = load_model(MODEL)
    stage = model.build_stage(0, 2)
    assert [n for n, _ in expert_modules(stage)] == ["blocks.0.moe.experts"]
    assert digest({0: stage}) == {0: [("blocks.0.moe.experts", 4)]}
    check_experts({0: stage}, 2, 4, "m.py")
    with pytest.raises(PipelineError, match=r"stage 0's experts module `blocks.0.moe.experts` has 4 experts, which "):
        check_experts({0: stage}, 3, 0, "m.py")
    with pytest.raises(PipelineError, match="has 4 experts, but --experts says 8"):
        check_experts({0: stage}, 2, 8, "m.py")
    stage.blocks[0].moe.experts.w1 = torch.nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(PipelineError, match=r"parameter `w1` has shape \(3, 2\), but every parameter"):
        check_experts({0: stage}, 2, 0, "m.py")


# ---- the baton, with real threads -------------------------------------------------------------------


@pytest.mark.parametrize(("first", "second"), [(2, 2), (2, 0), (0, 4), (6, 2), (1, 3)])
def test_the_baton_runs_segments_and_issues_in_pair_order(first, second):
    """Two threads, each an op issuing its all-to-alls (recorded, then the handoff exchange does): the
    segments and the issues come out in pair_order's order, whatever the threads' timing."""
    baton = Baton(first, second, 10.0, lambda: "test")
    seen: list[tuple[int, int]] = []
    issued: list[tuple[int, int]] = []
    lock = threading.Lock()

    def op(slot: int, count: int) -> None:
        baton.start(slot)
        for k in range(count + 1):
            with lock:
                seen.append((slot, k))
            time.sleep(0.001 * ((slot + k) % 3))  # uneven compute
            if k < count:
                with lock:
                    issued.append((slot, k))
                baton.handoff(slot)
        baton.finish(slot)

    PairRunner().run(lambda: op(0, first), lambda: op(1, second), baton)
    order = list(pair_order(first, second))
    assert seen == order
    assert issued == [x for x in order if x[1] < (first, second)[x[0]]]
    # each turn taken from the other op after sleeping is timed: at most one per turn change, none negative
    changes = sum(a[0] != b[0] for a, b in zip(order, order[1:]))
    assert len(baton.waits) <= changes and all(0.0 <= w < 10.0 for w in baton.waits)
    if changes and first and second:
        assert baton.waits  # the op that handed over slept until its next turn at least once


def test_a_stuck_pair_partner_times_out_naming_the_pair():
    baton = Baton(1, 1, 0.3, lambda: "rank 0, pair #4 `FWD 1 0` & #5 `BWD 0 1`")

    def first() -> None:
        baton.start(0)
        baton.handoff(0)  # waits for op 1, which never starts its segment

    with pytest.raises(PipelineError, match=r"rank 0, pair #4 `FWD 1 0` & #5 `BWD 0 1`: op 0 .* waited 0.3 s"):
        PairRunner().run(first, lambda: time.sleep(1.0), baton)


def test_a_failing_op_stops_its_partner_and_its_error_is_raised():
    baton = Baton(2, 2, 5.0, lambda: "pair")

    def first() -> None:
        baton.start(0)
        raise PipelineError("the first op's own error")

    def second() -> None:
        baton.start(1)

    with pytest.raises(PipelineError, match="the first op's own error"):
        PairRunner().run(first, second, baton)


# ---- alltoall pieces without a process group -------------------------------------------------------------


def test_regroup_orders_rows_by_expert_then_source():
    counts = torch.tensor([[1, 2], [3, 0]])  # [source, expert]: rows 0 | 1 2 from source 0, 3 4 5 from source 1
    assert _regroup(counts).tolist() == [0, 3, 4, 5, 1, 2]
    assert _regroup(torch.zeros(2, 2, dtype=torch.int64)).tolist() == []


def test_a_peer_issuing_another_all_to_all_is_named_with_both_instructions():
    from pipec.runtime.exec.alltoall import OpRun

    g = ExpertGroup(None, [4, 5], 0, rank=2, dp_rank=0, timeout=1.0, where=lambda: "here")
    g.step = 1
    op = OpRun(7, "FWD 3 4", 4, 0, 2, count=1)
    head = [1.0, 9.0, 0.0, 5.0, 1.0, 0.0, 0.0, 0.0][:HEADER]
    with pytest.raises(CollectiveError) as e:
        g._check(head, 1, op, 0, "dispatch")
    msg = str(e.value)
    assert (
        "instruction #7 `FWD 3 4` (stage 4)" in msg
        and "job rank 5 (member 1) issued all-to-all #1 of instruction #9" in msg
    )
    assert e.value.peers == [5]
    g._check([1.0, 7.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0], 1, op, 0, "dispatch")  # the same one: no error


def test_the_emulated_arrival_queues_on_the_wire_and_skips_unemulated_members():
    link = ((None, (0.005, 1e6)), ((0.005, 1e6), None))
    g = ExpertGroup(None, [0, 1], 0, rank=0, dp_rank=0, timeout=1.0, where=lambda: "here", link=link)
    first = g._arrivals(100.0, [3, 1000], 1000)  # 1 MB to member 1 at 1 MB/s: 1 s on the wire
    assert first[0] == 0.0 and first[1] == pytest.approx(100.0 + 1.0 + 0.005)
    second = g._arrivals(100.5, [0, 0], 1000)  # queued behind the first on the wire
    assert second[1] == pytest.approx(101.0 + 0.005)


def test_links_replica_pairs_round_trip_and_pick_the_group():
    inf = float("inf")
    rep = ((None, (0.005, 125e6), None, None), ((0.005, 125e6), None, None, None), (None,) * 4, (None,) * 4)
    links = Links(((None,),), ((None,),), ((0.0, inf),), rep)
    back = Links.from_json(links.to_json())
    assert back.replica == rep
    assert back.replica_link(1, 2) == ((None, (0.005, 125e6)), ((0.005, 125e6), None))
    assert back.replica_link(3, 2) is None  # replicas 2 and 3 share a datacenter: nothing emulated


def _dispatch_rank(rank: int, out: str) -> None:
    """One member of a 2-rank expert group over an emulated 50 ms link: an MoE layer's dispatch and combine
    around experts that double their rows, timed, and the gradient through both."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    hop = (0.05, 1e9)
    link = ((None, hop), (hop, None))
    g = ExpertGroup(dist.group.WORLD, [0, 1], rank, rank=0, dp_rank=rank, timeout=30.0, where=lambda: "t", link=link)
    counts = [[3, 1, 2, 0], [0, 2, 1, 1]][rank]  # 4 experts, 2 per member; rows grouped by expert
    tokens = torch.arange(sum(counts) * 2, dtype=torch.float64).view(-1, 2).add(10 * rank).requires_grad_()
    seen = []

    def local(rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        seen.append(per_expert)
        return rows * 2

    t0 = time.monotonic()  # one clock for both processes (CLOCK_MONOTONIC)
    y = g.forward(local, tokens, counts)
    t1 = time.monotonic()
    y.sum().backward()
    result = {"t0": t0, "t1": t1, "seen": seen, "same": bool(torch.equal(y, tokens * 2)), "grad": tokens.grad.tolist()}
    with open(out, "w") as f:
        json.dump(result, f)
    g.close()
    dist.destroy_process_group()


def test_a_dispatch_sends_its_counts_then_its_rows_over_the_emulated_link(tmp_path):
    # Two members over a 50 ms link: the dispatch takes two latencies (the counts, then the rows the
    # receivers sized from them) and the combine one. Member i's rows leave when member j's counts have
    # arrived, j's combine leaves when i's rows have arrived, and reaches i a latency later: i's forward
    # ends at least 150 ms after j began its own. Each member's experts see the rows routed to them from
    # both members, and every row comes back to its place.
    from runtime_harness import json_ranks

    res = json_ranks(_dispatch_rank, 2, tmp_path, timeout=60.0)
    # member 0 holds experts 0, 1: [3, 1] from itself and [0, 2] from member 1; member 1 experts 2, 3
    assert [r["seen"] for r in res] == [[[3, 3]], [[3, 1]]]
    for i, r in enumerate(res):
        assert r["same"] and 0.15 <= r["t1"] - res[1 - i]["t0"] < 5.0
        assert all(v == 2.0 for row in r["grad"] for v in row)
