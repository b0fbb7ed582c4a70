"""Expert parallelism for `pipec profile`: the expert group's all-to-all timed on gloo (`all_to_all_single`),
the expert link fitted to it, and a model's MoE layers and bytes per all-to-all per stage.

The simulator charges one all-to-all of stage s `ep_latency + a2a_bytes[s] / ep_bandwidth`
(`pipec.sim.costs.CostModel.a2a_time`), `a2a_bytes` the bytes one rank sends to the others. So the fit is
linear in (latency, 1 / bandwidth) over what each process sends, `(n - 1) / n` of its buffer when every
process sends each other the same share, by least squares on relative errors (as the ring fit of
`pipec.runtime.profile.collectives`, so small, latency-bound sizes count as much as large ones).

MoE layers are the model contract's experts modules (an integer attribute `num_experts`, docs/runtime.md):
each stage's count goes into the cost file's `moe_layers`, and the tokens its experts modules receive on
micro-batch 0 of `batch(0)` (tokens times top-k rows, as routed) give `a2a_bytes` for an expert group of
`ep`: the rows' bytes times (ep - 1) / ep, what leaves a rank when routing spreads them evenly.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipec.ir.program import Program
from pipec.runtime.errors import PipelineError
from pipec.runtime.model.contract import Model
from pipec.runtime.model.moe import expert_modules
from pipec.runtime.profile.collectives import fit_relative
from pipec.runtime.profile.common import rounded, stage_modules

# 4 KiB .. 16 MiB per process, by factors of 4, as the collectives are timed
A2A_SIZES = tuple(4096 * 4**k for k in range(7))


def sent_bytes(nbytes: float, n: int) -> float:
    """What one process of n sends to the others in an even all-to-all of an `nbytes` buffer."""
    return nbytes * (n - 1) / n


def fit_link(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, bandwidth bit/s) of `seconds = latency + sent / bandwidth` from (bytes sent, seconds),
    least squares on relative errors; a negative term is dropped and the other fitted alone (bandwidth inf:
    no size term)."""
    rows = [(b, t) for b, t in samples if t > 0]
    if not rows:
        raise ValueError("no timed all-to-all to fit")
    t = np.array([r[1] for r in rows])
    return fit_relative(np.array([[1.0, r[0] * 8] for r in rows]), t)


@dataclass
class AllToAll:
    """An expert group's timed all-to-alls and the link fitted to them."""

    size: int  # processes in the group
    latency: float  # seconds
    bandwidth: float  # bits per second
    times: dict[int, float]  # buffer bytes per process -> median seconds
    how: str = ""

    def predict(self, nbytes: float) -> float:
        """The fitted link's seconds for an all-to-all of an `nbytes` buffer per process."""
        bw = self.bandwidth / 8
        return self.latency + (sent_bytes(nbytes, self.size) / bw if math.isfinite(bw) else 0.0)

    def worst_fit_error(self) -> float:
        return max(abs(self.predict(b) / t - 1) for b, t in self.times.items() if t > 0)

    def cost_keys(self) -> dict[str, Any]:
        return {"ep_latency": float(f"{self.latency:.6g}"), "ep_bandwidth": float(f"{self.bandwidth:.6g}")}

    def measured(self) -> dict[str, Any]:
        sizes = sorted(self.times)
        return {
            "size": self.size,
            "how": self.how,
            "bytes": sizes,
            "seconds": rounded([self.times[b] for b in sizes]),
            "worst_fit_error": float(f"{self.worst_fit_error():.3g}"),
        }


def measure_all_to_all(
    size: int,
    *,
    sizes: tuple[int, ...] = A2A_SIZES,
    reps: int = 10,
    warmup: int = 2,
    world: int | None = None,
    timeout: float = 600.0,
) -> AllToAll:
    """Time `all_to_all_single` on a gloo group of `size` fresh local processes at each of `sizes` bytes per
    process (float32), bound to CPUs as ranks of a run of `world` processes; each time the slowest
    process's between barriers, the median of `reps` after `warmup`; then `fit_link`."""
    from pipec.runtime.host import spawned

    if size < 2 or reps < 1 or warmup < 0:
        raise ValueError("an all-to-all needs a group of at least 2 processes, reps >= 1 and warmup >= 0")
    spec = {"sizes": sorted({int(b) for b in sizes if b > 0}), "reps": reps, "warmup": warmup}
    spec["world"] = max(world or size, size)
    per_rank = spawned.run_gloo(_a2a_rank, size, spec, timeout=timeout)
    if isinstance(per_rank, str):
        raise PipelineError(f"timing the all-to-all of an expert group of {size} failed: {per_rank}")
    times = {
        b: statistics.median(max(per_rank[i][b][r] for i in range(size)) for r in range(reps)) for b in spec["sizes"]
    }
    latency, bandwidth = fit_link([(sent_bytes(b, size), t) for b, t in times.items()])
    how = f"gloo all_to_all_single, {size} local processes, float32, slowest process, medians of {reps}"
    return AllToAll(size, latency, bandwidth, times, how)


def _a2a_rank(rank: int, world: int, port: int, spec: dict, out) -> None:
    from pipec.runtime.host import spawned
    from pipec.runtime.host.affinity import bind_local_rank

    bind_local_rank("auto", "gloo", rank, spec["world"])
    dist = spawned.join_gloo(rank, world, port, bind=False)
    try:
        result: dict[int, list[float]] = {}
        for nbytes in spec["sizes"]:
            count = max(world, -(-nbytes // 4 // world) * world)  # whole, equal shares per process
            src, dst = torch.ones(count), torch.empty(count)
            seconds = []
            for i in range(spec["warmup"] + spec["reps"]):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_to_all_single(dst, src)
                if i >= spec["warmup"]:
                    seconds.append(time.perf_counter() - t0)
            result[nbytes] = seconds
        out.put(("result", rank, result))
    finally:
        spawned.leave_gloo(dist, barrier=True)


def moe_layout(
    program: Program, model: Model, ep: int, *, seed: int = 0, device: str | torch.device = "cpu", dp: int = 1
) -> dict[str, list]:
    """Per stage, `moe_layers` (its experts modules) and `a2a_bytes` (the mean bytes one rank sends in one of
    its all-to-alls over an expert group of `ep`: the rows its experts modules receive on micro-batch 0 of
    `batch(0)`, with `dp` replicas replica 0's share, times (ep - 1) / ep); empty when no stage has one."""
    from pipec.runtime.exec.microbatch import as_args, batch_of, split, to_device

    device = torch.device(device)
    S, m = program.num_stages, program.num_sequences
    modules = stage_modules(model, S, seed, device)
    layers = [len(expert_modules(mod)) for mod in modules]
    if not any(layers):
        return {}
    rows: list[list[int]] = [[] for _ in range(S)]
    hooks = []
    for s, mod in enumerate(modules):
        for _, e in expert_modules(mod):
            hooks.append(e.register_forward_pre_hook(lambda _m, args, s=s: rows[s].append(_bytes(args[0]))))
    inputs, _ = batch_of(model.batch(0), f"{model.path}: batch(0)")
    if dp > 1:
        from pipec.runtime.exec.replicas import slice_replica

        inputs = slice_replica(inputs, dp, 0, "inputs")
    args = as_args(to_device(split(inputs, m, "inputs")[0], device, model.dtype))
    try:
        with torch.no_grad():
            for mod in modules:
                out = mod(*args)
                args = out if isinstance(out, tuple) else (out,)
    finally:
        for h in hooks:
            h.remove()
    a2a = [int(round(statistics.mean(r) * (ep - 1) / ep)) if r else 0 for r in rows]
    return {"moe_layers": layers, "a2a_bytes": a2a}


def split_as_run(B: list[float], W: list[float], full: list[float], moe: dict) -> tuple[list[float], list[float]]:
    """A split backward's per-stage B and W as a run with expert parallelism runs them: the first stage, when
    it has MoE layers, runs its whole backward at BWD (its all-to-alls belong to B: pipec.runtime.runner), so
    its B is its full backward and its W nothing. Unchanged without an expert group (`moe` without
    `a2a_bytes`) or without MoE layers on stage 0."""
    layers = moe.get("moe_layers") or [0]
    if "a2a_bytes" not in moe or not layers[0] or not B:
        return B, W
    return [full[0], *B[1:]], [0.0, *W[1:]]


def _bytes(x: Any) -> int:
    return int(x.numel() * x.element_size()) if isinstance(x, torch.Tensor) else 0
