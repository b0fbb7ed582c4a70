"""The property-testing kit on stage graphs (pipec.testing.runtime_check): its tiny model takes a fan-in's
inputs in the order of `graph.inputs(s)` (a Linear each) and its reference runs the Program's graph, so a
graph Program checks to 1e-10 and a runtime that spreads a fan-in's inputs in another order is caught."""

from __future__ import annotations

import pytest
from repo import ROOT

pytest.importorskip("torch")

import pipec  # noqa: E402
from pipec.testing import InvariantError, runtime_check  # noqa: E402

GRAPHS = [
    (str(ROOT / "examples" / "unet.pipe"), dict(p=4, m=3)),
    (str(ROOT / "examples" / "two_encoders.pipe"), dict(p=5, m=3)),
    (str(ROOT / "examples" / "unet-zb-v.pipe"), dict(p=2, m=4)),  # split backward, the skip local to rank 0
    (str(ROOT / "examples" / "two_encoders-interleaved-1f1b.pipe"), dict(p=2, v=2, m=2)),
]


@pytest.mark.parametrize("path, params", GRAPHS, ids=lambda c: str(c).rsplit("/", 1)[-1])
def test_runtime_check_on_graph_programs(path, params):
    prog = pipec.compile(path, **params)
    assert not prog.graph.is_chain
    assert runtime_check(prog) <= 1e-10
    assert runtime_check(pipec.load(path, **params)) <= 1e-10  # a Schedule, compiled by the kit


def test_runtime_check_catches_a_fan_in_spread_in_the_wrong_order(monkeypatch):
    """A seeded runtime bug: a FWD with several in-edges takes their messages in reverse order. The kit's
    reference (on the graph) disagrees, naming a gradient."""
    from pipec.runtime.exec.executor import Executor

    real = Executor._fwd_graph

    def reversed_fan_in(self, j, mb, s, got):
        return real(self, j, mb, s, None if got is None else list(reversed(got)))

    prog = pipec.compile(str(ROOT / "examples" / "two_encoders.pipe"), p=4, m=2)
    assert prog.graph.inputs(2) == (0, 1)
    monkeypatch.setattr(Executor, "_fwd_graph", reversed_fan_in)
    with pytest.raises(InvariantError, match=r"runtime --local, step 1: the (loss|gradient of stage \d+ \S+) differs"):
        runtime_check(prog)
