"""The simulated gain of overlapping the expert all-to-alls at production sizes (issue 28), beside DualPipe's
published bubble formula.

For DualPipe-V (`dualpipe-v`) and Megatron-LM's combined 1F1B (`combined-1f1b`, v = 2), p = 8 pipeline
ranks, 16 experts over an expert group of `--ep` (default 8) replicas folded into `--dp` (default 8), each
schedule is simulated with its overlapped pairs run in turns (`pair_order`) and one op after the other
(`pipec simulate --no-overlap`), on two expert links: one between two datacenters (`cross`: 40 ms latency,
`--cross-gbps` default 100 Gbit/s) and one inside a datacenter (`dc`: 10 us, 400 Gbit/s). One JSON line per
(link, schedule) gives both makespans, the gain 1 - overlapped / sequential, the bubble time of each, and
DualPipe's bubble `(PP/2 - 1)(F&B + B - 3W)` (DeepSeek-V3 report, Table 2) with PP = 2p (the stages of the
V: DualPipe-V is DualPipe cut in half), F&B the mean simulated span of an overlapped F & B pair of the
dualpipe-v run, B and W a stage's input- and weight-gradient times.

Costs: *profiled costs scaled*. A profile (`--cost FILE`, what `pipec profile --ep N` writes for a model
with MoE layers, e.g. examples/moe.py) gives the shape: the mean ratios B/F and W/F of its stages (without
W, its full backward split half and half, the split the runtime measures on these blocks). They are scaled
to a DeepSeek-V3-like MoE layer (hidden 7168, a micro-batch of `--tokens` 4096, top-`--topk` 2 routing, bf16)
at `--layer-ms` (default 12 ms) of forward per layer, `--layers` 4 MoE layers per stage; without a file
the ratios are 1 and 1 (F = B = W, Zero Bubble's unit costs). The bytes one rank sends per all-to-all are
tokens x hidden x 2 bytes x top-k x (ep - 1) / ep (uniform routing), charged `ep_latency + a2a_bytes /
ep_bandwidth` (pipec.sim.costs.CostModel.a2a_time), a forward's dispatch the latency twice (its token counts,
then its rows: pipec.ir.experts.a2a_latencies).

    python benchmarks/moe_sim.py                          # default ratios (F = B = W)
    python benchmarks/moe_sim.py --cost moe-profile.toml  # a profile's ratios
    python benchmarks/moe_sim.py --smoke                  # p = 2, one link: the format (tests)
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from sidebyside import emit, smoke_flag

from pipec.api import load
from pipec.driver import simulation
from pipec.ir.dataparallel import DataParallel
from pipec.ir.experts import Experts
from pipec.ir.opcodes import BWD, FWD

HIDDEN = 7168  # DeepSeek-V3's
LINKS = {"cross": (40e-3, None), "dc": (10e-6, 400e9)}  # (latency s, bandwidth bit/s; None: --cross-gbps)


def ratios(path: str | None) -> tuple[float, float, str]:
    """(B / F, W / F) of a profile's stages (means), and where they came from."""
    if path is None:
        return 1.0, 1.0, "F = B = W (no profile given)"
    from pipec.sim.cost_files import read_cost_file

    doc = read_cost_file(path)
    F = float(np.mean(doc["F"]))
    B = float(np.mean(doc["B"]))
    if "W" in doc:
        return B / F, float(np.mean(doc["W"])) / F, f"{path}: mean B/F, W/F of its stages"
    return B / F / 2, B / F / 2, f"{path}: its full backward B/F split in half"


def pair_span(tl) -> float:
    """The mean span of the overlapped F & B pairs of a timeline: each pair's rows share their start rank and
    overlap in time; the span is from the earlier start to the later end."""
    spans = []
    for r in range(tl.num_ranks):
        sel = np.flatnonzero(tl.rank == r)
        sel = sel[np.argsort(tl.start[sel], kind="stable")]
        for a, b in zip(sel[:-1], sel[1:]):
            if {int(tl.op[a]), int(tl.op[b])} == {FWD, BWD} and tl.start[b] < tl.end[a]:
                spans.append(max(tl.end[a], tl.end[b]) - tl.start[a])
    return float(np.mean(spans)) if spans else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cost", default=None, help="a profile (cost file) whose B/F and W/F ratios to scale")
    ap.add_argument("--p", type=int, default=8)
    ap.add_argument("--m", type=int, default=32, help="micro-batches per step (default 32)")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4, help="MoE layers per stage")
    ap.add_argument("--layer-ms", type=float, default=12.0, help="forward milliseconds of one layer")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch")
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--cross-gbps", type=float, default=100.0, help="bandwidth of the 40 ms cross-DC link")
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.p, args.m, args.ep, args.dp, args.layers = 2, 4, 2, 2, 1
    b, w, source = ratios(args.cost)
    F = args.layers * args.layer_ms / 1e3  # a stage's forward
    a2a_bytes = args.tokens * HIDDEN * 2 * args.topk * (args.ep - 1) / args.ep
    links = {"dc": LINKS["dc"]} if args.smoke else LINKS
    for link, (lat, bps) in links.items():
        bps = args.cross_gbps * 1e9 if bps is None else bps
        doc = {"F": F, "B": b * F, "W": w * F, "a2a_bytes": a2a_bytes, "ep_latency": lat, "ep_bandwidth": bps}
        doc["_from"] = "moe_sim"
        span = None
        for name, params in (
            ("dualpipe-v", dict(p=args.p, m=args.m)),
            ("combined-1f1b", dict(p=args.p, v=2, m=args.m)),
        ):
            sched = load(name, **params)
            # combined-1f1b is not split: its B is the full backward (B + W), as the cost model takes it
            costs = dict(doc) if sched.split_backward else {**doc, "B": (b + w) * F, "W": 0.0}
            sims = {
                ov: simulation(
                    sched,
                    [costs],
                    None,
                    None,
                    None,
                    DataParallel(args.dp),
                    Experts(args.ep, args.experts),
                    (args.layers,),
                    ov,
                )
                for ov in (True, False)
            }
            on, off = sims[True].stats, sims[False].stats
            if name == "dualpipe-v":
                span = pair_span(sims[True].timeline)
            PP = 2 * args.p
            formula = (PP / 2 - 1) * (span + b * F - 3 * w * F) if span is not None else None
            a2a_s = sims[True].costs.a2a_time(np.array([0]), np.array([0]), args.ep)[0]
            emit(
                {
                    "link": link,
                    "schedule": name,
                    "params": params,
                    "ep": args.ep,
                    "experts": args.experts,
                    "moe_layers_per_stage": args.layers,
                    "stage_F_s": F,
                    "stage_B_s": b * F,
                    "stage_W_s": w * F,
                    "a2a_s": float(a2a_s),
                    "a2a_bytes": a2a_bytes,
                    "ratios_from": source,
                    "makespan_overlap_s": on.makespan,
                    "makespan_sequential_s": off.makespan,
                    "gain": 1 - on.makespan / off.makespan,
                    "bubble_time_overlap_s": on.bubble_time,
                    "bubble_time_sequential_s": off.bubble_time,
                    "dualpipe_F_and_B_s": span,
                    "dualpipe_bubble_formula_s": formula,
                }
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
