"""Cross-datacenter sweep: simulated step time of each schedule over the link's latency and bandwidth.

The model, its costs and the network are examples/cross_dc.pipe's (a GPT-style model on 8 ranks, two
datacenters of 4): costs from examples/cross_dc.toml, the topology from the example's `topology` block,
the cross-datacenter link's latency and bandwidth set for each point. Every schedule computes the same
model (a rank's share of it per rank) and is held to the memory model's units (one micro-batch's
activations of one stage = 1), so peak memory compares directly.

Prints one JSON line per (point, schedule); `--markdown` prints the table of docs/cross-dc.md instead.

    python benchmarks/cross_dc_sweep.py                 # JSON lines
    python benchmarks/cross_dc_sweep.py --markdown      # the table in docs/cross-dc.md
    python benchmarks/cross_dc_sweep.py -m 16           # another number of micro-batches
    python benchmarks/cross_dc_sweep.py --smoke         # one point, m=8: the format (the test suite's)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sidebyside import emit, smoke_flag

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cross_dc.pipe"
COSTS = ROOT / "examples" / "cross_dc.toml"
LATENCIES_MS = (1, 10, 40, 100)
BANDWIDTHS_GBPS = (1, 10, 100)
# (column, library schedule, its parameters beyond p and m)
SCHEDULES = (
    ("crossdc-zb", "crossdc-zb", {}),
    ("crossdc-1f1b", "crossdc-1f1b", {}),
    ("1f1b", "1f1b", {}),
    ("interleaved-1f1b", "interleaved-1f1b", {"v": 2}),
    ("zb-h1", "zb-h1", {}),
)


def measure(latency_ms: float, bandwidth_gbps: float, p: int, m: int, extra: dict | None = None) -> list[dict]:
    from pipec.api import load
    from pipec.driver import simulation
    from pipec.frontend.topology import read_topology, with_topology
    from pipec.sim.cost_files import parse_overrides, read_cost_file

    link = parse_overrides(f"latency.cross={latency_ms}ms,bandwidth.cross={bandwidth_gbps}Gbps")
    docs = [read_cost_file(COSTS), link]
    out = []
    for column, name, params in SCHEDULES:
        sched = load(name, p=p, m=m, **params, **((extra or {}).get(name, {})))
        sched = with_topology(sched, read_topology(str(EXAMPLE), sched))
        sim = simulation(sched, docs)
        out.append(
            {
                "latency_ms": latency_ms,
                "bandwidth_gbps": bandwidth_gbps,
                "schedule": column,
                "params": dict(sched.params),
                "makespan_s": sim.stats.makespan,
                "bubble_rate": sim.stats.bubble_rate,
                "peak_memory": sim.stats.peak_memory,
            }
        )
    base = next(r["makespan_s"] for r in out if r["schedule"] == "1f1b")
    for r in out:
        r["vs_1f1b"] = r["makespan_s"] / base - 1
    return out


def sweep(p: int = 8, m: int = 32, smoke: bool = False) -> list[dict]:
    """Every (latency, bandwidth) point; `smoke`: the first point only."""
    lats, bws = (LATENCIES_MS[:1], BANDWIDTHS_GBPS[:1]) if smoke else (LATENCIES_MS, BANDWIDTHS_GBPS)
    return [row for lat in lats for bw in bws for row in measure(lat, bw, p, m)]


def markdown(rows: list[dict]) -> str:
    """Rows: latency and bandwidth; columns: step time of each schedule, crossdc-zb's change against 1F1B."""
    names = [c for c, _, _ in SCHEDULES]
    peaks = {r["schedule"]: r["peak_memory"] for r in rows}
    head = ["one-way latency", "bandwidth"] + [f"{n} (s)" for n in names] + ["crossdc-zb vs 1F1B", "best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    points = sorted({(r["latency_ms"], r["bandwidth_gbps"]) for r in rows})
    for lat, bw in points:
        at = {r["schedule"]: r for r in rows if (r["latency_ms"], r["bandwidth_gbps"]) == (lat, bw)}
        best = min(names, key=lambda n: at[n]["makespan_s"])
        cells = [f"{lat:g} ms", f"{bw:g} Gbps"]
        cells += [f"**{at[n]['makespan_s']:.3f}**" if n == best else f"{at[n]['makespan_s']:.3f}" for n in names]
        cells += [f"{at['crossdc-zb']['vs_1f1b']:+.1%}", best]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Peak memory (one micro-batch's activations of one stage = 1): "
        + ", ".join(f"{n} {peaks[n]:g}" for n in names)
        + "."
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-p", type=int, default=8, help="ranks (default 8: two datacenters of 4)")
    ap.add_argument("-m", type=int, default=32, help="micro-batches (default 32, the example's)")
    ap.add_argument("--markdown", action="store_true", help="print the markdown table instead of JSON lines")
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.m = 8
    rows = sweep(args.p, args.m, args.smoke)
    if args.markdown:
        print(markdown(rows))
    else:
        for row in rows:
            emit({"benchmark": "cross_dc_sweep", **row})


if __name__ == "__main__":
    main()
