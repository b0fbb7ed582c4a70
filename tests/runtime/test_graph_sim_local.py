"""The simulator's order and `--local`'s agree on stage graphs (issue 42's property tests): every rank runs
its computes in the order the simulator gives them, and the messages the run sends (kind, micro-batch,
sending stage, from rank, to rank) are the simulator's, on the two graph examples under each library
schedule they ship with. Both read one Program; a lowering, executor or simulator that disagreed about an
edge (a message sent twice, or to the wrong rank, or an op run before an input the simulator waits for)
fails here."""

from __future__ import annotations

import numpy as np
import pytest
from repo import ROOT

torch = pytest.importorskip("torch")

import pipec  # noqa: E402
from pipec.runtime import LocalPipeline, StageOptions, load_model  # noqa: E402
from pipec.runtime.exec.measure import timeline as measured_timeline  # noqa: E402
from pipec.runtime.exec.microbatch import batch_of  # noqa: E402

CASES = [
    ("unet.pipe", "unet.py", {"p": 4, "m": 4}),
    ("unet-zb-v.pipe", "unet.py", {"p": 2, "m": 4}),
    ("two_encoders.pipe", "two_encoders.py", {"m": 4}),
    ("two_encoders-interleaved-1f1b.pipe", "two_encoders.py", {"p": 2, "m": 4}),
]


def _orders(t):
    """Per rank, its computes (opcode, micro-batch, stage) by start time (ties by position)."""
    out = []
    for r in range(t.num_ranks):
        at = np.flatnonzero(t.rank == r)
        at = at[np.lexsort((at, t.start[at]))]
        out.append([(int(t.op[j]), int(t.mb[j]), int(t.stage[j])) for j in at])
    return out


def _messages(t):
    return sorted(
        zip(t.msg_kind.tolist(), t.msg_mb.tolist(), t.msg_stage.tolist(), t.msg_src.tolist(), t.msg_dst.tolist())
    )


@pytest.mark.parametrize(("schedule", "model", "params"), CASES, ids=[c[0] for c in CASES])
def test_the_simulator_and_the_local_run_agree(schedule, model, params):
    prog = pipec.compile(str(ROOT / "examples" / schedule), **params)
    assert prog.graph is not None
    sim = pipec.simulate(prog).timeline
    m = load_model(str(ROOT / "examples" / model))
    pipe = LocalPipeline(prog, m.build_stage, m.loss_fn, options=StageOptions(dtype=m.dtype, seed=0))
    inputs, targets = batch_of(m.batch(0), "batch(0)")
    pipe.step(inputs, targets, record=True)
    ran = measured_timeline(prog, [r.events() for r in pipe.runners])
    assert _orders(ran) == _orders(sim)
    assert _messages(ran) == _messages(sim) and len(sim.msg_kind) > 0
