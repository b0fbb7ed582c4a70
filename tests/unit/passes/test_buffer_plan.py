"""The buffer plan (pipec.passes.bufferplan, issue 43 part 1) over every library schedule: memory ops (1f1b-offload,
1f1b-recompute, zb-v-recompute), token slices (terapipe) and a stage graph (U-Net skips, as
tests/features/graph/test_library_on_graphs.py adds them) included.

What is held: the plan is proven (its receives born where the runtime posts them, `ahead`; with split backward
a received gradient kept until its W) (every tensor of the rule has a slot, no two live tensors share one); a plan
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
from pipec.formats import plan_file
from pipec.frontend import library
from pipec.ir.buffers import FAMILY, GLOO_RECV_AHEAD, RankPlan
from pipec.ir.opcodes import RECV_ACT, RECV_GRAD, WGRAD
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
# F, received gradients, kept until W with split backward, a local hand-over before its F: `held`) and what the
# plan's banks cost over one arena packed by the same lifetimes (`packing`). Banks join classes of one size
# and family (stages s and s + p of a rank, saved and kept for W where equal), which took combined-1f1b's
# packing from 32 to 0, interleaved's and zeropp's from 25 to 8, zb-v's from 10 to 3; what is left is saved
# classes of different sizes (a stage without a received input saves its whole `act`, one with an input `act`
# less it), which equal-size slots do not join. `held` grew where split backward keeps a received gradient
# until W (zb-h1 0 -> 2, zb-h2 1 -> 5, crossdc-zb 1 -> 3): the runtime does keep it, the walk does not count
# it. 0 where the Done-when bound holds.
FIGURES = {
    "1f1b": (1.0, 0.0),
    "1f1b-offload": (1.0, 0.0),
    "1f1b-recompute": (1.0, 0.0),
    "combined-1f1b": (2.0, 0.0),
    "crossdc-1f1b": (2.0, 0.0),
    "crossdc-zb": (3.0, 0.0),
    "dualpipe-v": (2.0, 2.0),
    "gpipe": (0.0, 0.0),
    "interleaved-1f1b": (1.0, 8.0),
    "looped-bfs": (0.0, 0.0),
    "terapipe": (0.0, 0.0),
    "v-half": (2.0, 4.0),
    "v-min": (1.0, 0.0),
    "zb-h1": (2.0, 1.0),
    "zb-h2": (5.0, 0.0),
    "zb-v": (2.0, 3.0),
    "zb-v-recompute": (2.0, 4.0),
    "zeropp": (1.0, 8.0),
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


def _zb_h1():
    sched = pipec.load("zb-h1", p=4, m=8)
    return compile_schedule(sched).program, memory_model(sched)


def test_a_receive_is_born_where_it_is_posted_and_a_gradient_dies_at_its_W():
    prog, _ = _zb_h1()
    for r in range(prog.num_ranks):
        rp = prog.ranks[r]
        op, mb, st = rp.op.tolist(), rp.mb.tolist(), rp.stage.tolist()
        grouped = rp.group.tolist()
        # each receive's first position (an instruction bound to the one before by `&` shares its moment)
        recvs = [j - 1 if j and grouped[j - 1] else j for j, o in enumerate(op) if o in (RECV_ACT, RECV_GRAD)]
        wgrad = {(i, s): j for j, (o, i, s) in enumerate(zip(op, mb, st)) if o == WGRAD}
        births = {}
        for ahead in (0, GLOO_RECV_AHEAD):
            life = lifetimes(prog, r, ahead)
            for t in range(len(life.pool)):
                kind, s, *_ = life.keys[life.pool[t]]
                if kind == "grad":  # split backward: every gradient of stage s lives to WGRAD (i, s)
                    assert life.death[t] == wgrad[(int(life.mb[t]), s)], (r, t)
                if kind in ("input", "grad"):
                    births.setdefault(ahead, []).append(int(life.birth[t]))
        # posted ahead, the k-th receive is born at the receive GLOO_RECV_AHEAD before it (the first at 0)
        want = sorted([0] * min(GLOO_RECV_AHEAD, len(recvs)) + recvs[: max(len(recvs) - GLOO_RECV_AHEAD, 0)])
        assert sorted(births[GLOO_RECV_AHEAD]) == want, r
        assert sorted(births[0]) == recvs, r


def _slots_of(plan, rank: int) -> dict:
    """(class, micro-batch, nth of them) -> slot: a plan's slots whatever its tensors' order."""
    rp, seen, out = plan.ranks[rank], {}, {}
    for k, i, s in zip(rp.pool.tolist(), rp.mb.tolist(), rp.slot.tolist()):
        key = (rp.pools[k].key, i)
        seen[key] = seen.get(key, -1) + 1
        out[(*key, seen[key])] = s
    return out


def test_slots_made_for_receives_where_the_program_places_them_clash_when_posted_ahead():
    prog, model = _zb_h1()
    plan, ahead = plan_buffers(prog, model), plan_buffers(prog, model, ahead=GLOO_RECV_AHEAD)
    assert ahead.ahead == GLOO_RECV_AHEAD and sum(rp.slots for rp in ahead.ranks) > sum(rp.slots for rp in plan.ranks)
    # the first plan's slots in the second's order and pools: E502 on some rank, a posted receive in a busy slot
    ranks = []
    for r, rp in enumerate(ahead.ranks):
        old, seen, slot = _slots_of(plan, r), {}, []
        for k, i in zip(rp.pool.tolist(), rp.mb.tolist()):
            key = (rp.pools[k].key, i)
            seen[key] = seen.get(key, -1) + 1
            slot.append(old[(*key, seen[key])])
        ranks.append(RankPlan(rp.pools, rp.pool, rp.mb, np.array(slot, dtype=np.int64)))
    with pytest.raises(PipecError) as e:
        prove(prog, replace(ahead, ranks=tuple(ranks)))
    assert e.value.code == "E502" and "while both live" in str(e.value)
    # the second's slots hold for receives where the Program places them (every lifetime only shrinks)
    for r in range(prog.num_ranks):
        life, got = lifetimes(prog, r), _slots_of(ahead, r)
        seen, slot = {}, []
        for k, i in zip(life.pool.tolist(), life.mb.tolist()):
            key = (life.keys[k], i)
            seen[key] = seen.get(key, -1) + 1
            slot.append(got[(*key, seen[key])])
        rp = plan.ranks[r]
        pools = tuple(
            replace(p, slots=q.slots) for p, q in zip(rp.pools, [ahead.ranks[r].pools[j] for j in _index(ahead, r, rp)])
        )
        ranks[r] = RankPlan(pools, rp.pool, rp.mb, np.array(slot, dtype=np.int64))
    prove(prog, replace(plan, ranks=tuple(ranks)))


def _index(plan, r: int, rp) -> list[int]:
    where = {p.key: j for j, p in enumerate(plan.ranks[r].pools)}
    return [where[p.key] for p in rp.pools]


def test_a_bank_is_one_set_of_slots_and_joins_only_classes_that_agree():
    _, plan, *_ = _figures("interleaved-1f1b", 4, 8)
    prog = compile_schedule(pipec.load("interleaved-1f1b", p=4, m=8)).program
    r, rp = next((r, rp) for r, rp in enumerate(plan.ranks) if len(rp.spaces()) < len(rp.pools))
    pools = rp.pools
    shared = next(b for b in {p.bank for p in pools} if sum(p.bank == b for p in pools) > 1)
    members = [k for k, p in enumerate(pools) if p.bank == shared]
    assert len({(pools[k].size, FAMILY[pools[k].kind]) for k in members}) == 1
    assert rp.amount() == sum(p.slots * p.size for p in rp.spaces() if not p.host)
    # two classes of the bank in one slot while both live: refused, though each class alone would hold
    a, b = members[:2]
    slot = np.where(np.isin(rp.pool, [a, b]), 0, rp.slot)
    alone = [np.unique(slot[rp.pool == k]).tolist() for k in (a, b)]
    bad = RankPlan(pools, rp.pool, rp.mb, slot)
    with pytest.raises(PipecError) as e:
        prove(prog, replace(plan, ranks=(*plan.ranks[:r], bad, *plan.ranks[r + 1 :])))
    assert e.value.code == "E502" and "share slot 0 while both live" in str(e.value) and alone == [[0], [0]]
    other = next(k for k, p in enumerate(pools) if p.size != pools[a].size)  # a bank of two sizes
    moved = tuple(replace(p, bank=shared) if k == other else p for k, p in enumerate(pools))
    with pytest.raises(PipecError) as e:
        prove(
            prog, replace(plan, ranks=(*plan.ranks[:r], RankPlan(moved, rp.pool, rp.mb, rp.slot), *plan.ranks[r + 1 :]))
        )
    assert e.value.code == "E502" and "cannot share slots" in str(e.value)


def test_a_plan_file_of_the_first_version_3_reads_as_pools_of_their_own():
    prog, model = _zb_h1()
    plan = plan_buffers(prog, model)
    doc = plan_file.to_doc(plan)
    assert doc["ahead"] == 0 and doc["pool_fields"][-1] == "bank"
    ranks = [{"pools": [row[:-1] for row in rank["pools"]], "tensors": rank["tensors"]} for rank in doc["ranks"]]
    old = {"unit": doc["unit"], "pool_fields": doc["pool_fields"][:-1], "ranks": ranks}
    back = plan_file.from_doc(old, prog.num_ranks)
    assert back.ahead == 0 and all(p.bank == -1 for rp in back.ranks for p in rp.pools)
    prove(prog, back)  # slots unique in a bank are unique in each of its classes
    assert plan_file.from_doc(doc, prog.num_ranks) == plan
    assert all(a >= b for a, b in zip(back.device(), plan.device()))
