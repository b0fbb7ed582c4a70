"""Peak activation memory and bubble of Zero Bubble's memory-efficient V schedules (`v-half`, `v-min`)
against `zb-v` and `1f1b`, as p grows: one JSON line per p, or the Markdown table of docs/memory.md.

    .venv/bin/python benchmarks/v_memory.py [--ps 2,4,8,16,32] [--mult 2] [--markdown]
    .venv/bin/python benchmarks/v_memory.py --smoke    # p=2 and 4: the format (tests)

Each figure is `pipec simulate NAME -D p=P -D m=M --json` with its defaults (T_F = T_B = T_W = 1 per rank's
share of the model, free communication, one micro-batch's activations for a rank's share = 1): `peak` is
the largest per-rank peak memory, `bubble` the bubble rate. m = mult * p (2p by default; zb-v needs
m >= 2p - 1). Issue 19's target: the ratios v-half / 1f1b and v-min / 1f1b approach 1/2 and 1/3 as p grows
(Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024).
"""

from __future__ import annotations

import argparse

from sidebyside import emit, smoke_flag

from pipec.api import simulate

NAMES = ("1f1b", "zb-v", "v-half", "v-min")


def row(p: int, m: int) -> dict:
    out: dict = {"p": p, "m": m}
    for name in NAMES:
        st = simulate(name, p=p, m=m).stats
        out[name] = {"peak": st.peak_memory, "bubble": round(st.bubble_rate, 4), "makespan": st.makespan}
    base = out["1f1b"]["peak"]
    out["ratio"] = {name: round(out[name]["peak"] / base, 4) for name in ("zb-v", "v-half", "v-min")}
    return out


def markdown(rows: list[dict]) -> str:
    head = "| p | m | 1F1B peak | ZB-V peak | V-Half peak | V-Min peak | V-Half / 1F1B | V-Min / 1F1B |"
    head += " bubble 1F1B | ZB-V | V-Half | V-Min |"
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        peaks = " | ".join(f"{r[n]['peak']:g}" for n in NAMES)
        ratios = f"{r['ratio']['v-half']:.3f} | {r['ratio']['v-min']:.3f}"
        bubbles = " | ".join(f"{100 * r[n]['bubble']:.1f}%" for n in NAMES)
        lines.append(f"| {r['p']} | {r['m']} | {peaks} | {ratios} | {bubbles} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ps", default="2,4,8,16,32", help="comma-separated numbers of ranks")
    ap.add_argument("--mult", type=int, default=2, help="micro-batches per rank: m = mult * p (>= 2)")
    ap.add_argument("--markdown", action="store_true", help="print docs/memory.md's table instead of JSON lines")
    smoke_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:  # p=2 and 4: the format (tests)
        args.ps = "2,4"
    if args.mult < 2:
        ap.error("--mult must be at least 2 (zb-v needs m >= 2p - 1)")
    rows = []
    for p in (int(x) for x in args.ps.split(",")):
        r = row(p, args.mult * p)
        rows.append(r)
        if not args.markdown:
            emit({"benchmark": "v_memory", **r})
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
