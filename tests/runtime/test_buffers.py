"""Receive buffers allocated once (issue 43, part 2): the runtime counts every receive-buffer tensor it creates
(pipec.runtime.exec.buffers.Slots.made), per step; after the first step (its shape exchange sizes the pools)
it creates none, on 1F1B, ZB-V and interleaved 1F1B at p=4 over gloo, with gradients and parameters equal to
the single-process float64 reference, and every rank's slots are the compiler's buffer plan (pipec.passes.bufferplan:
its rule counts gloo's receives posted ahead and split backward's gradients kept until W). One 4-process job by
default (1F1B posting ahead, ZB-V where the Program places each receive); the rest, shared memory among them,
behind `-m slow`. The unit cases check the plan's adoption without processes: every rank of 1F1B, interleaved,
ZB-V and ZB-H1 at p=4, posting ahead or not, takes the plan, a Program's own plan included."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("torch")

from types import SimpleNamespace  # noqa: E402

from runtime_harness import launch  # noqa: E402

import pipec  # noqa: E402
from pipec.ir.buffers import GLOO_RECV_AHEAD  # noqa: E402
from pipec.passes.bufferplan import plan_buffers  # noqa: E402
from pipec.passes.compiler import compile_schedule  # noqa: E402
from pipec.sim.memory import memory_model  # noqa: E402

TOL = 1e-10
MLP_ENV = {
    "MLP_WIDTH": "16",
    "MLP_DEPTH": "8",
    "MLP_BATCH": "16",
    "MLP_DTYPE": "float64",
    "PIPEC_TEST_TRANSPORT": "gloo",
}


PLAN = "by the compiler's buffer plan"  # Slots.describe() of slots the plan placed


def _job(tmp_path, specs: list[str], steps: int = 3, transport: str = "gloo") -> dict:
    env = {**MLP_ENV, "PIPEC_TEST_TRANSPORT": transport}
    results, _, _ = launch(4, "worker", [str(tmp_path), str(steps), *specs], env=env, timeout=240)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
    return {spec: [json.loads((tmp_path / f"rank{r}.json").read_text())[spec] for r in range(4)] for spec in specs}


def _check(rows: list[dict], steps: int, transport: str = "DistComm") -> None:
    for rank, row in enumerate(rows):
        made = row["buffers_made"]
        assert len(made) == steps, row
        assert made[0] > 0 and made[1:] == [0] * (steps - 1), f"rank {rank}: receive buffers per step {made}"
        assert row["grad_err"] <= TOL and row["param_err"] <= TOL, row
        assert row["transport"] == transport, row
        assert PLAN in row["buffers"], f"rank {rank}: {row['buffers']}"
    assert sum(1 for row in rows if row["loss"] is not None) == 1


def test_no_new_receive_buffers_after_the_first_step(tmp_path):
    specs = ["1f1b:p=4,m=8", "zb-v:p=4,m=8"]  # the worker posts the second's receives where the Program does
    got = _job(tmp_path, specs)
    for spec in specs:  # 1F1B posting 4 ahead on gloo, ZB-V's split backward: both the plan's slots
        _check(got[spec], 3)


@pytest.mark.slow
def test_no_new_receive_buffers_interleaved_and_more(tmp_path):
    """The default test's twin: interleaved 1F1B posting ahead and not, ZB-V ahead, 1F1B at the Program's places."""
    # the worker posts ahead on the 1st and 3rd, where the Program places each receive on the 2nd and 4th
    specs = ["interleaved-1f1b:p=4,m=8", "interleaved-1f1b:p=4,m=16", "zb-v:p=4,m=8", "1f1b:p=4,m=16", "zb-h1:p=4,m=8"]
    got = _job(tmp_path, specs)
    for rows in got.values():
        _check(rows, 3)


@pytest.mark.slow
def test_no_new_receive_buffers_over_shared_memory(tmp_path):
    """Shared memory posts no receive ahead; the plan's slots hold there too, split backward included."""
    specs = ["1f1b:p=4,m=8", "interleaved-1f1b:p=4,m=8", "zb-v:p=4,m=8", "zb-h1:p=4,m=8"]
    got = _job(tmp_path, specs, transport="shm")
    for rows in got.values():
        _check(rows, 3, "ShmComm")


# ---- without processes: the slots an executor builds from its Program ----------------------------------


def _slots(prog, rank: int, ahead: int):
    """Executor `rank`'s receive slots after a shape exchange giving every message one float64 tensor."""
    import torch

    from pipec.runtime.exec import buffers
    from pipec.runtime.exec.executor import Executor
    from pipec.runtime.exec.shapes import TensorSpec

    ex = Executor(prog, rank, {}, SimpleNamespace(), recv_ahead=ahead)
    for j in ex.recvs:
        ex.recv_specs[ex.tkeys[j]] = (TensorSpec((4, 16), torch.float64),)
    return ex, buffers.build(ex, torch.device("cpu"), True)


@pytest.mark.parametrize("ahead", [0, GLOO_RECV_AHEAD])
@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-v", "zb-h1"])
def test_every_rank_takes_the_plans_slots(name, ahead):
    from pipec.runtime.exec import buffers
    from pipec.runtime.exec.comm import edge_key

    prog = compile_schedule(pipec.load(name, p=4, m=8)).program
    for rank in range(prog.num_ranks):
        ex, slots = _slots(prog, rank, ahead)
        assert slots.source == "plan" and slots.note == "", (rank, slots.describe())
        planned, note = buffers.plan_slots(prog, rank, ex.recv_specs, edge_key, ahead)
        assert note == "" and set(planned) == set(ex.recv_specs)
        assert slots.slots == len(set(planned.values())) <= len(ex.recv_specs)


def test_a_programs_own_plan_is_taken_when_made_for_as_many_receives_ahead():
    prog = pipec.compile("zb-v", p=4, m=8, buffers=True)  # its plan: receives where the Program places them
    ahead = replace(prog, buffers=plan_buffers(prog, memory_model(pipec.load("zb-v", p=4, m=8)), ahead=GLOO_RECV_AHEAD))
    for rank in range(prog.num_ranks):
        _, own = _slots(prog, rank, 0)
        _, more = _slots(ahead, rank, 1)  # a plan for 4 ahead holds for 1
        _, again = _slots(prog, rank, GLOO_RECV_AHEAD)  # a plan for 0 ahead does not hold for 4: planned again
        assert (own.source, own.note, more.source, more.note) == ("plan", "", "plan", ""), rank
        assert again.source == "plan" and "planned again by its rule for 4" in again.note, again.note
        assert again.slots < len(again.of)  # slots shared, not one a message


def test_slots_that_clash_under_the_runtimes_lifetimes_are_refused(monkeypatch):
    """The runtime's own check behind the plan: a plan that puts two live receives in one slot is not taken."""
    from pipec.runtime.exec import buffers

    prog = compile_schedule(pipec.load("1f1b", p=4, m=8)).program
    real = buffers.plan_slots

    def one_slot(*a, **k):
        planned, note = real(*a, **k)
        return {key: (pool, 0) for key, (pool, _) in planned.items()}, note

    monkeypatch.setattr(buffers, "plan_slots", one_slot)
    _, slots = _slots(prog, 1, GLOO_RECV_AHEAD)
    assert slots.source == "runtime" and "would share a slot while both are in use" in slots.note, slots.note
