"""Partition against the uniform split on examples/uneven.py: the simulated gain `pipec partition` predicts
and the step gain measured on 4 gloo processes, in alternating rounds.

    python benchmarks/partition_gain.py [--rounds 3] [--steps 6] [--schedules 1f1b,zb-v] [--out DIR]

It profiles the model's layers once (`pipec partition 1f1b -D p=4 -D m=8 --model examples/uneven.py
--save-layers DIR/layers.json`), partitions each schedule from that table, then runs each schedule
`--rounds` times with the uniform split (the model's own build_stage) and with `--partition`, in ABBA order
(`sidebyside.alternate`), `--steps` steps each, and takes the median step time over steps 2.. of each run.
One JSON line per schedule (`sidebyside.summarize`) with both splits' layers, the simulated steps and gain,
every measured median, the measured gain (`measured_gain` = `ratio`: median uniform / median partitioned,
its spread over the rounds in `ratio_range`) and the load average before and after (the machine is shared).

    python benchmarks/partition_gain.py --smoke    # 1F1B, 1 round of 2 steps: the format (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from sidebyside import alternate, emit, load_average, smoke_flag, summarize

PIPEC = [sys.executable, "-m", "pipec"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the model path is the repository's
PARAMS = {"1f1b": ["-D", "p=4", "-D", "m=8"], "zb-v": ["-D", "p=4", "-D", "m=8"]}


def run_steps(schedule: str, extra: list[str], steps: int) -> float:
    cmd = [*PIPEC, "run", schedule, *PARAMS[schedule], "--model", "examples/uneven.py", "--steps", str(steps)]
    out = subprocess.run([*cmd, *extra, "--json"], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    return statistics.median(s["seconds"] for s in doc["steps"][1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--schedules", default="1f1b,zb-v")
    ap.add_argument("--out", default=None)
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # 1F1B, one round of 2 steps per split: the format (tests)
        args.rounds, args.steps, args.schedules = 1, 2, "1f1b"
    out = args.out or tempfile.mkdtemp(prefix="partition-gain-")
    table = os.path.join(out, "layers.json")
    parts = {}
    for i, name in enumerate(args.schedules.split(",")):
        parts[name] = os.path.join(out, f"{name}.json")
        src = ["--model", "examples/uneven.py", "--save-layers", table] if i == 0 else ["--layers-cost", table]
        subprocess.run(
            [*PIPEC, "partition", name, *PARAMS[name], *src, "-o", parts[name]], check=True, cwd=ROOT, stdout=sys.stderr
        )
    for name, path in parts.items():
        doc = json.load(open(path))
        load0 = load_average()
        runs = alternate(
            {
                "uniform": lambda name=name: run_steps(name, [], args.steps),
                "partition": lambda name=name, path=path: run_steps(name, ["--partition", path], args.steps),
            },
            args.rounds,
        )
        pred = doc["predicted"]
        sizes = [len(s) for s in doc["stages"]]
        n, S = sum(sizes), len(sizes)
        rec = summarize(
            "partition_gain",
            runs,
            ("uniform", "partition"),
            load0,
            schedule=name,
            params=doc["schedule"]["params"],
            layers_per_stage=sizes,
            uniform_layers_per_stage=[n * (s + 1) // S - n * s // S for s in range(S)],
            simulated_step=pred["step"],
            simulated_uniform_step=pred["uniform_step"],
            simulated_gain=pred["uniform_step"] / pred["step"],
            steps=args.steps,
            files=out,
        )
        rec["measured_gain"] = rec["ratio"]  # median uniform / median partitioned; its spread: ratio_range
        emit(rec)


if __name__ == "__main__":
    main()
