"""Overlapped forward-backward pairs under expert parallelism: measured step, overlapped vs `--no-overlap`.

examples/moe.py (one MoE layer per stage, 4 experts, top 2) on 2 pipeline ranks x 2 data-parallel replicas that
form one expert group (`--dp 2 --ep 2 --experts 4`, 4 gloo processes), the replicas in two datacenters with the
expert link emulated slow (`--emulate-links`, 5 ms one way, 1 Gbps: every dispatch and combine all-to-all, and
its gradient, is held until issue + bytes / bandwidth + latency; a dispatch's rows leave when its token counts
arrive, a latency after its issue). For each schedule with `F & B` pairs
(dualpipe-v, combined-1f1b), one `pipec run` per round and system, alternating in ABBA rounds
(benchmarks/sidebyside.py): "overlap" (each pair's two ops on two threads, an all-to-all of one in flight while
the other computes) against "serial" (`--no-overlap`, one op after the other). A round's figure is the median
step time of the run's steps after the first two (start-up, shape handshake). The record: medians, every round,
the ratio serial / overlap and its spread, and `gain` = 1 - overlap / serial (the goal: >= 0.20).

`--predict`: the same pair through the simulator. `pipec profile SCHED ... --model examples/moe.py --dp 2 --ep 2
--experts 4 --in-situ` runs the schedule on the run's 4 processes (no emulated link) and writes the cost file:
each op's CPU in those steps, which the simulator shares out over the 2 cores (docs/runtime.md, "The ops' CPU,
shared out"; `--offline` times the ops in turns outside the schedule instead); then `pipec simulate SCHED
... --ep 2 --experts 4 --cost FILE --cost latency.cross=5ms,bandwidth.cross=1Gbps --topology TOPOLOGY
[--no-overlap] --json` on the run's topology. The second `--cost`
is the emulated link: a cost file's `latency`/`bandwidth` (the profile's local link) apply to every
link class, the one between the replica datacenters included (the cost model's rule: cost documents win
over the topology), so the link this run emulates is given after it. The record gets `predicted_s`
(overlap, serial), `predicted_gain` and `difference_points` = 100 (gain - predicted_gain), the goal
|difference| <= 10 points, and `predict_commands`.

    python benchmarks/moe_overlap.py                  # dualpipe-v and combined-1f1b, 4 rounds, the small model
    python benchmarks/moe_overlap.py --size large     # 4x the tokens, 2x the width: more compute per all-to-all
    python benchmarks/moe_overlap.py --predict        # and the simulator's prediction
    python benchmarks/moe_overlap.py --control        # and the same pair without the emulated link
    python benchmarks/moe_overlap.py -m 16 --schedules dualpipe-v --predict  # one schedule, more micro-batches
    python benchmarks/moe_overlap.py --smoke          # one round of 3 steps, dualpipe-v, a profile of 1 rep (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from sidebyside import alternate, emit, load_average, smoke_flag, summarize

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PIPEC = str(BIN / "pipec") if (BIN / "pipec").exists() else "pipec"
MODEL = str(ROOT / "examples" / "moe.py")
ENV = {"OMP_NUM_THREADS": "1"}  # examples/moe.py at its defaults (--size small)
LARGE = {"MOE_BATCH": "32", "MOE_CONTEXT": "16", "MOE_WIDTH": "32", "MOE_HIDDEN": "64"}  # --size large
LINK = {"latency_ms": 5.0, "bandwidth_gbps": 1.0}  # the emulated expert link (--latency-ms)


def topology() -> str:
    """The run's two replica datacenters and the emulated link between them."""
    return (
        'dc "east" replicas 0 .. 1  dc "west" replicas 1 .. 2  '
        f'link "east" <-> "west" latency {LINK["latency_ms"]:g}ms bandwidth {LINK["bandwidth_gbps"]:g}Gbps'
    )


EP = ["--dp", "2", "--ep", "2", "--experts", "4"]
STEP = re.compile(r"^step (\d+)/\d+: loss \S+, ([0-9.]+) s", re.M)
SCHEDULES = ("dualpipe-v", "combined-1f1b")  # the library's schedules with `F & B` pairs


def pipec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PIPEC, *args], capture_output=True, text=True, env={**os.environ, **ENV}, cwd=ROOT)


def step_time(schedule: str, m: int, steps: int, overlap: bool, link: bool = True) -> float:
    """One `pipec run`: the median of its step times after the first two (`link`: the expert link emulated)."""
    argv = ["run", schedule, "-D", "p=2", "-D", f"m={m}", "--model", MODEL, *EP, "--steps", str(steps)]
    argv += (["--emulate-links", "--topology", topology()] if link else []) + ([] if overlap else ["--no-overlap"])
    out = pipec(*argv)
    if out.returncode != 0:
        raise SystemExit(f"pipec {' '.join(argv)} failed:\n{out.stdout}{out.stderr[-3000:]}")
    times = [float(t) for k, t in STEP.findall(out.stdout) if int(k) > min(2, steps - 1)]
    return statistics.median(times)


def predict(schedule: str, m: int, tmp: str, reps: int = 20, in_situ: bool = True) -> dict:
    """The simulator's overlapped and serial step with this machine's profiled costs and the emulated link."""
    defines = ["-D", "p=2", "-D", f"m={m}"]
    cost = os.path.join(tmp, f"{schedule}.toml")
    argv = ["profile", schedule, *defines, "--model", MODEL, *EP, "--reps", str(reps), "-o", cost]
    argv += ["--in-situ"] if in_situ else []
    prof = pipec(*argv)
    if prof.returncode != 0:
        raise SystemExit(f"pipec {' '.join(argv)} failed:\n{prof.stdout}{prof.stderr[-3000:]}")
    link = f"latency.cross={LINK['latency_ms']:g}ms,bandwidth.cross={LINK['bandwidth_gbps']:g}Gbps"

    def shown(v: list[str]) -> str:
        return shlex.join(["pipec", *(("COSTS.toml" if x == cost else x) for x in v)])

    sims, commands = {}, [shown(argv)]
    for name, flag in (("overlap", []), ("serial", ["--no-overlap"])):
        argv = ["simulate", schedule, *defines, *EP, "--cost", cost, "--cost", link, "--topology", topology(), *flag]
        out = pipec(*argv, "--json")
        if out.returncode != 0:
            raise SystemExit(f"pipec {' '.join(argv)} failed:\n{out.stdout}{out.stderr[-3000:]}")
        sims[name] = json.loads(out.stdout)["results"][0]["makespan"]
        commands.append(shown(argv))
    return {
        "predicted_s": {k: round(v, 5) for k, v in sims.items()},
        "predicted_gain": round(1 - sims["overlap"] / sims["serial"], 4),
        "predict_commands": commands,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", type=int, default=8, help="micro-batches (default 8; the batch grows with m)")
    ap.add_argument("--steps", type=int, default=7, help="steps per run (default 7; the first two are dropped)")
    ap.add_argument("--rounds", type=int, default=4, help="ABBA rounds (default 4)")
    ap.add_argument("--predict", action="store_true", help="also the simulator's prediction of the gain")
    ap.add_argument(
        "--offline",
        action="store_true",
        help="--predict from ops timed in turns outside the schedule (default: pipec profile --in-situ)",
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help="also the same pair without the emulated link (the gain should vanish: it is the link's hiding)",
    )
    ap.add_argument(
        "--size",
        choices=("small", "large"),
        default="small",
        help="examples/moe.py at its defaults (small), or 4x the tokens and 2x the width (large)",
    )
    ap.add_argument(
        "--latency-ms", type=float, default=LINK["latency_ms"], help="the emulated link's latency (default 5 ms)"
    )
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of " + ",".join(SCHEDULES))
    smoke_flag(ap)
    a = ap.parse_args()
    names = [n for n in a.schedules.split(",") if n]
    if not names or set(names) - set(SCHEDULES):
        ap.error(f"--schedules {a.schedules}: choose from {', '.join(SCHEDULES)}")
    if a.smoke:  # one schedule, one round of 3 steps, the small model, the prediction from a profile of 1 rep
        names, a.m, a.steps, a.rounds, a.size, a.predict = names[:1], 4, 3, 1, "small", True
    LINK["latency_ms"] = a.latency_ms
    if a.size == "large":
        ENV.update(LARGE)
    # the same sequences per micro-batch at any m (the model's batch is sized for m = 8)
    ENV["MOE_BATCH"] = str(int(ENV.get("MOE_BATCH", "16")) // 8 * a.m)
    with tempfile.TemporaryDirectory(prefix="pipec-moe-") as tmp:
        cases = [(name, link) for name in names for link in ((True, False) if a.control else (True,))]
        for name, link in cases:
            extra = predict(name, a.m, tmp, 1 if a.smoke else 20, not a.offline) if a.predict and link else {}
            systems = {
                "overlap": lambda n=name, k=link: step_time(n, a.m, a.steps, True, k),
                "serial": lambda n=name, k=link: step_time(n, a.m, a.steps, False, k),
            }
            start = load_average()
            rec = summarize(
                "moe_overlap",
                alternate(systems, a.rounds),
                ("serial", "overlap"),
                start,
                schedule=name,
                params={"p": 2, "m": a.m, "dp": 2, "ep": 2, "experts": 4},
                link=dict(LINK) if link else "not emulated",
                model={"size": a.size, **ENV},
                **extra,
            )
            rec["gain"] = round(1 - rec["median_s"]["overlap"] / rec["median_s"]["serial"], 4)
            if "predicted_gain" in rec:
                rec["difference_points"] = round(100 * (rec["gain"] - rec["predicted_gain"]), 1)
            emit(rec)


if __name__ == "__main__":
    main()
