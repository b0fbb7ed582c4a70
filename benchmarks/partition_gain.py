"""Partition against the uniform split on examples/uneven.py: the simulated gain `pipec partition` predicts
and the step gain measured on 4 gloo processes, in alternating rounds.

    python benchmarks/partition_gain.py [--rounds 3] [--steps 6] [--schedules 1f1b,zb-v] [--out DIR]

It profiles the model's layers once (`pipec partition 1f1b -D p=4 -D m=8 --model examples/uneven.py
--save-layers DIR/layers.json`), partitions each schedule from that table, then runs each schedule
`--rounds` times with the uniform split (the model's own build_stage) and with `--partition`, one after the
other, `--steps` steps each, and takes the median step time over steps 2.. of each run. One JSON line per
schedule with both splits' layers, the simulated steps and gain, every measured median, the measured gain
(median uniform / median partitioned) and the load average before and after (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from sidebyside import load_average

PIPEC = [sys.executable, "-m", "pipec"]
PARAMS = {"1f1b": ["-D", "p=4", "-D", "m=8"], "zb-v": ["-D", "p=4", "-D", "m=8"]}


def run_steps(schedule: str, extra: list[str], steps: int) -> float:
    cmd = [*PIPEC, "run", schedule, *PARAMS[schedule], "--model", "examples/uneven.py", "--steps", str(steps)]
    out = subprocess.run([*cmd, *extra, "--json"], capture_output=True, text=True, check=True).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    return statistics.median(s["seconds"] for s in doc["steps"][1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--schedules", default="1f1b,zb-v")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="partition-gain-")
    table = os.path.join(out, "layers.json")
    parts = {}
    for i, name in enumerate(args.schedules.split(",")):
        parts[name] = os.path.join(out, f"{name}.json")
        src = ["--model", "examples/uneven.py", "--save-layers", table] if i == 0 else ["--layers-cost", table]
        subprocess.run([*PIPEC, "partition", name, *PARAMS[name], *src, "-o", parts[name]], check=True)
    for name, path in parts.items():
        doc = json.load(open(path))
        load0 = load_average()
        uniform, split = [], []
        for _ in range(args.rounds):
            uniform.append(run_steps(name, [], args.steps))
            split.append(run_steps(name, ["--partition", path], args.steps))
        pred = doc["predicted"]
        sizes = [len(s) for s in doc["stages"]]
        n, S = sum(sizes), len(sizes)
        print(
            json.dumps(
                {
                    "schedule": name,
                    "params": doc["schedule"]["params"],
                    "layers_per_stage": sizes,
                    "uniform_layers_per_stage": [n * (s + 1) // S - n * s // S for s in range(S)],
                    "simulated_step": pred["step"],
                    "simulated_uniform_step": pred["uniform_step"],
                    "simulated_gain": pred["uniform_step"] / pred["step"],
                    "measured_uniform": uniform,
                    "measured_partition": split,
                    "measured_gain": statistics.median(uniform) / statistics.median(split),
                    "rounds": args.rounds,
                    "steps": args.steps,
                    "loadavg_before": load0,
                    "loadavg_after": load_average(),
                    "files": out,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
