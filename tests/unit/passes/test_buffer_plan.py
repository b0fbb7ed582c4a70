"""The buffer plan (pipec.passes.bufferplan, issue 43 part 1) over every library schedule: memory ops (1f1b-offload,
1f1b-recompute, zb-v-recompute), token slices (terapipe) and a stage graph (U-Net skips, as
tests/features/graph/test_library_on_graphs.py adds them) included.

What is held: the plan is proven (every tensor of the rule has a slot, no two live tensors share one); a plan
with two live tensors in one slot, or a tensor without a slot, is refused (E502); at every rank's busiest moment
the plan's tensors hold at least the walk's peak (each byte the walk counts has a slot) and its pools at least
that; and its bytes per rank against the walk's peak plus one largest message, with the figures where it costs
more stated in FIGURES (docs/memory.md, "Buffer plan", says why).
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipec
from pipec.errors import PipecError
from pipec.frontend import library
from pipec.ir.buffers import RankPlan
from pipec.passes.bufferplan import lifetimes, live_peak, plan_buffers, prove
from pipec.passes.compiler import compile_schedule
from pipec.sim.memory import memory_model, resident

SCHEDULES = library.names()


def _unet(name: str, tmp_path) -> str:
    src = library.read(name).text
    m = re.search(r"^(\s*)stages (.+)$", src, flags=re.M)
    S, ind = f"({m.group(2).split('#')[0].strip()})", m.group(1)
    edges = (
        f"\n{ind}edge s -> if s < {S} - 1 then s + 1 else -1"
        f"\n{ind}edge s -> if s < {S} / 2 - 1 then {S} - 1 - s else -1"
    )
    path = tmp_path / f"{name}-unet.pipe"
    path.write_text(src[: m.end()] + edges + src[m.end() :])
    return str(path)


def _figures(target, p: int, m: int):
    sched = pipec.load(target, p=p, m=m)
    c = compile_schedule(sched)
    model = memory_model(sched)
    plan = plan_buffers(c.program, model)  # proven as it is made
    res = resident(c.program.placement_array, model, c.program.num_ranks)
    peaks = np.array([r.peak for r in c.memory])
    return c.program, plan, np.asarray(plan.device()) + res, np.asarray(live_peak(c.program, plan)) + res, peaks


def _holds(target, p, m) -> None:
    prog, plan, planned, packed, peaks = _figures(target, p, m)
    for r in range(prog.num_ranks):
        n = len(lifetimes(prog, r).pool)
        assert len(plan.ranks[r]) == n > 0 or prog.ranks[r].op.size == 0, (target, r)
    assert (packed >= peaks - 1e-9).all(), (target, packed, peaks)  # every byte the walk counts has a slot
    assert (planned >= packed - 1e-9).all(), (target, planned, packed)
    assert plan.largest_message() > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SCHEDULES), st.sampled_from([2, 3, 4, 6]), st.integers(1, 3))
def test_every_library_schedule_has_a_proven_plan_that_holds_the_walk(name, p, k):
    try:
        pipec.load(name, p=p, m=k * p)
    except PipecError:
        return  # a size the schedule refuses (its own checks), nothing to plan
    _holds(name, p, k * p)


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "interleaved-1f1b", "dualpipe-v", "1f1b-offload"])
def test_a_stage_graph_schedule_has_a_proven_plan(name, tmp_path):
    _holds(_unet(name, tmp_path), 4, 8)


# At p = 4, m = 8 in the default units: per schedule, the busiest rank's excess over (walk peak + one largest
# message), in largest messages, split into what the walk does not count at all (receives posted before their
# F, received gradients, a local hand-over before its F: `held`) and what one pool per class costs over one
# arena packed by the same lifetimes (`packing`: the pools of a rank's several stages, and of saved vs kept
# for W, peak at different moments). 0 where the Done-when bound holds.
FIGURES = {
    "1f1b": (1.0, 0.0),
    "1f1b-offload": (1.0, 0.0),
    "1f1b-recompute": (1.0, 0.0),
    "combined-1f1b": (1.0, 32.0),
    "crossdc-1f1b": (2.0, 0.0),
    "crossdc-zb": (1.0, 0.0),
    "dualpipe-v": (2.0, 2.0),
    "gpipe": (0.0, 0.0),
    "interleaved-1f1b": (2.0, 25.0),
    "looped-bfs": (0.0, 5.0),
    "terapipe": (0.0, 0.0),
    "v-half": (2.0, 12.0),
    "v-min": (0.0, 5.0),
    "zb-h1": (0.0, 1.0),
    "zb-h2": (1.0, 0.0),
    "zb-v": (1.0, 10.0),
    "zb-v-recompute": (0.0, 11.0),
    "zeropp": (2.0, 25.0),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_plan_bytes_against_the_walk_peak_plus_one_message_are_the_stated_figures(name):
    prog, plan, planned, packed, peaks = _figures(name, 4, 8)
    msg = plan.largest_message()
    r = int(np.argmax(planned - peaks))
    over = max(float(planned[r] - peaks[r]) - msg, 0.0) / msg
    held = max(float(packed[r] - peaks[r]) - msg, 0.0) / msg
    got = (round(held, 2), round(over - held, 2))
    assert name in FIGURES, f"{name}: state its figures {got} here and say why"
    assert got == FIGURES[name], (name, got)
    if FIGURES[name] == (0.0, 0.0):
        assert (planned <= peaks + msg + 1e-9).all()


def test_a_plan_with_two_live_tensors_in_one_slot_is_refused():
    _, plan, *_ = _figures("1f1b", 4, 8)
    prog = compile_schedule(pipec.load("1f1b", p=4, m=8)).program
    rp = plan.ranks[1]
    k = next(p for p in range(len(rp.pools)) if rp.pools[p].slots > 1)
    slot = np.where(rp.pool == k, 0, rp.slot)  # every tensor of that pool in slot 0
    bad = replace(plan, ranks=(*plan.ranks[:1], RankPlan(rp.pools, rp.pool, rp.mb, slot), *plan.ranks[2:]))
    with pytest.raises(PipecError) as e:
        prove(prog, bad)
    assert e.value.code == "E502" and "share slot 0 while both live" in str(e.value)
    short = RankPlan(rp.pools, rp.pool[:-1], rp.mb[:-1], rp.slot[:-1])  # the last tensor has no slot
    with pytest.raises(PipecError) as e:
        prove(prog, replace(plan, ranks=(*plan.ranks[:1], short, *plan.ranks[2:])))
    assert e.value.code == "E502" and "do not match the Program's" in str(e.value)


def test_the_facade_attaches_the_plan_only_when_asked():
    assert pipec.compile("zb-v", p=2, m=4).buffers is None
    prog = pipec.compile("zb-v", p=2, m=4, buffers=True)
    assert prog.buffers is not None and prog.buffers.unit == "units"
    assert [rp.slots for rp in prog.buffers.ranks] == [
        rp.slots for rp in plan_buffers(prog, memory_model(pipec.load("zb-v", p=2, m=4))).ranks
    ]
