"""The targets of `pipec synth` (issue 7, docs/synth.md): one JSON line per case.

Each line: the case, the equivalent command, the synthesized figures, the library schedules' figures under
the same costs and memory model, whether the target is met, and the seconds spent (heuristic, solver).
A "beat X" target also has a verdict: "beat" (met: a strictly shorter step at no more memory), "equal"
(the same step: not met) or "worse"; each line carries the load average, as every benchmark's does.

    .venv/bin/python benchmarks/synth_targets.py            # every case (a few minutes on 2 cores)
    .venv/bin/python benchmarks/synth_targets.py --quick    # p=4 and p=8 only, shorter solver limits
    .venv/bin/python benchmarks/synth_targets.py --smoke    # the first case at p=4 m=8, 1 s: the format (tests)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from sidebyside import emit, load_average, smoke_flag

from pipec.sim.cost_files import normalize
from pipec.synth import Spec, comparison_text, library_comparison, peak_of, synthesize, topology_of

EQUAL = {"T_F": 1, "T_B": 1, "T_W": 1}
UNEVEN = {"T_F": 1, "T_B": 1.2, "T_W": 0.8, "comm": 0.05}
# examples/cross_dc.pipe's model and network (docs/cross-dc.md): 25 ms per pass, 16 MiB messages, two
# datacenters 40 ms and 10 Gbps apart, 10 us and 100 Gbps inside each.
CROSS_DC = [
    {"T_F": "25ms", "T_B": "25ms", "T_W": "25ms", "act_bytes": "16MiB"},
    {"latency.cross": "40ms", "bandwidth.cross": "10Gbps", "latency.dc": "10us", "bandwidth.dc": "100Gbps"},
]


def case(name, p, m, costs, limit_text, target, time_limit, v=1, place="loop", check=None, dcs=()):
    docs = tuple(normalize(c, "--cost") for c in (costs if isinstance(costs, list) else [costs]))
    spec = Spec(p=p, m=m, v=v, placement=place, cost_docs=docs, topology=topology_of(dcs))
    if limit_text.startswith("of:"):
        limit = peak_of(spec, limit_text[3:])
    else:
        limit = float(limit_text)
    spec = replace(spec, limit=(limit,) * p)
    load_start = load_average()
    t0 = time.monotonic()
    res = synthesize(spec, time_limit=time_limit)
    secs = time.monotonic() - t0
    rows = library_comparison(spec)
    lib = {n: fig for n, _, fig, _ in rows if fig is not None}
    f = res.figures
    cost_arg = " --cost ".join(
        ",".join(f"{k}={v}" for k, v in c.items()) for c in (costs if isinstance(costs, list) else [costs])
    )
    extra_dc = "".join(f" --dc {n}={lo}..{hi}" for n, lo, hi in dcs)
    mem_arg = f"--memory-limit-of {limit_text[3:]}" if limit_text.startswith("of:") else f"--memory-limit {limit:g}"
    extra = f" -v {v} --place {place}" if v > 1 else ""
    verdict = check(f, lib) if check else None
    met = verdict == "beat" if isinstance(verdict, str) else verdict
    return {
        "case": name,
        "target": target,
        "command": f"pipec synth -p {p} -m {m}{extra}{extra_dc} --cost {cost_arg} {mem_arg}"
        f" --time-limit {time_limit:g}",
        "memory_limit": limit,
        "makespan": f.makespan,
        "bubble_rate": f.bubble,
        "peak_memory": max(f.peak),
        "heuristic": {
            "makespan": res.heuristic_figures.makespan,
            "bubble_rate": res.heuristic_figures.bubble,
            "from": res.heuristic.describe(),
            "seconds": round(res.seconds_heuristic, 2),
        },
        "solver": {
            "status": res.solver_status,
            "bound": res.bound,
            "seconds": round(res.seconds_solver, 2),
            "note": res.solver_note,
        },
        "seconds": round(secs, 2),
        "library": {
            n: {"makespan": x.makespan, "bubble_rate": x.bubble, "peak_memory": max(x.peak)} for n, x in lib.items()
        },
        "met": met,
        **({"verdict": verdict} if isinstance(verdict, str) else {}),
        "table": comparison_text(res, rows, "synth"),
        "load_avg_start": load_start,
    }


def no_worse_bubble(ref):
    return lambda f, lib: f.bubble <= lib[ref].bubble + 1e-9


def beats(ref):
    """Against the reference at no more memory: "beat" for a strictly shorter step, "equal" for the same
    step, else "worse" (or "over memory"). The step decides alone: the bubble is defined on it (the same
    work and the same makespan give the same bubble), so a bubble cannot beat where the makespan ties."""

    def verdict(f, lib) -> str:
        r = lib[ref]
        if max(f.peak) > max(r.peak) + 1e-9:
            return "over memory"
        ours, theirs = round(f.makespan, 9), round(r.makespan, 9)
        return "beat" if ours < theirs else "equal" if ours == theirs else "worse"

    return verdict


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--case", default=None, help="only the cases whose name contains this")
    smoke_flag(ap)
    args = ap.parse_args()
    sizes = [(8, 24)] if args.quick else [(8, 24), (16, 48)]
    tl = 20 if args.quick else 30  # pipec synth's default: p=8, m=24 searches in about 32 s
    if args.smoke:  # the first case at p=4 m=8, a 1 s search: the format (tests)
        sizes, tl = [(4, 8)], 1
    cases = []
    for p, m in sizes:
        cases.append(
            (
                f"1p-equal-p{p}",
                p,
                m,
                EQUAL,
                str(p),
                "bubble <= ZB-H1's at 1F1B's peak",
                tl,
                1,
                "loop",
                no_worse_bubble("zb-h1"),
            )
        )
        cases.append(
            (
                f"2p-equal-p{p}",
                p,
                m,
                EQUAL,
                str(2 * p),
                "bubble <= ZB-H2's (the fill alone) at twice 1F1B's peak",
                tl,
                1,
                "loop",
                no_worse_bubble("zb-h2"),
            )
        )
    for p, m in [(4, 8)] + sizes:
        for ref in ("zb-h1", "zb-h2"):
            cases.append(
                (
                    f"uneven-{ref}-p{p}",
                    p,
                    m,
                    UNEVEN,
                    f"of:{ref}",
                    f"beat {ref} at its memory",
                    tl,
                    1,
                    "loop",
                    beats(ref),
                )
            )
            cases.append(
                (
                    f"uneven-{ref}-p{p}-v",
                    p,
                    m,
                    UNEVEN,
                    f"of:{ref}",
                    f"beat {ref} at its memory (V)",
                    tl,
                    2,
                    "v",
                    beats(ref),
                )
            )
    cases.append(
        (
            "cross-dc-p8",
            8,
            32,
            CROSS_DC,
            "of:crossdc-zb",
            "beat crossdc-zb at its memory",
            tl,
            1,
            "loop",
            beats("crossdc-zb"),
            (("east", 0, 4), ("west", 4, 8)),
        )
    )
    for c in cases[:1] if args.smoke else cases:
        if args.case and args.case not in c[0]:
            continue
        emit(case(*c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
