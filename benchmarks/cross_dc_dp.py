"""PP x DP across two datacenters: put the pipeline across the slow link, or data parallelism across it?

Eight GPUs, a pipeline of p = 4 ranks replicated dp = 2 times (ddp), two datacenters of four GPUs joined
by a 40 ms / 10 Gbps link (the `dc` class inside each: 10 us, 100 Gbps). Two placements of the same job:

- `pp-across`: ranks 0-1 in east, 2-3 in west, both replicas of a rank in its own datacenter: the
  pipeline's activations and gradients cross the link (messages share it, as in docs/cross-dc.md), the
  gradient all-reduce runs inside a datacenter;
- `dp-across`: each replica's whole pipeline in one datacenter (replica 0 east, replica 1 west, the
  topology's `replica_dcs`): only the all-reduce crosses the link.

Models: GPT-3 6.7B's and GPT-3 XL's (1.3B) shapes, 2048-token micro-batches, bf16, on A100-class GPUs at
45% of peak (docs/cross-dc.md shows the arithmetic). Each placement runs the same global batch (dp x m
micro-batches), so step times compare directly. In `dp-across` the p ranks' rings all cross the one link,
and the simulator shares its bandwidth among those on it at one time.

Prints one JSON line per (model, schedule, m, placement); `--markdown` the table of docs/cross-dc.md.

    python benchmarks/cross_dc_dp.py
    python benchmarks/cross_dc_dp.py --markdown
    python benchmarks/cross_dc_dp.py --smoke       # one model, schedule and m: the format (the test suite's)
"""

from __future__ import annotations

import argparse
import dataclasses

from sidebyside import emit, smoke_flag

P, DP = 4, 2
LINK = {"latency": 0.04, "bandwidth_bps": 10e9}
# name: (parameters, layers, hidden size); micro-batch of 2048 tokens, bf16.
MODELS = {"gpt3-6.7b": (6.7e9, 32, 4096), "gpt3-1.3b": (1.3e9, 24, 2048)}
TOKENS = 2048
FLOPS = 312e12 * 0.45  # A100 bf16 peak at 45%
SCHEDULES = (("1f1b", {}), ("interleaved-1f1b", {"v": 2}), ("crossdc-zb", {}))
MICROBATCHES = (8, 32, 128)


def model_costs(name: str, num_stages: int) -> dict:
    """A rank's share of the model's compute (T_F = T_B = T_W: forward 2 FLOPs per parameter and token,
    the input and weight gradients as much again each), activations b s h in bf16, and each stage's
    parameter bytes (bf16 gradients: 2 bytes per parameter)."""
    params, _, hidden = MODELS[name]
    share = 2 * params / P * TOKENS / FLOPS  # seconds of forward per rank
    return {
        "T_F": share,
        "T_B": share,
        "T_W": share,
        "act_bytes": TOKENS * hidden * 2,
        "param_bytes": 2 * params / num_stages,
    }


def topology(placement: str):
    from pipec.ir.schedule import Datacenter, Link, Topology

    link = Link("east", "west", LINK["latency"], LINK["bandwidth_bps"])
    if placement == "pp-across":
        return Topology((Datacenter("east", 0, P // 2), Datacenter("west", P // 2, P)), (link,))
    return Topology((), (link,), (Datacenter("east", 0, DP // 2), Datacenter("west", DP // 2, DP)))


def measure(model: str, schedule: str, params: dict, m: int, placement: str) -> dict:
    from pipec.api import load
    from pipec.ir.dataparallel import DataParallel
    from pipec.passes.lower import lower
    from pipec.sim.cost_files import normalize
    from pipec.sim.costs import cost_model
    from pipec.sim.simulate import simulate, stats

    sched = dataclasses.replace(load(schedule, p=P, m=m, **params), topology=topology(placement))
    prog = lower(sched, DataParallel(size=DP, kind="ddp"))
    doc = normalize(model_costs(model, sched.num_stages), "model")
    st = stats(simulate(prog, cost_model(sched, [doc])))
    out = {
        "model": model,
        "schedule": schedule,
        "params": dict(sched.params),
        "dp": DP,
        "placement": placement,
        "makespan_s": st.makespan,
        "collective_busy_s": max(r.collective_busy for r in st.ranks),
        "collective_exposed_s": max(r.collective_exposed for r in st.ranks),
        "bubble_rate": st.bubble_rate,
    }
    return out


def rows(smoke: bool = False) -> list[dict]:
    """Every case; `smoke`: the first model and schedule at the smallest m only."""
    models, schedules, mbs = (
        (list(MODELS)[:1], SCHEDULES[:1], MICROBATCHES[:1]) if smoke else (MODELS, SCHEDULES, MICROBATCHES)
    )
    return [
        measure(model, name, params, m, placement)
        for model in models
        for name, params in schedules
        for m in mbs
        for placement in ("pp-across", "dp-across")
    ]


def markdown(results: list[dict]) -> str:
    lines = [
        "| model | schedule | m | PP across: step (s) | exposed all-reduce (s) | DP across: step (s) | "
        "exposed all-reduce (s) | faster |",
        "|---|---|--:|--:|--:|--:|--:|---|",
    ]
    key = lambda r: (r["model"], r["schedule"], r["params"]["m"])  # noqa: E731
    by = {}
    for r in results:
        by.setdefault(key(r), {})[r["placement"]] = r
    for (model, schedule, m), pair in by.items():
        a, b = pair["pp-across"], pair["dp-across"]
        ratio = b["makespan_s"] / a["makespan_s"]
        best = f"PP across ({ratio:.2f}x)" if ratio > 1 else f"DP across ({1 / ratio:.2f}x)"
        lines.append(
            f"| {model} | {schedule} | {m} | {a['makespan_s']:.3f} | {a['collective_exposed_s']:.3f} | "
            f"{b['makespan_s']:.3f} | {b['collective_exposed_s']:.3f} | {best} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print the table of docs/cross-dc.md")
    smoke_flag(ap)
    args = ap.parse_args()
    results = rows(args.smoke)
    if args.markdown:
        print(markdown(results))
    else:
        for r in results:
            emit({"benchmark": "cross_dc_dp", **r})


if __name__ == "__main__":
    main()
