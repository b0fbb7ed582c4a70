"""pipec.sim.faults: the fault models' draws and the family machine (issue 44, part 4)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pipec.driver import build
from pipec.errors import Source
from pipec.sim.faults import Faults, Jitter, Straggler, faults_of, parse_jitter, unit
from pipec.sim.machine import run_family

ROOT = Path(__file__).resolve().parents[3]


def _sched(family: str, p: int = 4, m: int = 8):
    text = (ROOT / "schedules" / "1f1b.pipe").read_text()
    text = re.sub(r"(rank r \{\n)", r"\1        " + family + "\n", text, count=1)
    return build(Source("t.pipe", text), {"p": str(p), "m": str(m)})


def test_static_1f1b_is_the_formula():
    """No faults, free wires: 1F1B's makespan is (m + p - 1)(F + B), statically and dynamically."""
    sched = _sched("window 3")
    cost = np.array([[1.0] * 4, [2.0] * 4])
    assert run_family(sched, cost, 0.0, 0.0, static=True).makespan == pytest.approx((8 + 3) * 3.0)
    assert run_family(sched, cost, 0.0, 0.0, family=sched.family).makespan == pytest.approx((8 + 3) * 3.0)


def test_draws_are_pure_and_shares_hold():
    f = Faults(Straggler(1, 2.0, 0.3), Jitter("exp", 0.01), seed=5)
    assert unit(1, 2, 3) == unit(1, 2, 3) and unit(1, 2, 3) != unit(1, 2, 4)
    slowed = [f.slow(s, 1, k, i, 1) for s in range(20) for k in range(2) for i in range(50)]
    assert 0.25 < slowed.count(2.0) / len(slowed) < 0.35
    assert all(f.slow(0, 0, 0, i, 0) == 1.0 for i in range(50))  # only the straggler's rank
    assert f.delay(0, 0, 1, 0, -1, 0, 1) == f.delay(0, 0, 1, 0, -1, 0, 1) > 0
    assert Faults.from_json(f.to_json()) == f


def test_dynamic_orders_are_members_and_finish_under_faults():
    sched = _sched("window 4 prefer depth")
    cost = np.array([[0.01] * 4, [0.02] * 4])
    faults = faults_of("1:2:0.3", "exp:10ms", 0)
    run = run_family(sched, cost, 5e-5, 0.0, family=sched.family, faults=faults, step=1)
    for r, order in enumerate(run.order):
        assert sorted(order) == list(range(len(sched.ranks[r])))
        assert all(abs(b - a) < 4 or a < b for a, b in zip(order, order[1:]))


def test_bad_fault_flags_say_why():
    with pytest.raises(ValueError, match="exp:MEAN"):
        parse_jitter("gauss:1ms")
    with pytest.raises(ValueError, match="factor >= 1"):
        faults_of("1:0.5", None)
