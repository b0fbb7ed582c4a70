"""The critical path and the idle-gap attribution (pipec.view.critical) against the simulator's own numbers."""

from __future__ import annotations

import numpy as np
import pytest

from pipec import driver
from pipec.sim.cost_files import cost_spec
from pipec.view.critical import COMPUTE, MESSAGE, attribute

CASES = [
    ("1f1b", {"p": 4, "m": 8}, []),
    ("gpipe", {"p": 3, "m": 5}, ["F=1,B=2"]),
    ("zb-h1", {"p": 4, "m": 8}, []),
    ("dualpipe-v", {"p": 4}, []),
    ("interleaved-1f1b", {}, ["F=1,B=2,comm=0.3"]),
    ("1f1b-offload", {}, []),
    ("zb-h1", {"p": 4, "m": 6}, ["F=1.3,B=2.1,W=0.7,comm=0.25"]),
]


def _sim(name, params, costs):
    obj, where = driver.target_of(name, params)
    return driver.simulation(obj, [cost_spec(c) for c in costs])


def _ends(tl, kind, idx):
    return {COMPUTE: tl.end, MESSAGE: tl.msg_arrival, 2: tl.coll_end, 3: tl.host_end, 4: tl.step_end}[kind][idx]


def _starts(tl, kind, idx):
    return {COMPUTE: tl.start, MESSAGE: tl.msg_send, 2: tl.coll_start, 3: tl.host_start, 4: tl.step_start}[kind][idx]


@pytest.mark.parametrize(("name", "params", "costs"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_critical_path_is_the_makespan_and_every_gap_ends_with_what_it_waited_for(name, params, costs):
    tl = _sim(name, params, costs).timeline
    att = attribute(tl)
    tol = 1e-9 * tl.makespan
    assert att.length == pytest.approx(tl.makespan, rel=1e-12)
    # The path is a chain of tight events from the step's start to its end.
    starts = np.array([_starts(tl, k, i) for k, i in zip(att.path_kind, att.path_index)])
    ends = np.array([_ends(tl, k, i) for k, i in zip(att.path_kind, att.path_index)])
    assert starts[0] == pytest.approx(0.0, abs=tol)
    assert ends[-1] == pytest.approx(tl.makespan, rel=1e-12)
    np.testing.assert_allclose(starts[1:], ends[:-1], atol=tol)
    assert (att.path_kind == COMPUTE).any()
    # Every idle gap of a compute stream is attributed, to an event that ends exactly when the gap ends.
    assert len(att.gap_rank) > 0
    assert (att.gap_kind >= 0).all(), "a gap the timeline does not explain"
    waited_end = np.array([_ends(tl, k, i) for k, i in zip(att.gap_kind, att.gap_index)])
    np.testing.assert_allclose(waited_end, att.gap_end, atol=tol)
    assert (att.gap_end > att.gap_start).all()


def test_with_unrecorded_overhead_the_path_still_spans_the_makespan_and_gaps_wait_on_the_latest_event():
    tl = _sim("1f1b", {"p": 4, "m": 6}, ["F=1.3,B=2.1,comm=0.25,overhead=0.05"]).timeline
    att = attribute(tl)
    assert att.length == pytest.approx(tl.makespan, rel=1e-12)
    starts = np.array([_starts(tl, k, i) for k, i in zip(att.path_kind, att.path_index)])
    ends = np.array([_ends(tl, k, i) for k, i in zip(att.path_kind, att.path_index)])
    slack = starts[1:] - ends[:-1]  # the unrecorded per-message overhead, never negative, a few o at most
    assert (slack >= -1e-9).all() and (slack <= 4 * 0.05 + 1e-9).all()
    assert (att.gap_kind >= 0).all()
    waited_end = np.array([_ends(tl, k, i) for k, i in zip(att.gap_kind, att.gap_index)])
    assert ((att.gap_end - waited_end) >= -1e-9).all() and ((att.gap_end - waited_end) <= 4 * 0.05 + 1e-9).all()


def test_idle_time_of_the_gaps_is_the_simulators_idle_time():
    sim = _sim("1f1b", {"p": 4, "m": 8}, ["F=1,B=2,comm=0.2"])
    att = attribute(sim.timeline)
    for r in sim.stats.ranks:  # the simulator's idle: inside the rank's span, first op to last
        inside = (att.gap_rank == r.rank) & (att.gap_start >= r.first - 1e-12)
        assert (att.gap_end - att.gap_start)[inside].sum() == pytest.approx(r.idle, rel=1e-9, abs=1e-12)
