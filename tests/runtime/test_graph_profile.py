"""`pipec profile` and `pipec run --memory` on a stage graph (issue 42): the profilers run every stage in one
process along the graph's edges (pipec.runtime.profile.common.Wiring), not as a chain. The bytes they count
feed pipec's memory model; its prediction must equal the runtime's own measured peaks on the U-Net example,
as it does on the chain."""

from __future__ import annotations

import pytest
from repo import ROOT

torch = pytest.importorskip("torch")

import pipec  # noqa: E402
from pipec.driver import memory_overrides  # noqa: E402
from pipec.runtime import LocalPipeline, StageOptions, load_model  # noqa: E402
from pipec.runtime.exec.microbatch import batch_of  # noqa: E402
from pipec.runtime.profile.held import stage_bytes  # noqa: E402
from pipec.runtime.profile.stages import _measure  # noqa: E402
from pipec.sim.memory import program_memory  # noqa: E402

UNET = ROOT / "examples" / "unet.pipe"


def _unet(m: int = 4):
    sched = pipec.load(str(UNET), p=4, m=m)
    return sched, pipec.compile(str(UNET), p=4, m=m), load_model(str(ROOT / "examples" / "unet.py"))


def test_predicted_peaks_equal_the_measured_ones_on_the_unet():
    sched, prog, model = _unet()
    counted = stage_bytes(prog, model)
    assert all(b > 0 for b in counted["saved_bytes"]), counted
    predicted = program_memory(prog, sched, memory_overrides([counted]))
    pipe = LocalPipeline(prog, model.build_stage, model.loss_fn, options=StageOptions(dtype=model.dtype, seed=0))
    for runner in pipe.runners:
        runner.executor.measure_memory()
    inputs, targets = batch_of(model.batch(0), "batch(0)")
    pipe.step(inputs, targets)
    measured = [int(r.executor.peaks.device) for r in pipe.runners]
    saved = [int(rep.peak - rep.params) for rep in predicted]  # the peak less the parameters, as `pipec run --memory`
    assert measured == saved, (measured, saved)


def test_the_profiler_times_every_stage_of_a_graph():
    _, prog, model = _unet()
    prof = _measure(prog, model, reps=1, warmup=0, device=torch.device("cpu"), seed=0, loss_scale=None)
    assert len(prof.forward) == prog.num_stages and all(t > 0 for t in prof.forward)
    assert all(t > 0 for t in prof.full_backward)
