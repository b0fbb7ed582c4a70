"""The data-parallel group's collectives `pipec profile` times (all-reduce, all-gather, reduce-scatter on
gloo), and the ring model fitted to them: the simulator's one formula, `pipec.sim.costs.ring_time`.

The fit is linear in (latency, 1 / bandwidth): `ring_terms` are the formula's coefficients of each,
read from the formula itself (at unit latency, and at unit seconds per byte), so the fit, its error and
the simulator agree by construction. Bandwidths here are bits per second, as the cost file's
`dp_bandwidth`; `pipec.sim.costs` works in bytes per second.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from pipec.runtime.errors import PipelineError
from pipec.runtime.profile.common import rounded
from pipec.sim.costs import RING_STEPS, ring_time

DP_KINDS = ("ddp", "fsdp")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# 4 KiB .. 16 MiB, by factors of 4: from latency-bound to bandwidth-bound on any link `pipec run` uses
COLLECTIVE_SIZES = tuple(4096 * 4**k for k in range(7))


def ring_terms(kind: str, n: int) -> tuple[float, float]:
    """The ring model's coefficients of a collective on n processes: (hops, share) with time = hops *
    latency + share * bytes / (bytes per second), `bytes` the whole buffer (the reduced one, the gathered
    one, the one scattered). Read off the simulator's `ring_time` at unit latency and at one second per
    byte, so there is one formula."""
    if kind not in COLLECTIVES or kind not in RING_STEPS:
        raise ValueError(f"unknown collective {kind!r} (known: {', '.join(COLLECTIVES)})")
    hops = float(ring_time(kind, n, 0.0, [(1.0, math.inf)]))
    share = float(ring_time(kind, n, 1.0, [(0.0, 1.0)]))
    return hops, share


def fit_ring(samples: list[tuple[str, int, float, float]]) -> tuple[float, float]:
    """The ring model's (latency s, bandwidth bit/s) from timed collectives `(kind, n, bytes, seconds)`,
    by least squares on relative errors: the model is linear in (latency, 1 / bandwidth), and weighting each
    sample by 1 / its time lets a 4 KiB all-gather (latency-bound) count as much as a 16 MiB all-reduce,
    which absolute errors would drown. A fit that makes either term negative (latency below measurement
    noise, or a bandwidth no size reaches) keeps that term at 0 and fits the other alone; bandwidth is
    then inf (no size term)."""
    import numpy as np

    rows = [(k, n, b, t) for k, n, b, t in samples if t > 0 and n > 1]
    if not rows:
        raise ValueError("no timed collective to fit (each needs n > 1 processes and a positive time)")
    A = np.array([[ring_terms(k, n)[0], ring_terms(k, n)[1] * b * 8] for k, n, b, _ in rows], dtype=float)
    return fit_relative(A, np.array([r[3] for r in rows], dtype=float))


def fit_relative(A, t) -> tuple[float, float]:
    """(latency s, bandwidth bit/s) of `t = A @ (latency, 1 / bandwidth)` by least squares on relative errors
    (each row weighted by 1 / its time); a fit that makes either term negative keeps it at 0 and fits the
    other alone (bandwidth inf: no size term). The ring fit and the all-to-all fit share it."""
    import numpy as np

    A, y = A / t[:, None], np.ones_like(t)
    (a, inv_b), *_ = np.linalg.lstsq(A, y, rcond=None)
    if a < 0 or inv_b <= 0:  # one term alone, the better of the two that are not negative
        fits = []
        for col in (0, 1):
            x = float(A[:, col] @ y / (A[:, col] @ A[:, col])) if A[:, col].any() else 0.0
            fits.append((float(np.sum((A[:, col] * x - y) ** 2)), col, max(x, 0.0)))
        _, col, x = min(fits)
        a, inv_b = (x, 0.0) if col == 0 else (0.0, x)
    return float(a), (1.0 / float(inv_b) if inv_b > 0 else math.inf)


@dataclass
class Collectives:
    """A data-parallel group's timed collectives and the ring model fitted to them."""

    size: int  # processes in the group
    kind: str  # ddp or fsdp: which collectives a stage's REDUCE_GRAD and UNSHARD are
    latency: float  # the fit over every kind and size: seconds per ring hop
    bandwidth: float  # bits per second
    times: dict[str, dict[int, float]]  # kind -> bytes -> median seconds
    per_kind: dict[str, tuple[float, float]]  # kind -> its own fit
    stage_bytes: list[int]  # each stage's parameter bytes, timed as they are
    how: str = ""

    def stage_times(self, kind: str) -> list[float]:
        """The measured seconds of collective `kind` on each stage's parameter bytes (0 for none)."""
        return [self.times[kind][b] if b > 0 else 0.0 for b in self.stage_bytes]

    def cost_keys(self, param_bytes: list[int]) -> dict[str, Any]:
        """The cost file's keys (pipec.sim.costs): the fit, the parameter bytes, and each stage's measured
        REDUCE_GRAD (all-reduce for ddp, reduce-scatter for fsdp) and, for fsdp, UNSHARD (all-gather)."""
        keys: dict[str, Any] = {
            "param_bytes": list(param_bytes),
            "dp_latency": float(f"{self.latency:.6g}"),
            "dp_bandwidth": float(f"{self.bandwidth:.6g}"),
        }
        keys["reduce_grad"] = rounded(self.stage_times("all_reduce" if self.kind == "ddp" else "reduce_scatter"))
        if self.kind == "fsdp":
            keys["unshard"] = rounded(self.stage_times("all_gather"))
        return keys

    def measured(self) -> dict[str, Any]:
        """The `[measured.collectives]` table: every size's median per kind, and each kind's own fit."""
        sizes = sorted({b for per in self.times.values() for b in per})
        table: dict[str, Any] = {"size": self.size, "kind": self.kind, "how": self.how, "bytes": sizes}
        for k, per in self.times.items():
            table[f"{k}_s"] = rounded([per[b] for b in sizes])
            a, b = self.per_kind[k]
            table[f"{k}_latency"], table[f"{k}_bandwidth"] = float(f"{a:.6g}"), float(f"{b:.6g}")
        return table

    def predict(self, kind: str, nbytes: float) -> float:
        """The fitted model's seconds for collective `kind` of `nbytes` on this group (the simulator's
        `ring_time` over equal hops; bandwidth to bytes per second)."""
        return float(ring_time(kind, self.size, nbytes, [(self.latency, self.bandwidth / 8)] * self.size))

    def worst_fit_error(self) -> float:
        """The largest relative error of the fit over the timed collectives."""
        return max(abs(self.predict(k, b) / t - 1) for k, per in self.times.items() for b, t in per.items() if t > 0)


def measure_collectives(
    size: int,
    *,
    kind: str = "ddp",
    sizes: tuple[int, ...] | None = None,
    stage_bytes: list[int] | tuple[int, ...] = (),
    reps: int = 10,
    warmup: int = 2,
    dtype: torch.dtype = torch.float32,
    world: int | None = None,
    groups: int = 1,
    timeout: float = 600.0,
) -> Collectives:
    """Time all-reduce, all-gather and reduce-scatter on a gloo group of `size` fresh local processes, at
    each of `sizes` bytes (default COLLECTIVE_SIZES) and at each stage's `stage_bytes`, and fit the ring
    model (`fit_ring`).

    Each collective's time is the slowest process's, between barriers (a collective ends for the step when
    it ends everywhere), the median of `reps` after `warmup`. The processes are bound to CPUs as `pipec run`
    binds the ranks of a job of `world` processes on this machine (default: `size`): with the p x dp
    ranks of a PP x DP run sharing it, each gets the CPUs a rank of that run would. With `groups` > 1,
    `groups` such groups (rank g * size + i in group g, the "dp" dim of a ("pp", "dp") mesh) time theirs
    at once, as the pipeline ranks' groups may in a run; their medians are pooled."""
    from pipec.runtime.host import spawned

    if size < 2 or groups < 1 or reps < 1 or warmup < 0:
        raise ValueError("collectives need a group of at least 2 processes, groups >= 1, reps >= 1, warmup >= 0")
    if kind not in DP_KINDS:
        raise ValueError(f"kind must be one of {', '.join(DP_KINDS)}, got {kind!r}")
    nproc = size * groups
    world = max(world or nproc, nproc)
    sizes = COLLECTIVE_SIZES if sizes is None else sizes
    timed_sizes = sorted({int(b) for b in (*sizes, *stage_bytes) if b > 0})
    spec = dict(size=size, sizes=timed_sizes, reps=reps, warmup=warmup, dtype=str(dtype).removeprefix("torch."))
    spec["world"] = world
    per_rank = spawned.run_gloo(_collective_rank, nproc, spec, timeout=timeout)
    if isinstance(per_rank, str):
        raise PipelineError(f"timing the collectives of a data-parallel group of {size} failed: {per_rank}")
    times: dict[str, dict[int, float]] = {}
    for k in COLLECTIVES:
        times[k] = {}
        for b in timed_sizes:
            slowest = [  # per group and rep, the slowest of the group's processes
                max(per_rank[g * size + i][k][b][r] for i in range(size)) for g in range(groups) for r in range(reps)
            ]
            times[k][b] = statistics.median(slowest)
    samples = [(k, size, b, t) for k, per in times.items() for b, t in per.items()]
    per_kind = {k: fit_ring([x for x in samples if x[0] == k]) for k in COLLECTIVES}
    latency, bandwidth = fit_ring(samples)
    binding = "unbound" if per_rank[0]["cpus"] is None else f"each on {len(per_rank[0]['cpus'])} CPU(s)"
    how = (
        f"gloo, {groups} group(s) of {size} local processes at once, bound as {world} ranks of a run ({binding}), "
        f"{str(dtype).removeprefix('torch.')}, slowest process, medians of {reps}"
    )
    return Collectives(size, kind, latency, bandwidth, times, per_kind, [int(b) for b in stage_bytes], how)


def _collective_rank(rank: int, world: int, port: int, spec: dict, out) -> None:
    from pipec.runtime.host import spawned
    from pipec.runtime.host.affinity import bind_local_rank

    cpus = bind_local_rank("auto", "gloo", rank, spec["world"])  # as a rank of the whole run is bound
    dist = spawned.join_gloo(rank, world, port, bind=False)
    try:
        n = spec["size"]
        groups = [dist.new_group(list(range(g * n, (g + 1) * n))) for g in range(world // n)]
        group = groups[rank // n]
        dtype = getattr(torch, spec["dtype"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        result: dict[str, Any] = {"cpus": cpus}
        for k in COLLECTIVES:
            result[k] = {}
        for nbytes in spec["sizes"]:
            count = max(n, -(-nbytes // itemsize // n) * n)  # whole shards, as FSDP pads them
            full = torch.ones(count, dtype=dtype)
            shard = torch.ones(count // n, dtype=dtype)
            ops = {
                "all_reduce": lambda f=full: dist.all_reduce(f, group=group),
                "all_gather": lambda f=full, h=shard: dist.all_gather_single(f, h, group=group),
                "reduce_scatter": lambda f=full, h=shard: dist.reduce_scatter_single(h, f, group=group),
            }
            for k, op in ops.items():  # the kinds alternate at each size, so load drifts hit them alike
                seconds = []
                for i in range(spec["warmup"] + spec["reps"]):
                    dist.barrier()
                    t0 = time.perf_counter()
                    op()
                    if i >= spec["warmup"]:
                        seconds.append(time.perf_counter() - t0)
                result[k][nbytes] = seconds
        out.put(("result", rank, result))
    finally:
        spawned.leave_gloo(dist, barrier=True)
