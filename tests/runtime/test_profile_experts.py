"""pipec profile's expert parallelism (pipec/runtime/profile/experts.py): the expert link's fit (exact on
synthetic timings, in the simulator's formula), one real gloo all_to_all_single measurement (positive, finite
numbers: their size is the machine's), and a model's MoE layers and bytes per all-to-all per stage."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pipec.api import load  # noqa: E402
from pipec.ir.dataparallel import DataParallel  # noqa: E402
from pipec.ir.experts import Experts  # noqa: E402
from pipec.passes.compiler import compile_schedule  # noqa: E402
from pipec.runtime import load_model  # noqa: E402
from pipec.runtime.profile.experts import AllToAll, fit_link, measure_all_to_all, moe_layout, sent_bytes  # noqa: E402
from pipec.sim.costs import cost_model  # noqa: E402

SIZES = [4096 * 4**k for k in range(7)]

# Two stages; stage 0 has one experts module and stage 1 two, each receiving its tokens top-2 (rows x 2).
MOE_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn

    WIDTH, TOKENS = 8, 12

    class Experts(nn.Module):
        num_experts = 4

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, WIDTH, WIDTH, dtype=torch.float64))

        def forward(self, tokens, counts):
            return tokens

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Experts()

        def forward(self, x):
            rows = x.repeat_interleave(2, dim=0)  # top-2: every token twice
            return x + self.experts(rows, [rows.shape[0]]).view(x.shape[0], 2, -1).mean(1)

    def build_stage(stage, num_stages):
        return nn.Sequential(*[MoE() for _ in range(stage + 1)])

    def loss_fn(out, y):
        return ((out - y) ** 2).mean()

    def batch(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4 * TOKENS, WIDTH, generator=g, dtype=torch.float64)
        return x, torch.zeros_like(x)
    """
)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("latency,bandwidth", [(50e-6, 10e9), (10e-3, 1e8)])
def test_the_fit_recovers_the_expert_link_in_the_simulators_formula(n, latency, bandwidth):
    samples = [(sent_bytes(b, n), latency + sent_bytes(b, n) * 8 / bandwidth) for b in SIZES]
    a, bw = fit_link(samples)
    assert a == pytest.approx(latency, rel=1e-9) and bw == pytest.approx(bandwidth, rel=1e-9)
    fitted = AllToAll(n, a, bw, {b: t for b, (_, t) in zip(SIZES, samples)})
    assert fitted.worst_fit_error() < 1e-9
    # the cost file's keys give the simulator the same seconds for what one rank sends
    sched = load("1f1b", p=2, m=2)
    costs = cost_model(sched, [{**fitted.cost_keys(), "a2a_bytes": sent_bytes(SIZES[3], n), "_from": "t"}])
    t = costs.a2a_time(np.array([0]), np.array([0]), n)[0]
    assert t == pytest.approx(fitted.predict(SIZES[3]), rel=1e-5)


def test_latency_alone_fits_with_no_size_term():
    a, bw = fit_link([(b, 1e-3) for b in SIZES])
    assert a == pytest.approx(1e-3) and math.isinf(bw)


def test_moe_layout_counts_the_experts_modules_and_the_rows_they_receive(tmp_path):
    path = tmp_path / "moe_model.py"
    path.write_text(MOE_FILE)
    model = load_model(str(path))
    prog = compile_schedule(load("1f1b", p=2, m=4), None, DataParallel(2), Experts(2, 4)).program
    out = moe_layout(prog, model, 2, dp=2)
    # micro-batch 0 of replica 0: 48 rows / 2 replicas / 4 micro-batches = 6 tokens, top-2: 12 rows of 8 floats
    assert out == {"moe_layers": [1, 2], "a2a_bytes": [12 * 8 * 8 // 2] * 2}


def test_a_real_all_to_all_on_two_gloo_processes():
    a2a = measure_all_to_all(2, sizes=(4096, 262144), reps=2, warmup=1, timeout=120)
    assert a2a.latency >= 0 and a2a.bandwidth > 0 and all(t > 0 for t in a2a.times.values())
    keys = a2a.cost_keys()
    assert set(keys) == {"ep_latency", "ep_bandwidth"} and math.isfinite(keys["ep_latency"])
    assert a2a.measured()["bytes"] == [4096, 262144]


def test_the_cost_file_splits_the_first_stages_backward_as_an_expert_parallel_run_does():
    """Under --ep with MoE layers on stage 0, the run computes its whole backward at BWD (its all-to-alls
    belong to B), so the cost file's B[0] is its full backward and W[0] nothing; without an expert group, or
    without layers on stage 0, the measured split stands."""
    from pipec.runtime.profile.stages import Profile

    def doc(moe: dict) -> dict:
        prof = Profile(
            "dualpipe-v", (("p", 1), ("m", 2)), True, [1.0, 1.0], [2.0, 2.0], [0.01, 1.2], [1.99, 0.8], [0.0, 0.0],
            [8, 0], [0, 8], moe=moe,
        )  # fmt: skip
        d = prof.cost_doc()
        return {"B": d["B"], "W": d["W"]}

    assert doc({"moe_layers": [1, 1], "a2a_bytes": [64, 64]}) == {"B": [2.0, 1.2], "W": [0.0, 0.8]}
    assert doc({"moe_layers": [1, 1]}) == {"B": [0.01, 1.2], "W": [1.99, 0.8]}  # no expert group
    assert doc({"moe_layers": [0, 1], "a2a_bytes": [0, 64]}) == {"B": [0.01, 1.2], "W": [1.99, 0.8]}
