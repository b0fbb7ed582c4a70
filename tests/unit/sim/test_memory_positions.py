"""`pipec.sim.memory.positions` leaves out the dominated positions without comparing every pair: it keeps
exactly the rows the pairwise filter kept (the reference below, the implementation it replaced), on every
library schedule, with memory ops added, split backward and token slices, and on random walks whose
fronts are large."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipec.api import load
from pipec.errors import PipecError
from pipec.frontend import library
from pipec.ir.schedule import Schedule
from pipec.planner.space import with_memops
from pipec.sim.memory import _undominated, positions


def _pairwise(rows: np.ndarray) -> np.ndarray:
    """The reference: every distinct row checked against every other."""
    rows = np.unique(rows, axis=0)
    keep = [i for i, row in enumerate(rows) if not np.any(np.all(rows >= row, axis=1) & np.any(rows > row, axis=1))]
    return rows[keep]


def _reference(sched: Schedule, monkeypatch) -> list:
    """`positions` as it was: the same walk (the function itself), the pairwise filter in place of
    `_undominated`."""
    from pipec.sim import memory

    with monkeypatch.context() as m:
        m.setattr(memory, "_undominated", _pairwise)
        return memory.positions(sched)


def _schedules():
    for name in library.names():
        for p, m, extra in ((4, 8, {}), (3, 7, {}), (2, 4, {})):
            if name == "terapipe":
                extra = {"n": 3, "L": 2048}
            try:
                sched = load(name, p=p, m=m, **extra)
            except PipecError:
                continue
            yield f"{name} p={p} m={m}", sched
    for f1b1 in (False, True):
        yield f"terapipe f1b1={f1b1}", load("terapipe", p=4, m=3, n=3, L=2048, f1b1=f1b1)
    for name in ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v"):
        base = load(name, p=4, m=8)
        for kind in ("recompute", "offload"):
            for k in (1, 2, 4):
                yield f"{name} {kind} on {k}", with_memops(base, kind, k)


CASES = list(_schedules())


def test_the_cases_cover_split_backward_slices_and_memory_ops():
    scheds = [s for _, s in CASES]
    assert any(s.split_backward for s in scheds)
    assert any(s.slicing is not None for s in scheds)
    assert any(any(len(x) for x in s.memops) for s in scheds)
    assert len(CASES) > 40


@pytest.mark.parametrize("name,sched", CASES, ids=[n for n, _ in CASES])
def test_positions_keep_the_pairwise_filters_rows(name, sched, monkeypatch):
    got, want = positions(sched), _reference(sched, monkeypatch)
    for r, (pos, ref) in enumerate(zip(got, want, strict=True)):
        for mine, theirs in ((pos.act, ref.act), (pos.wact, ref.wact), (pos.ckpt, ref.ckpt)):
            assert mine.shape == theirs.shape and np.array_equal(mine, theirs), (name, r)


@settings(max_examples=60, deadline=None)
@given(
    cols=st.integers(1, 6),
    steps=st.integers(0, 300),
    seed=st.integers(0, 2**16),
    spread=st.sampled_from([1, 3]),
)
def test_undominated_is_the_pairwise_filter_on_random_walks(cols, steps, seed, spread):
    """Random walks of +-1 steps (many ties, long rising and falling runs) and of wider steps (fronts of
    hundreds of rows, across several of the filter's blocks)."""
    rng = np.random.default_rng(seed)
    moves = rng.integers(-spread, spread + 1, size=(steps, cols)).astype(float)
    rows = np.concatenate([np.zeros((1, cols)), np.cumsum(moves, axis=0)])
    got = _undominated(rows, block=int(rng.integers(1, 64)))
    assert np.array_equal(got, _pairwise(rows))
