"""Simulator fidelity under data parallelism: the step time `pipec simulate` predicts from profiled costs
(compute per stage and the DP group's collectives) against the step time `pipec run` measures, p=2 x dp=2
on 4 gloo processes, for 1F1B, interleaved 1F1B (v=2) and ZB-V, ddp and fsdp.

    .venv/bin/python benchmarks/pp_dp_sim_vs_measured.py [--rounds 2] [--steps 8] [--reps 10]
                                                        [--schedules 1f1b,interleaved-1f1b,zb-v] [--kinds ddp,fsdp]
    .venv/bin/python benchmarks/pp_dp_sim_vs_measured.py --smoke   # 1F1B ddp, a small model, 1 round (tests)

The model is benchmarks/blocks_model.py (16 blocks of Linear(256, 256) + GELU in float64), BLOCKS_ROWS=64
rows per micro-batch of the global batch, so each replica's micro-batches have 32 rows (as in
benchmarks/pp_dp_vs_torch.py). For each schedule, kind and round, in this order (so profile and run see
about the same load):

    profile(pipec.compile(NAME, p=2, [v=2,] m=8, data_parallel=DataParallel(2, KIND)), model, dp=2,
            in_situ=True)
        -> costs.toml (pipec.sim.cost_files.dump_costs): F, B, W per stage in situ (steps of the PP x DP Program
           on its 4 processes; `error_ops_one_at_a_time` uses those timed op by op in 4 processes at once
           instead), the link, and the collectives: param_bytes, the ring fit dp_latency / dp_bandwidth,
           each stage's measured reduce_grad (and unshard)
    pipec.simulate(NAME, ..., cost=costs.toml, data_parallel=DataParallel(2, KIND))   -> its makespan
    pipec run NAME -D p=2 [-D v=2] -D m=8 --model benchmarks/blocks_model.py --nproc 4 --dp 2 --dp-kind KIND

(`pipec profile --dp` is the command line for the first; its flag is the CLI's.) The measured step time is
the median of the printed step times after the first two (shape handshake, first allocations). One JSON
line per schedule x kind: the medians over the rounds of the simulated and measured step times and the
relative error (simulated - measured) / measured, target within 15%, each round's error; the median step
of the profile's own in-situ run (`in_situ_step_s`, the same Program minutes earlier) and the simulation's
error against it, which the load's drift between profile and run does not move; and, to tell
where a difference comes from, the errors of two other simulations on the same profile: `ring_fit_only`
(the per-stage reduce_grad / unshard left out, so the collectives come from the ring fit) and
`free_collectives` (no DP costs at all: what the collectives add). The load average is in every line.

What the run adds around the ops is in the cost file too (runtime/profile/insitu.py): each stage's `step` (its
STEP: optimizer step, FSDP2's final callback and reshard), `step_overhead` (the step's time outside its
instructions) and `dp_blocking` (gloo's collectives block the rank). Against the in-situ step, the line
also gives the simulation without those three keys (`error_vs_in_situ_without_step_keys`: as before they
existed), without `dp_blocking` alone (`..._overlapping`), on each replica's own in-situ ops taking the
slowest (`..._slowest_replica`) and on the ops' wall-time means (`..._mean_ops`), both without the keys that
share the cores out (the wall times hold the sharing).
`--dp 1` runs the pipeline alone (ddp, 2 processes: each rank its own core on a 2-core machine; set
BLOCKS_ROWS=32 for the same rows per micro-batch as a replica of the 2 x 2 case).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from sidebyside import emit, load_average, smoke_flag

ROOT = Path(__file__).resolve().parents[1]
MODEL = "benchmarks/blocks_model.py"
CASES = {"1f1b": {}, "interleaved-1f1b": {"v": 2}, "zb-v": {}}
P, DP, M = 2, 2, 8
STEP = re.compile(r"^step\s+(\d+)/\d+: loss \S+, ([0-9.]+) s", re.M)
DP_KEYS = ("param_bytes", "dp_latency", "dp_bandwidth", "reduce_grad", "unshard")
# what the run adds around the ops (runtime/profile/insitu.py): the optimizer steps, the step's time outside its
# instructions, and whether the collectives block the rank
STEP_KEYS = ("step", "step_overhead", "dp_blocking")


def params_of(name: str) -> dict:
    return {"p": P, **CASES[name], "m": M}


def without(doc: dict, keys: tuple[str, ...]) -> dict:
    """The cost document less some keys (and the version-2 seal that lists them: it is read as written)."""
    return {k: v for k, v in doc.items() if k not in keys and k not in ("version", "keys", "end", "stages")}


def one_at_a_time(doc: dict) -> dict:
    """The profile's F, B, W as timed op by op (in 4 processes at once), instead of in situ."""
    st, split = doc["measured"]["stages"], "W" in doc
    out = without(doc, ("F", "B", "W", "overhead"))
    out.update(F=st["forward"], B=st["input_backward"] if split else st["full_backward"])
    if split:
        out["W"] = st["weight_backward"]
    if "link_overhead" in doc["measured"]["run"]:  # the overhead measured outside the schedule
        out["overhead"] = doc["measured"]["run"]["link_overhead"]
    return out


# Wall times of ops in a run whose processes shared the cores hold the sharing already: a cost document made of
# them leaves out the keys that tell the simulator to share the cores out (the profile's own F, B, W are the
# ops' CPU there, docs/runtime.md "The ops' CPU, shared out").
WALL = ("ranks_per_node", "cores_per_node")


def replica_docs(doc: dict) -> list[dict]:
    """The cost document with each replica's own in-situ F, B (and W) in turn (none if not recorded)."""
    situ, out = doc["measured"]["in_situ"], []
    for d in range(len(situ.get("forward_by_replica", []))):
        alt = without(doc, WALL)
        alt.update(F=situ["forward_by_replica"][d], B=situ["backward_by_replica"][d])
        if "weight_backward_by_replica" in situ:
            alt["W"] = situ["weight_backward_by_replica"][d]
        out.append(alt)
    return out


def mean_doc(doc: dict) -> dict | None:
    """The cost document with the means of the in-situ ops instead of their medians (None if not recorded)."""
    situ = doc["measured"]["in_situ"]
    if "forward_mean" not in situ:
        return None
    alt = without(doc, WALL)
    alt.update(F=situ["forward_mean"], B=situ["backward_mean"])
    if "weight_backward_mean" in situ:
        alt["W"] = situ["weight_backward_mean"]
    return alt


def simulate_makespan(name: str, kind: str, doc: dict) -> float:
    from pipec.api import simulate
    from pipec.ir.dataparallel import DataParallel

    sim = simulate(name, params_of(name), cost=doc, data_parallel=DataParallel(DP, kind))
    return float(sim.stats.makespan)


def profile_costs(name: str, kind: str, reps: int, path: str) -> dict:
    """Profile the PP x DP configuration, write its cost file, and return the document as written."""
    import tomllib

    from pipec.api import compile as compile_program
    from pipec.ir.dataparallel import DataParallel
    from pipec.runtime import load_model
    from pipec.runtime.profile.stages import profile
    from pipec.sim.cost_files import dump_costs

    program = compile_program(name, params_of(name), data_parallel=DataParallel(DP, kind))
    prof = profile(program, load_model(str(ROOT / MODEL)), reps=reps, warmup=2, dp=DP, dp_kind=kind, in_situ=True)
    text = dump_costs(prof.cost_doc())
    Path(path).write_text(text)
    return tomllib.loads(text)


def measured_step(name: str, kind: str, steps: int, env: dict) -> float:
    d = [x for k, v in params_of(name).items() for x in ("-D", f"{k}={v}")]
    cmd = [sys.executable, "-m", "pipec.cli.app", "run", name, *d, "--model", MODEL, "--nproc", str(P * DP)]
    cmd += ["--dp", str(DP), "--dp-kind", kind, "--steps", str(steps)]
    for _ in range(2):  # a rare gloo start-up failure on a busy machine: once more
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        times = [float(t) for _, t in STEP.findall(res.stdout)]
        if res.returncode == 0 and len(times) == steps:
            return statistics.median(times[2:])
    sys.exit(f"pipec run failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="profile + run rounds per case (default 2)")
    ap.add_argument("--steps", type=int, default=8, help="steps per pipec run (default 8; the first 2 dropped)")
    ap.add_argument("--reps", type=int, default=10, help="pipec profile --reps (default 10)")
    ap.add_argument("--schedules", default=",".join(CASES), help="comma-separated (default: all three)")
    ap.add_argument("--kinds", default="ddp,fsdp", help="comma-separated (default ddp,fsdp)")
    ap.add_argument("--dp", type=int, default=DP, help="replicas (default 2; 1: the pipeline alone, ddp)")
    smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # 1F1B with ddp on a small model, one round of 3 steps, a short profile: the format (tests)
        args.rounds, args.steps, args.reps, args.schedules, args.kinds = 1, 3, 2, "1f1b", "ddp"
        os.environ.update(BLOCKS="4", BLOCKS_WIDTH="32", BLOCKS_ROWS="8")
    globals()["DP"] = args.dp
    os.environ.setdefault("BLOCKS_ROWS", "64")  # global rows per micro-batch: 32 per replica
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        for name in [s for s in args.schedules.split(",") if s]:
            for kind in [k for k in args.kinds.split(",") if k]:
                load_start = load_average()
                sims, meas, ring, free, alone, situ, extra = [], [], [], [], [], [], {}
                bare, noblock, slowest, means = [], [], [], []
                for r in range(args.rounds):
                    path = os.path.join(tmp, f"{name}.{kind}.{r}.toml")
                    doc = profile_costs(name, kind, args.reps, path)
                    sims.append(simulate_makespan(name, kind, doc))
                    ring.append(simulate_makespan(name, kind, without(doc, DP_KEYS[3:])))
                    bare.append(simulate_makespan(name, kind, without(doc, STEP_KEYS)))
                    noblock.append(simulate_makespan(name, kind, without(doc, ("dp_blocking",))))
                    md = mean_doc(doc)
                    means.append(simulate_makespan(name, kind, md) if md is not None else sims[-1])
                    # the replicas meet at their blocking collectives: the slowest replica's own ops
                    slowest.append(max([simulate_makespan(name, kind, d) for d in replica_docs(doc)], default=sims[-1]))
                    free.append(simulate_makespan(name, kind, without(doc, DP_KEYS)))
                    alone.append(simulate_makespan(name, kind, one_at_a_time(doc)))
                    meas.append(measured_step(name, kind, args.steps, env))
                    situ.append(doc["measured"]["in_situ"]["step"])
                    extra = {k: doc.get(k) for k in DP_KEYS + STEP_KEYS}
                    extra.update(F=doc["F"], B=doc["B"], W=doc.get("W"), overhead=doc.get("overhead"))
                sim, mea = statistics.median(sims), statistics.median(meas)
                rel = lambda s, m: round((s - m) / m, 4)  # noqa: E731
                emit(
                    {
                        "benchmark": "pp_dp_sim_vs_measured",
                        "schedule": name,
                        "dp_kind": kind,
                        "mesh": f"{P} x {DP} (pp, dp)",
                        "m": M,
                        "rows_per_replica_microbatch": int(os.environ["BLOCKS_ROWS"]) // DP,
                        "model": MODEL,
                        "simulated_s": round(sim, 6),
                        "measured_s": round(mea, 6),
                        "error": rel(sim, mea),
                        "target": 0.15,
                        "round_errors": [rel(s, m) for s, m in zip(sims, meas)],
                        "rounds_simulated_s": [round(s, 6) for s in sims],
                        "rounds_measured_s": [round(m, 6) for m in meas],
                        # the profile's own run of the schedule (the in-situ steps): the same configuration
                        # minutes apart; how far it is from measured_s is how much the load moved meanwhile
                        "in_situ_step_s": round(statistics.median(situ), 6),
                        "error_vs_in_situ_step": rel(sim, statistics.median(situ)),
                        # the simulation without the step, step_overhead and dp_blocking keys (as before
                        # they existed), and without dp_blocking alone, both against the in-situ step
                        "error_vs_in_situ_without_step_keys": rel(statistics.median(bare), statistics.median(situ)),
                        "error_vs_in_situ_overlapping": rel(statistics.median(noblock), statistics.median(situ)),
                        # each replica's pipeline on its own in-situ ops, the slowest: what CPU sharing
                        # between the replicas' processes accounts for
                        "error_vs_in_situ_slowest_replica": rel(statistics.median(slowest), statistics.median(situ)),
                        # the same with the ops' means instead of their medians
                        "error_vs_in_situ_mean_ops": rel(statistics.median(means), statistics.median(situ)),
                        "error_ring_fit_only": rel(statistics.median(ring), mea),
                        "error_free_collectives": rel(statistics.median(free), mea),
                        "error_ops_one_at_a_time": rel(statistics.median(alone), mea),
                        "last_profile": extra,
                        "load_avg_start": load_start,
                    }
                )


if __name__ == "__main__":
    main()
