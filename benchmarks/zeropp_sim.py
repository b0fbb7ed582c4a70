"""The ZeroPP claim in simulation: the ZeroPP-style schedule against 1F1B + FSDP and interleaved 1F1B + FSDP.

ZeroPP (Tang et al., 2024, arXiv:2402.03791) trains with pipeline parallelism plus FSDP-style sharding
(ZeRO-3) of each stage's parameters over its data-parallel replicas, and schedules the parameter
all-gathers with the pipeline: a block of b micro-batches runs through one model chunk per gather. This
script simulates, per condition (DP link bandwidth, micro-batches per step), every configuration of
three families and prints one JSON line each, then one summary line per condition and memory budget:

- `1f1b`: the library's 1f1b under `--dp N --dp-kind fsdp` (the lowering's default windows: each stage
  gathered from its first compute to its last, so all step; `prefetch` 1);
- `interleaved`: interleaved-1f1b, v chunks, the lowering's default windows with `max_gathered` k (None:
  every chunk gathered all step; k < v: Belady windows, re-gathering what was evicted);
- `zeropp`: schedules/zeropp.pipe, v chunks, blocks of b micro-batches, `ahead` ops of lookahead: the
  schedule places its own UNSHARD/RESHARD/REDUCE_GRAD (docs/language.md section 16).

The costs are *modelled*, not profiled (docs/zeropp.md says why): a GPT-2-medium-like (or, `--model
2.7b`, a GPT-3-2.7B-like) decoder, sequence 1024, one sequence per micro-batch, bf16, on GPUs sustaining
`--tflops` (default 400) per second; per layer F = 24 s h^2 (1 + s / 6h) flop / tflops, B = 2 F; the
gathered parameters 2 bytes per parameter (12 h^2 per layer); activations sent between stages s h * 2
bytes. Memory (bytes, the memory model of pipec.sim.memory): activations kept per layer and
micro-batch 34 s h bytes (Korthikanti et al. 2022 with flash attention, no s^2 term); `params` 4 bytes
per parameter (bf16 weights and gradients, whole while gathered, a 1/N shard otherwise); the optimizer's
sharded fp32 state (12 bytes per parameter / N) is the same for every schedule and left out.

    python benchmarks/zeropp_sim.py                  # the default sweep (about a minute on one core)
    python benchmarks/zeropp_sim.py --model 2.7b     # a model whose parameters dominate memory
    python benchmarks/zeropp_sim.py --bandwidth 100 --m 16 --quiet   # one condition, summaries only
    python benchmarks/zeropp_sim.py --smoke          # one condition, v=2, one budget: the format (tests)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from sidebyside import emit, smoke_flag

from pipec.api import load
from pipec.errors import PipecError
from pipec.ir.dataparallel import DataParallel
from pipec.passes.compiler import compile_schedule
from pipec.sim.costs import cost_model
from pipec.sim.simulate import simulate, stats


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    layers: int
    seq: int = 1024

    @property
    def layer_params(self) -> float:
        return 12.0 * self.hidden**2 + 13.0 * self.hidden

    def layer_forward_s(self, tflops: float) -> float:
        h, s = self.hidden, self.seq
        return 24.0 * s * h * h * (1.0 + s / (6.0 * h)) / (tflops * 1e12)

    @property
    def act_bytes(self) -> float:  # the activation a stage sends on: s h in bf16
        return 2.0 * self.seq * self.hidden

    @property
    def layer_act_memory(self) -> float:  # kept for the backward, per layer and micro-batch
        return 34.0 * self.seq * self.hidden


MODELS = {
    "medium": Model("gpt2-medium-like (h 1024, 24 layers)", 1024, 24),
    "2.7b": Model("gpt3-2.7b-like (h 2560, 32 layers)", 2560, 32),
}


def configs(p: int, m: int, vs: tuple[int, ...]):
    """(family, library name, parameters, DataParallel extras, label) of every configuration tried."""
    yield "1f1b", "1f1b", dict(p=p, m=m), {}, "1f1b"
    for v in vs:
        for k in [None, *range(1, v)]:
            yield "interleaved", "interleaved-1f1b", dict(p=p, v=v, m=m), {"max_gathered": k}, f"v{v} k{k}"
        for b in (p, 2 * p, 4 * p):
            if b > m or m % b:
                continue
            for ahead in (1, 2, 3, 4):
                label = f"v{v} b{b} ahead{ahead}"
                yield "zeropp", "zeropp", dict(p=p, v=v, m=m, b=b, ahead=ahead), {}, label


@dataclass(frozen=True)
class Profiled:
    """A model as `pipec profile --dp N --dp-kind fsdp` measured it (a cost file): the whole model's
    forward and backward seconds, parameter bytes and saved-activation bytes (the sums over the profiled
    stages), the message it sends between stages, and the DP group's ring latency and bandwidth. Split
    evenly: a stage holding a fraction x of the model costs x of each sum (the profiled model's layers
    are identical blocks, so this is the uniform split of them)."""

    name: str
    forward_s: float
    backward_s: float
    param_bytes: float  # weights, in the profiled dtype; gradients are as many bytes again
    saved_bytes: float  # kept for the backward, per micro-batch
    saved_measured: bool
    act_bytes: float
    dp_latency: float
    dp_bandwidth: float
    latency: float
    overhead: float


def read_profile(path: str) -> Profiled:
    from pipec.sim.cost_files import read_cost_file

    doc = read_cost_file(path)

    def total(key: str) -> float:
        v = doc.get(key)
        if v is None:
            raise SystemExit(f"{path}: the cost file has no `{key}`: profile with --dp N --dp-kind fsdp")
        return float(sum(v)) if isinstance(v, list | tuple) else float(v)

    acts = doc.get("act_bytes") or [0.0]
    act = float(max(acts) if isinstance(acts, list | tuple) else acts)
    measured = doc.get("saved_bytes") is not None
    # Without measured saved bytes: 17 messages' worth per stage (a block keeps about 34 s h bytes in half
    # precision against its s h message: Korthikanti et al. 2022), said in the output as an estimate.
    saved = total("saved_bytes") if measured else 17.0 * act * len(doc.get("F") or [1])
    return Profiled(
        name=f"profiled ({path})",
        forward_s=total("F"),
        backward_s=total("B"),
        param_bytes=total("param_bytes"),
        saved_bytes=saved,
        saved_measured=measured,
        act_bytes=act,
        dp_latency=float(doc["dp_latency"]),
        dp_bandwidth=float(doc["dp_bandwidth"]),
        latency=float(doc.get("latency", 0.0)),
        overhead=float(doc.get("overhead", 0.0)),
    )


def stage_inputs(args: argparse.Namespace, fraction: float, bw: float) -> tuple[dict, dict]:
    """The cost document and memory model of a stage holding `fraction` of the model, at DP link `bw`
    (Gbit/s; for a profile, a multiple of the measured bandwidth)."""
    if args.profiled:
        pr = args.profiled
        doc = {
            "T_F": pr.forward_s / args.p,  # a rank's share of the model (the cost model splits it over chunks)
            "T_B": pr.backward_s / args.p,
            "act_bytes": pr.act_bytes,
            "param_bytes": pr.param_bytes * fraction,
            "dp_bandwidth": pr.dp_bandwidth * bw,
            "dp_latency": pr.dp_latency,
            "latency": pr.latency,
            "overhead": pr.overhead,
        }
        memory = {"act": pr.saved_bytes * fraction, "params": 2.0 * pr.param_bytes * fraction}
        return doc, memory
    model = MODELS[args.model]
    layers = model.layers * fraction
    t_f = model.layers / args.p * model.layer_forward_s(args.tflops)  # a rank's share of the model
    doc = {
        "T_F": t_f,
        "T_B": 2.0 * t_f,
        "act_bytes": model.act_bytes,
        "param_bytes": layers * model.layer_params * 2.0,
        "dp_bandwidth": bw * 1e9,
        "dp_latency": args.latency * 1e-6,
        "latency": 5e-6,
        "bandwidth": args.pp_bandwidth * 1e9,
    }
    memory = {"act": layers * model.layer_act_memory, "params": layers * model.layer_params * 4.0}
    return doc, memory


def run(args: argparse.Namespace) -> None:
    p, n = args.p, args.dp
    model_name = args.profiled.name if args.profiled else MODELS[args.model].name
    dp_kind = DataParallel(n, "fsdp")
    rows = []
    for m in args.m:
        for family, name, params, extra, label in configs(p, m, tuple(args.v)):
            try:
                sched = load(name, **params)
            except PipecError as e:  # a `require` of the schedule refuses these parameters
                print(json.dumps({"skip": name, "params": params, "why": str(e).splitlines()[0]}), file=sys.stderr)
                continue
            fraction = 1.0 / sched.num_stages  # of the model, per stage
            memory = stage_inputs(args, fraction, args.bandwidth[0])[1]
            dp = DataParallel(n, "fsdp", prefetch=args.prefetch, max_gathered=extra.get("max_gathered"))
            t0 = time.perf_counter()
            c = compile_schedule(sched, memory, dp)
            compile_s = time.perf_counter() - t0
            prog = c.program
            peak = max(r.peak for r in c.memory)
            unshards = sum(1 for r in prog.ranks for ins in r.instructions() if str(ins).startswith("UNSHARD"))
            for bw in args.bandwidth:
                doc = stage_inputs(args, fraction, bw)[0]
                costs = cost_model(sched, [doc])
                st = stats(simulate(prog, costs))
                row = {
                    "benchmark": "zeropp_sim",
                    "model": model_name,
                    "family": family,
                    "config": label,
                    "schedule": name,
                    "params": params,
                    "dp": n,
                    "dp_kind": dp_kind.kind,
                    "prefetch": args.prefetch,
                    "m": m,
                    ("dp_bandwidth_x_measured" if args.profiled else "dp_bandwidth_gbps"): bw,
                    "step_ms": round(st.makespan * 1e3, 4),
                    "compute_ms": round(st.ideal * 1e3, 4),
                    "bubble": round(st.bubble_rate, 4),
                    "peak_memory_gb": round(peak / 1e9, 4),
                    "unshards_per_step": unshards,
                    "gathered_gb_per_step": round(unshards * doc["param_bytes"] * (n - 1) / n / 1e9, 3),
                    "compile_s": round(compile_s, 3),
                }
                rows.append(row)
                if not args.quiet:
                    emit(row)
    summarize(rows, args)


def summarize(rows: list[dict], args: argparse.Namespace) -> None:
    """Per condition: 1F1B + FSDP's step time and peak memory, and the fastest configuration of each family
    whose peak fits the budget (1F1B's peak, and each budget of --budgets times it)."""
    bw_key = "dp_bandwidth_x_measured" if args.profiled else "dp_bandwidth_gbps"
    conds = sorted({(r["m"], r[bw_key]) for r in rows})
    for m, bw in conds:
        here = [r for r in rows if r["m"] == m and r[bw_key] == bw]
        base = next(r for r in here if r["family"] == "1f1b")
        for scale in args.budgets:
            budget = base["peak_memory_gb"] * scale
            best = {}
            for fam in ("interleaved", "zeropp"):
                fits = [r for r in here if r["family"] == fam and r["peak_memory_gb"] <= budget * (1 + 1e-9)]
                if fits:
                    b = min(fits, key=lambda r: r["step_ms"])
                    best[fam] = {
                        "config": b["config"],
                        "step_ms": b["step_ms"],
                        "peak_memory_gb": b["peak_memory_gb"],
                        "gain_vs_1f1b": round(1 - b["step_ms"] / base["step_ms"], 4),
                    }
                else:
                    best[fam] = None
            z, i = best["zeropp"], best["interleaved"]
            emit(
                {
                    "benchmark": "zeropp_sim_summary",
                    "summary": "zeropp_sim",
                    "model": base["model"],
                    "m": m,
                    "dp": base["dp"],
                    bw_key: bw,
                    "budget_gb": round(budget, 4),
                    "budget_x_1f1b": scale,
                    "1f1b": {"step_ms": base["step_ms"], "peak_memory_gb": base["peak_memory_gb"]},
                    "interleaved": i,
                    "zeropp": z,
                    "zeropp_gain_vs_interleaved": None if not (z and i) else round(1 - z["step_ms"] / i["step_ms"], 4),
                }
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="medium")
    ap.add_argument("--p", type=int, default=4, help="pipeline ranks (default 4)")
    ap.add_argument("--dp", type=int, default=8, help="data-parallel replicas (default 8)")
    ap.add_argument("--v", type=int, nargs="+", default=[2, 4], help="chunks per rank tried (default 2 4)")
    ap.add_argument("--m", type=int, nargs="+", default=[8, 16, 32, 64], help="micro-batches per step")
    ap.add_argument(
        "--bandwidth", type=float, nargs="+", default=[25, 100, 400, 1600, 3200], help="DP link, Gbit/s (default sweep)"
    )
    ap.add_argument("--latency", type=float, default=10.0, help="DP ring hop latency, microseconds (default 10)")
    ap.add_argument("--pp-bandwidth", type=float, default=400.0, help="pipeline link, Gbit/s (default 400)")
    ap.add_argument("--tflops", type=float, default=400.0, help="sustained TFLOP/s per GPU (default 400)")
    ap.add_argument("--prefetch", type=int, default=1, help="the lowering's prefetch for default windows")
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0, 1.25], help="memory budgets x 1F1B's peak")
    ap.add_argument("--quiet", action="store_true", help="summaries only")
    ap.add_argument(
        "--profiled",
        metavar="COSTS",
        type=read_profile,
        help="take the model from a `pipec profile --dp N --dp-kind fsdp` cost file; --bandwidth is then a "
        "multiple of the measured DP bandwidth (default 1), --p the pipeline ranks",
    )
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # one condition (m=8, 100 Gbit/s), v=2, one budget: the format (tests)
        args.m, args.v, args.bandwidth, args.budgets = [8], [2], [100.0], [1.0]
    if args.profiled and args.bandwidth == ap.get_default("bandwidth"):
        args.bandwidth = [1.0]
    run(args)


if __name__ == "__main__":
    main()
