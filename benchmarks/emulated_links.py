"""Emulated cross-datacenter links: measured step times (`pipec run --emulate-links`) against the simulator.

p = 2, one rank in each of two datacenters, the link declared as 40 ms one-way at 10 Gbps and scaled by
`--link-scale` (default 0.5: 20 ms, 20 Gbps) so it stands in proportion to the CPU model's compute
(examples/mlp.py at width 256, depth 16, batch 256: a few ms per stage and pass). For each schedule:

1. `pipec profile` measures the stages' F, B, W on this machine (per schedule: the split backward or not);
2. `pipec run --emulate-links` trains `--steps` steps on two gloo processes; the step time is the median
   of the steps after the first (the first includes the shape handshake), over `--repeats` runs;
3. `pipec simulate` with the profiled costs and the same (scaled) link predicts the step time.

Prints one JSON line per schedule; `--markdown` prints the table of docs/cross-dc.md.

    python benchmarks/emulated_links.py                # JSON lines
    python benchmarks/emulated_links.py --markdown     # the table in docs/cross-dc.md
    python benchmarks/emulated_links.py --smoke        # 1F1B, a small model, 2 steps: the format (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from sidebyside import emit, smoke_flag

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PIPEC = str(BIN / "pipec") if (BIN / "pipec").exists() else "pipec"
MODEL = str(ROOT / "examples" / "mlp.py")
ENV = {"MLP_WIDTH": "256", "MLP_DEPTH": "16", "MLP_BATCH": "256"}
LATENCY_MS, BANDWIDTH_GBPS = 40.0, 10.0
# (label, library schedule, its parameters beyond p and m)
SCHEDULES = (
    ("1f1b", "1f1b", {}),
    ("crossdc-zb", "crossdc-zb", {}),
    ("crossdc-zb g=4", "crossdc-zb", {"g": 4}),
)
PROFILE_ARGS: list[str] = []  # extra `pipec profile` arguments (--smoke: fewer repetitions)
STEP = re.compile(r"^step (\d+)/\d+: loss \S+, ([0-9.]+) s", re.M)


def sim_result(text: str) -> dict:
    """The one result of `pipec simulate --json` (its envelope: version, command, ok, results)."""
    return json.loads(text)["results"][0]


def topology(latency_ms: float, bandwidth_gbps: float) -> str:
    return (
        f'dc "east" ranks 0 .. 1  dc "west" ranks 1 .. 2  '
        f'link "east" <-> "west" latency {latency_ms:g}ms bandwidth {bandwidth_gbps:g}Gbps'
    )


def pipec(*args: str) -> str:
    env = {**os.environ, **ENV}
    out = subprocess.run([PIPEC, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"pipec {' '.join(args)} failed:\n{out.stdout}{out.stderr}")
    return out.stdout


def measure(label: str, name: str, extra: dict, m: int, scale: float, steps: int, repeats: int, tmp: str) -> dict:
    defines = [a for k, v in {"p": 2, "m": m, **extra}.items() for a in ("-D", f"{k}={v}")]
    topo = topology(LATENCY_MS, BANDWIDTH_GBPS)
    cost = os.path.join(tmp, f"{label.replace(' ', '_').replace('=', '')}.toml")
    pipec("profile", name, *defines, "--model", MODEL, "-o", cost, *PROFILE_ARGS)
    times = []
    run = ["run", name, *defines, "--model", MODEL, "--steps", str(steps), "--emulate-links"]
    run += ["--topology", topo, "--link-scale", repr(scale)]
    for _ in range(repeats):
        out = pipec(*run)
        times += [float(t) for k, t in STEP.findall(out) if int(k) > 1]
    link = f"latency.cross={LATENCY_MS * scale:g}ms,bandwidth.cross={BANDWIDTH_GBPS / scale:g}Gbps"
    sim = sim_result(pipec("simulate", name, *defines, "--topology", topo, "--cost", cost, "--cost", link, "--json"))
    measured = statistics.median(times)
    return {
        "schedule": label,
        "params": {"p": 2, "m": m, **extra},
        "link": {"latency_ms": LATENCY_MS * scale, "bandwidth_gbps": BANDWIDTH_GBPS / scale, "scale": scale},
        "measured_s": round(measured, 5),
        "simulated_s": round(sim["makespan"], 5),
        "error": round(measured / sim["makespan"] - 1, 4),
        "peak_memory": sim.get("peak_memory"),
        "steps": times,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", type=int, default=8, help="micro-batches (default 8)")
    ap.add_argument("--link-scale", type=float, default=0.5, help="--link-scale of pipec run (default 0.5)")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (default 6; the first is dropped)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per schedule (default 2)")
    ap.add_argument("--markdown", action="store_true", help="print the table of docs/cross-dc.md")
    smoke_flag(ap)
    a = ap.parse_args()
    schedules = SCHEDULES
    if a.smoke:  # one schedule, a small model, one run of 2 steps, a short profile
        schedules, a.m, a.steps, a.repeats = SCHEDULES[:1], 2, 2, 1
        ENV.update(MLP_WIDTH="32", MLP_DEPTH="4", MLP_BATCH="16")
        PROFILE_ARGS[:] = ["--reps", "2", "--warmup", "0", "--one-process", "--no-comm"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipec-links-") as tmp:
        for label, name, extra in schedules:
            row = measure(label, name, extra, a.m, a.link_scale, a.steps, a.repeats, tmp)
            rows.append(row)
            emit({"benchmark": "emulated_links", **row}, file=sys.stderr if a.markdown else sys.stdout)
    base = rows[0]
    if not a.markdown:
        return
    print("| schedule | peak memory | measured (s) | simulated (s) | measured / simulated | ", end="")
    print("measured vs 1F1B | simulated vs 1F1B |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        dm = r["measured_s"] / base["measured_s"] - 1
        ds = r["simulated_s"] / base["simulated_s"] - 1
        print(
            f"| {r['schedule']} | {r['peak_memory']:g} | {r['measured_s']:.3f} | {r['simulated_s']:.3f} | "
            f"{r['error']:+.1%} | {dm:+.1%} | {ds:+.1%} |"
        )


if __name__ == "__main__":
    main()
