"""`pipec profile --slices N`: each stage timed on token slices, and the cost model's `attn` and `op_fixed`
(`Slicing.weight`, docs/terapipe.md) fitted to them by least squares.

Slices of whole N-ths of the sequence at every context that leaves room for them run through the stage
module's key/value cache interface (pipec.runtime.exec.slices; without one, prefixes of the sequence at
context 0); the fit's residual goes into the cost file's `[measured.slices]`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipec.ir.program import Program
from pipec.runtime.errors import PipelineError
from pipec.runtime.exec.microbatch import as_args, batch_of, split, to_device
from pipec.runtime.model.contract import Model
from pipec.runtime.profile.common import rounded, stage_modules


@dataclass
class SliceFit:
    """Per stage, the medians of F plus the full backward of token slices (`points`: (length, context)
    pairs of a sequence of `seqlen` tokens), and the least-squares fit of the cost model's slice time
    (`Slicing.weight`): t(l, c) = f + u l / L + v l (2c + l + 1) / (L (L + 1)), so attn = v / (u + v) and
    op_fixed = f / 2 (a slice runs two ops, F and its backward). `residual` is the fit's root-mean-square
    relative error per stage, `worst` its largest; `how` says whether the contexts were real
    (the key/value cache interface) or prefixes at context 0."""

    seqlen: int
    points: list[tuple[int, int]]
    forward: list[list[float]]
    backward: list[list[float]]
    attn: list[float]
    op_fixed: list[float]
    residual: list[float]
    worst: list[float]
    how: str

    def measured(self) -> dict[str, Any]:
        return {
            "how": self.how,
            "seqlen": self.seqlen,
            "lengths": [n for n, _ in self.points],
            "contexts": [c for _, c in self.points],
            "forward": [rounded(x) for x in self.forward],
            "backward": [rounded(x) for x in self.backward],
            "fit_residual": rounded(self.residual),
            "fit_worst": rounded(self.worst),
        }


SHORTEST = 4  # tokens: the shortest slice `slice_points` adds below the n-ths


def slice_points(seqlen: int, n: int, contexts: bool = True) -> list[tuple[int, int]]:
    """(length, context) of every slice between boundaries at whole n-ths of the sequence (rounded down);
    without `contexts`, the prefixes only (context 0). Then slices shorter than an n-th, halving down to
    `SHORTEST` tokens, at context 0 and (with `contexts`) at the end of the sequence. Why: what an op costs
    whatever its length (`op_fixed`) is the fit's intercept, which slices of n-ths alone leave to an
    extrapolation from long slices; the dynamic program of `pipec slice` picks among short slices exactly
    where that intercept decides (a measured 114-slice cut ran 2.9x slower than unsliced while fitted
    without them, docs/terapipe.md)."""
    edges = sorted({seqlen * k // n for k in range(n + 1)})
    points = [(b - a, a) for ia, a in enumerate(edges) for b in edges[ia + 1 :] if contexts or a == 0]
    length = (seqlen // n) // 2
    while length >= SHORTEST:
        points += [(length, 0)] + ([(length, seqlen - length)] if contexts else [])
        length //= 2
    return points


def fit_slices(seqlen: int, points: list[tuple[int, int]], times: list[float]) -> tuple[float, float, float, float]:
    """(attn, op_fixed, rms relative residual, worst relative residual) of the least-squares fit, on
    relative errors, of one stage's slice times (F plus backward: two ops) to the cost model's form (see SliceFit)."""
    import numpy as np

    L = float(seqlen)
    l = np.array([p[0] for p in points], dtype=float)  # noqa: E741
    c = np.array([p[1] for p in points], dtype=float)
    X = np.stack([np.ones_like(l), l / L, l * (2 * c + l + 1) / (L * (L + 1))], axis=1)
    y = np.asarray(times, dtype=float)
    # relative errors, so that the short slices, which fix the intercept, weigh as much as the long ones
    scale = 1.0 / np.where(y > 0, y, 1.0)
    (f, u, v), *_ = np.linalg.lstsq(X * scale[:, None], y * scale, rcond=None)
    rel = (X @ np.array([f, u, v]) - y) * scale
    u, v = max(u, 0.0), max(v, 0.0)
    attn = v / (u + v) if u + v > 0 else 0.0
    return float(attn), max(float(f), 0.0) / 2, float(np.sqrt(np.mean(rel**2))), float(np.abs(rel).max())


def measure_slices(
    program: Program,
    model: Model,
    n: int,
    *,
    reps: int = 20,
    warmup: int = 3,
    device: str | torch.device = "cpu",
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> SliceFit:
    """Time F and the full backward of every stage on token slices of micro-batch 0 of `batch(0)` (its
    dim 1, the tokens, cut at whole n-ths: `slice_points`), and fit `attn` and `op_fixed` per stage.

    With the key/value cache interface (pipec.runtime.exec.slices: `module(*inputs, past_kv=past) -> (output,
    kv)`), a slice of l tokens after c runs as the runtime runs it: the keys and values of the c earlier
    tokens (computed untimed) enter as leaves that require grad, and its backward runs from its output's
    gradient and, unless it is the sequence's last slice, its own keys' and values' (as the later slices
    return them). Without the interface only prefixes are timed (context 0: the attention over the slice
    itself), which the fit extends to other contexts by the cost model's form. Each stage's input is the
    earlier stages' output on the whole sequence, computed once, untimed. Each point is timed once per
    round, `warmup` + `reps` rounds, and its fastest run kept (the fit needs the points' relative times,
    which other work on the machine blurs; a minimum is the least blurred)."""
    from pipec.runtime.exec.slices import takes_past

    say = progress or (lambda _: None)
    device = torch.device(device)
    S, m = program.num_stages, program.num_sequences
    modules = stage_modules(model, S, seed, device)
    cached = all(takes_past(mod) for mod in modules)
    inputs, targets = batch_of(model.batch(0), f"{model.path}: batch(0)")
    x0 = as_args(to_device(split(inputs, m, "inputs")[0], device, model.dtype))
    y0 = to_device(split(targets, m, "targets")[0], device)
    if not isinstance(x0[0], torch.Tensor) or x0[0].dim() < 2 or not isinstance(y0, torch.Tensor):
        raise PipelineError("--slices cuts the inputs and targets along dim 1 (the tokens): give tensors of 2+ dims")
    L = int(x0[0].shape[1])
    points = slice_points(L, n, cached)
    if len({a for a, _ in points} if not cached else points) < 3:
        raise PipelineError(f"--slices {n}: fitting attn and op_fixed takes 3 or more slice lengths")
    how = "key/value cache, every context" if cached else "prefixes at context 0 (no key/value cache interface)"
    say(f"timing F and backward of {len(points)} token slices per stage ({how}), {warmup} + {reps} rounds each")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def part(args: tuple, a: int, b: int) -> tuple:
        return tuple(t[:, a:b] if isinstance(t, torch.Tensor) and t.dim() >= 2 else t for t in args)

    def leaf(t):
        return t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t

    fwd: list[list[float]] = []
    bwd: list[list[float]] = []
    args = x0
    for s, mod in enumerate(modules):
        last = s == S - 1
        tf: list[list[float]] = [[] for _ in points]
        tb: list[list[float]] = [[] for _ in points]
        for rep in range(warmup + reps):  # rounds over every point: a busy spell slows them all alike
            for k, (l, c) in enumerate(points):  # noqa: E741
                with torch.no_grad():
                    past = mod(*part(args, 0, c), past_kv=())[1] if cached and c else ()
                past = tuple(leaf(t) for t in past)
                xs = tuple(leaf(t) for t in part(args, c, c + l))
                sync()
                t0 = time.perf_counter()
                out = mod(*xs, past_kv=past) if cached else mod(*xs)
                y, kv = out if cached else (out, ())
                if last:
                    y = model.loss_fn(y, y0[:, c : c + l]) * (l / L)
                sync()
                t1 = time.perf_counter()
                outs = [y] + ([t for t in kv if t.requires_grad] if c + l < L else [])
                grads = [None if last and j == 0 else torch.ones_like(t) for j, t in enumerate(outs)]
                torch.autograd.backward(outs, grads)
                sync()
                t2 = time.perf_counter()
                if rep >= warmup:
                    tf[k].append(t1 - t0)
                    tb[k].append(t2 - t1)
        # the fastest of each point's runs: on a machine shared with other work, a median measures it too
        per_f = [min(x) for x in tf]
        per_b = [min(x) for x in tb]
        fwd.append(per_f)
        bwd.append(per_b)
        mod.zero_grad(set_to_none=True)
        if not last:
            with torch.no_grad():
                args = as_args(mod(*args))
        say(f"stage {s}: {len(points)} slices timed")
    fits = [fit_slices(L, points, [f + b for f, b in zip(fs, bs)]) for fs, bs in zip(fwd, bwd)]
    return SliceFit(
        L,
        points,
        fwd,
        bwd,
        [a for a, _, _, _ in fits],
        [o for _, o, _, _ in fits],
        [r for _, _, r, _ in fits],
        [w for _, _, _, w in fits],
        how,
    )
