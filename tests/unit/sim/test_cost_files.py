"""Cost documents (pipec.sim.cost_files) made from a measured run's timeline."""

from __future__ import annotations

import dataclasses

import numpy as np

from pipec.sim.cost_files import normalize


def test_costs_of_a_timeline_are_its_per_stage_medians():
    """A run's cost document gives each stage the median of its ops' durations, per kind, and simulating in
    it gives back a timeline whose ops last what they lasted."""
    from pipec import driver
    from pipec.sim.cost_files import costs_of_timeline

    given = {"F": [1.0, 2.0, 3.0, 4.0], "B": [2.0, 3.0, 5.0, 7.0], "W": [0.5, 1.5, 1.0, 2.0]}
    sim = driver.simulation(driver.target_of("zb-h1", {"p": 4, "m": 6})[0], [normalize(given)])
    doc = costs_of_timeline(sim.timeline)
    assert {k: doc[k] for k in given} == given
    tl = sim.timeline
    bumped = dataclasses.replace(tl, end=tl.end + np.where(tl.mb == 0, 10.0, 0.0))  # one slow op per stage
    assert {k: costs_of_timeline(bumped)[k] for k in given} == given
