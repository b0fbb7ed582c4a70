"""The lowering of all ranks in one pass (`pipec.passes.lower._lower_all`, issue 45's wide pipelines) gives
the Programs the per-rank lowering gives (`lower_with_proof(..., per_rank=True)`), equal array for array:
on every library schedule (token slices, memory ops and a schedule's own collectives among them), on the
stage-graph examples (RankProgram.other), under ddp and fsdp (windows with and without a bound), forward
only, and on random listings (overlapped pairs, scattered placements, ranks that own nothing). And the
one-sort channel check (`dryrun._channels_match`) agrees with the pair-by-pair walk, E404 included.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipec
import pipec.passes.lower as lower_module
from pipec.driver import param_names
from pipec.errors import PipecError
from pipec.frontend import library
from pipec.ir.dataparallel import DataParallel
from pipec.ir.program import Program, RankProgram
from pipec.passes.dryrun import _channels_match, check_channels
from pipec.passes.lower import forward_program, lower_with_proof
from pipec.testing import schedules

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
GRAPHS = sorted(str(p) for p in EXAMPLES.glob("*.pipe") if p.name.startswith(("unet", "two_encoders")))
DPS = [
    DataParallel(),
    DataParallel(2),
    DataParallel(2, "fsdp"),
    DataParallel(2, "fsdp", prefetch=2, max_gathered=1),
]


def _same(a: Program, b: Program) -> None:
    assert a == b
    for x, y in zip(a.ranks, b.ranks):  # equal values, and the same dtypes (bit-identical)
        for f in ("op", "mb", "stage", "peer", "group", "other"):
            u, v = getattr(x, f), getattr(y, f)
            assert (u is None) == (v is None), f
            if u is not None:
                assert u.dtype == v.dtype and np.array_equal(u, v), f


def _both(sched, dp: DataParallel) -> None:
    try:
        per_rank, run_a = lower_with_proof(sched, dp, per_rank=True)
    except PipecError as e:
        with pytest.raises(PipecError) as caught:
            lower_with_proof(sched, dp)
        assert caught.value.code == e.code and str(caught.value) == str(e)
        return
    all_ranks, run_b = lower_with_proof(sched, dp)
    _same(all_ranks, per_rank)
    assert run_a == run_b


def _lib(name: str, **params):
    base = {"p": 4, "m": 8} | ({"v": 2} if "v" in param_names(library.read(name)) else {})
    return pipec.load(name, **(base | params))


@pytest.mark.parametrize("dp", DPS, ids=["none", "ddp", "fsdp", "fsdp-k1"])
@pytest.mark.parametrize("name", library.names())
def test_every_library_schedule_lowers_the_same_all_at_once(name, dp):
    _both(_lib(name), dp)


@pytest.mark.parametrize("path", GRAPHS, ids=[Path(p).stem for p in GRAPHS])
@pytest.mark.parametrize("dp", DPS[:3], ids=["none", "ddp", "fsdp"])
def test_stage_graph_examples_lower_the_same_all_at_once(path, dp):
    sched = pipec.load(path)
    assert sched.graph is not None
    _both(sched, dp)
    prog, _ = lower_with_proof(sched, dp)
    assert all(rp.other is not None for rp in prog.ranks)


@pytest.mark.parametrize("name", ["1f1b", "terapipe", "zb-v"])
def test_forward_only_programs_lower_the_same(name, monkeypatch):
    prog = lower_with_proof(_lib(name))[0]
    all_ranks = forward_program(prog)
    monkeypatch.setattr(lower_module, "lower_with_proof", functools.partial(lower_with_proof, per_rank=True))
    _same(all_ranks, forward_program(prog))


def _fields(rp: RankProgram):
    return rp.op.copy(), rp.mb.copy(), rp.stage.copy(), rp.peer.copy(), rp.group.copy(), rp.other


@pytest.mark.parametrize("params", [{"p": 64, "m": 4}, {"p": 200, "m": 2}, {"p": 3, "m": 1}])
def test_wide_pipelines_lower_the_same(params):
    for name in ("1f1b", "gpipe", "zb-h1"):
        _both(pipec.load(name, **params), DataParallel())


def test_memory_ops_on_some_ranks_only():
    """A rank with memory ops is finished on its own; the others come from the all-ranks pass."""
    sched = _lib("1f1b-recompute")
    assert any(sched.memops)
    keep = tuple(x if r % 2 else () for r, x in enumerate(sched.memops))
    _both(dataclasses.replace(sched, memops=keep), DataParallel())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(listing=schedules(max_ranks=4, max_stages=6, max_mb=3), dp=st.sampled_from(DPS))
def test_random_listings_lower_the_same(listing, dp):
    _both(listing.build(), dp)


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-v", "terapipe"])
def test_the_one_sort_channel_check_agrees_with_the_walk(name):
    prog = lower_with_proof(_lib(name))[0]
    assert _channels_match(prog)
    check_channels(prog)
    # Swap two transfers of rank 1 to one peer: the fast check refuses, the walk names it (E404).
    rp = prog.ranks[1]
    comm = [j for j, i in enumerate(rp.instructions()) if i.op.startswith(("SEND", "RECV")) and i.peer == 0]
    assert len(comm) >= 2
    a, b = comm[0], comm[1]
    cols = _fields(rp)
    for col in cols[:5]:
        col[[a, b]] = col[[b, a]]
    bad = dataclasses.replace(prog, ranks=(prog.ranks[0], RankProgram(*cols), *prog.ranks[2:]))
    assert not _channels_match(bad)
    with pytest.raises(PipecError) as e:
        check_channels(bad)
    assert e.value.code == "E404"
