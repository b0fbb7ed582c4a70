"""Stage graphs against the chain a user must write today (issue 42): at p=4 m=8 on the same 4 ranks, each
graph example beside its best chain linearisation, simulated and measured in alternating rounds: step time,
bytes sent per step, peak saved memory per rank.

    .venv/bin/python benchmarks/stage_graph.py [--rounds 5] [--steps 10] [--reps 10] [--cases unet,two_encoders]
    .venv/bin/python benchmarks/stage_graph.py --smoke   # the models' own small sizes, 1 round (tests)

The two cases, each a graph and a chain with the same maths (the chain model files build the graph's very
modules, seeded alike, so their losses are equal, which every case line checks):

    unet          graph  examples/unet.pipe (1F1B, edges s -> s+1 and the skip 0 -> 3), examples/unet.py
                  chain  1f1b, examples/unet_chain.py: the skip carried through stages 1 and 2
    two_encoders  graph  examples/two_encoders.pipe (image and text encoder both sources, on ranks 0 and 1,
                         running at once; 1F1B over the graph's depth 3), examples/two_encoders.py
                  chain  1f1b, examples/two_encoders_chain.py: image encoder, then text encoder, then the
                         decoder (the tokens passed along as floats)

Sizes (environment knobs of the model files, set here): the U-Net at UNET_WIDTH=16 UNET_SIZE=32
UNET_BATCH=64; the two encoders at TWO_DIM=512 TWO_BATCH=512 TWO_SIZE=3 TWO_TOKENS=48 TWO_VOCAB=512
TWO_LAYERS=2, chosen so that the encoders, the fusion stage and the last stage (a residual block of two
layers) cost about the same (the goal's "balanced stages"). float64, the files' default.

Each round, per case: `pipec profile 1f1b -D p=4 -D m=8 --model CHAIN -o chain.toml` on this machine (its F
and B per stage, link, overhead, and the keys that make 4 ranks share the 2 cores, docs/simulate.md "Ranks
that share cores"), then `pipec simulate --cost` of both schedules, then `pipec run SCHED -D p=4 -D m=8
--model M --nproc 4 --steps K --json` of chain and graph in ABBA order over the rounds (the chain first in
even rounds), the measured step the median of the steps after the first two. The graph is simulated on a cost
file made from the chain's profile (so both share one measurement of the same modules): the same F and B per
stage, the same link, overhead and sharing keys, the same saved and state bytes (a tensor only passed along is
not saved by autograd), and the graph's own message bytes per stage (`act_bytes`). `--in-situ` instead
profiles each system with `pipec profile --in-situ` (its ops' CPU and the executor's overhead measured in a run
of its own schedule) and simulates each on its own: it sees what a chain costs in its run beyond its modules,
but on this machine its op costs moved by 15% from round to round (2026-12-07), more than the gains. Each
system is simulated twice: as profiled (this machine: 4 ranks on 2 cores), and with a core per rank (`--cost
cores_per_node=4`), the goal's figure.

Bytes per step: the Program's transfer instructions (every SEND_ACT and SEND_GRAD, each naming its edge) times
the size of the tensors on that edge as the model makes them on micro-batch 0 (what the run sends; a
gradient is as large as its activation), beside the simulator's `message_bytes`. Peak memory per rank: the
runtime's count of saved activation bytes (pipec.runtime.exec.saved, what `pipec run --memory` reports) in a
step of every rank in one process (`LocalPipeline` after `measure_memory()`; the count follows each rank's
Program, so it is the multi-process run's), beside the simulator's `peak_memory` per rank.

One JSON line per case (both systems' figures and the gains: chain / graph for step times, graph / chain for
bytes and peaks), then a summary: the two encoders' simulated gain with a core per rank (goal >= 1.08), the
U-Net's bytes and peak ratios (goal < 1) and step gain (goal >= 1, "no longer"), and each measured gain minus
the gain simulated for this machine, in points (goal within 5). Every line carries the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from sidebyside import emit, load_average, smoke_flag, summarize

ROOT = Path(__file__).resolve().parents[1]
P, M = 4, 8
CASES = {
    "unet": {
        "graph": ("examples/unet.pipe", "examples/unet.py"),
        "chain": ("1f1b", "examples/unet_chain.py"),
        "env": {"UNET_WIDTH": "16", "UNET_SIZE": "32", "UNET_BATCH": "64"},
    },
    "two_encoders": {
        "graph": ("examples/two_encoders.pipe", "examples/two_encoders.py"),
        "chain": ("1f1b", "examples/two_encoders_chain.py"),
        "env": {
            "TWO_DIM": "512",
            "TWO_BATCH": "512",
            "TWO_SIZE": "3",
            "TWO_TOKENS": "48",
            "TWO_VOCAB": "512",
            "TWO_LAYERS": "2",
        },
    },
}
SYSTEMS = ("chain", "graph")
DEFINES = ["-D", f"p={P}", "-D", f"m={M}"]
# the profile's document less what is not a cost key for a hand-made file (the version-2 seal and the record)
NOT_COSTS = ("format", "version", "stages", "keys", "end", "measured", "comment", "unit", "schedule", "params")


def pipec(args: list[str], env: dict, timeout: float = 1800) -> str:
    """`python -m pipec.cli.app ARGS` from the repository root; its standard output (exits on failure)."""
    cmd = [sys.executable, "-m", "pipec.cli.app", *args]
    for _ in range(2):  # a rare gloo start-up failure on a busy machine: once more
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if res.returncode == 0:
            return res.stdout
    sys.exit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")


def inspect(case: str, system: str) -> dict:
    """In this process (the case's environment set by the caller): the bytes on each edge, the bytes per step
    from the Program's transfers, each rank's measured peak saved bytes over one step of every rank in one
    process, and that step's loss."""
    import torch

    from pipec.api import compile as compile_program
    from pipec.runtime.exec.microbatch import as_args, batch_of, split, to_device
    from pipec.runtime.exec.shapes import edge_outputs, outputs_of
    from pipec.runtime.local import LocalPipeline
    from pipec.runtime.model.contract import build_stage_module, load_model
    from pipec.runtime.runner import StageOptions

    torch.set_num_threads(1)
    target, path = CASES[case][system]
    program = compile_program(str(ROOT / target) if target.endswith(".pipe") else target, {"p": P, "m": M})
    model = load_model(str(ROOT / path))
    graph, S = program.graph, program.num_stages
    edges = list(graph.edges) if graph is not None else [(s, s + 1) for s in range(S - 1)]
    inputs, targets = batch_of(model.batch(0), f"{path}: batch(0)")
    x = as_args(to_device(split(inputs, M, "inputs")[0], torch.device("cpu"), model.dtype))
    mods = [build_stage_module(model.build_stage, s, S, seed=0, dtype=model.dtype, device="cpu") for s in range(S)]
    sent: dict[tuple[int, int], tuple] = {}  # (u, v) -> the tensors on that edge
    with torch.no_grad():
        for s in range(S - 1):
            ins = [u for u, v in edges if v == s]
            args = x if not ins else tuple(t for u in sorted(ins) for t in sent[(u, s)])
            out = mods[s](*args)
            outs = sorted(v for u, v in edges if u == s)
            msgs = edge_outputs(out, s, tuple(outs)) if graph is not None else [outputs_of(out, s)]
            for v, msg in zip(outs, msgs):
                sent[(s, v)] = tuple(msg)
    edge_bytes = {e: sum(t.numel() * t.element_size() for t in ts) for e, ts in sent.items()}
    total = 0
    for rp in program.ranks:
        others = rp.other.tolist() if rp.other is not None else [-1] * len(rp.op)  # the chain: no other ends
        for op, s, other in zip(rp.op.tolist(), rp.stage.tolist(), others):
            name = OPNAMES.get(op)
            if name == "SEND_ACT":
                total += edge_bytes[(s, other if other >= 0 else s + 1)]
            elif name == "SEND_GRAD":
                total += edge_bytes[(other if other >= 0 else s - 1, s)]
    pipe = LocalPipeline(program, model.build_stage, model.loss_fn, options=StageOptions(dtype=model.dtype, seed=0))
    for runner in pipe.runners:
        runner.executor.measure_memory()
    held, held_total = held_inputs(program, pipe.runners)
    res = pipe.step(inputs, targets)
    act = [max([b for (u, _), b in edge_bytes.items() if u == s], default=0) for s in range(S)]
    return {
        "edge_bytes": {f"{u}->{v}": b for (u, v), b in sorted(edge_bytes.items())},
        "act_bytes": act,
        "in_bytes": [sum(b for (_, v), b in edge_bytes.items() if v == s) for s in range(S)],
        "bytes_per_step": total,
        "peak_bytes": [int(r.executor.peaks.device) for r in pipe.runners],
        "peak_input_bytes": held,
        "peak_total_bytes": held_total,
        "loss": float(res.loss),
    }


def held_inputs(program, runners=None) -> tuple[list[int], list[int]]:
    """Each rank's peak, over the step to come, of the received inputs its stages hold from FWD until BWD
    (`Stage.saved`; storages counted once): what a tensor only passed along costs, which the saved-tensor count
    leaves out because autograd saves nothing for it; and of everything the rank holds for its micro-batches,
    the union of those inputs and the saved tensors (`runners`' saved-tensor pools, pipec.runtime.exec.saved),
    each storage once, so a received input that autograd also saves is not counted twice. Sampled after every
    forward (where a rank's holdings grow), by wrapping `Stage.forward` in this process. Returns (inputs,
    total) per rank; `total` is all zeros without `runners`."""
    import torch

    from pipec.runtime.exec.stage import Stage

    R = program.num_ranks
    peak, total, stages = [0] * R, [0] * R, [[] for _ in range(R)]
    plain = Stage.forward

    def inputs_of(rank: int) -> dict[int, int]:
        held: dict[int, int] = {}
        for st in stages[rank]:
            for args, _ in [] if st.first else st.saved.values():
                for t in args:
                    if isinstance(t, torch.Tensor):
                        held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return held

    def forward(self, *a, **k):
        rank = program.placement[self.index]
        if all(st is not self for st in stages[rank]):
            stages[rank].append(self)
        out = plain(self, *a, **k)
        held = inputs_of(rank)
        peak[rank] = max(peak[rank], sum(held.values()))
        pool = getattr(runners[rank].executor, "pool", None) if runners is not None else None
        if pool is not None:
            union = dict(held)
            union.update({ptr: ref[1] for (where, ptr), ref in pool.refs.items() if where == "device"})
            total[rank] = max(total[rank], sum(union.values()))
        return out

    Stage.forward = forward
    return peak, total


def _opnames() -> dict[int, str]:
    from pipec.ir import program as ir

    return {int(getattr(ir, n)): n for n in ("SEND_ACT", "SEND_GRAD")}


OPNAMES: dict[int, str] = {}


def inspected(case: str, system: str, env: dict) -> dict:
    """`inspect` in a fresh process with the case's environment (the model files read it at import)."""
    out = subprocess.run(
        [sys.executable, __file__, "--inspect", case, system], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if out.returncode:
        sys.exit(f"inspect {case} {system} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def profile(case: str, system: str, reps: int, path: str, env: dict, in_situ: bool) -> dict:
    """`pipec profile` of one system on this machine (`--in-situ`: its ops' CPU and the executor's overhead
    measured in a run of its own schedule on 4 processes); the cost document as written."""
    import tomllib

    target, model = CASES[case][system]
    extra = ["--in-situ"] if in_situ else []
    pipec(["profile", target, *DEFINES, "--model", model, "-o", path, "--reps", str(reps), *extra], env)
    return tomllib.loads(Path(path).read_text())


def graph_costs(chain_doc: dict, graph: dict) -> dict:
    """The graph's cost document from the chain's profile (`--shared-profile`): the same compute, link,
    overhead, sharing, saved and state bytes; its own message bytes (a gradient: its edge's activation's
    size, the default)."""
    doc = {k: v for k, v in chain_doc.items() if k not in NOT_COSTS and k not in ("grad_bytes",)}
    doc["act_bytes"], doc["input_bytes"] = graph["act_bytes"], [0, *graph["in_bytes"][1:]]
    return doc


def simulated(target: str, cost_path: str, env: dict, core_per_rank: bool) -> dict:
    """`pipec simulate TARGET --cost FILE --json` (with a core per rank: cores_per_node = the ranks)."""
    extra = ["--cost", f"cores_per_node={P}"] if core_per_rank else []
    doc = json.loads(pipec(["simulate", target, *DEFINES, "--cost", cost_path, *extra, "--json"], env))["results"][0]
    return {
        "step_s": float(doc["makespan"]),
        "bytes": float(doc["message_bytes"]),
        "peak_bytes": [float(r["peak_memory"]) for r in doc["per_rank"]],
    }


def measured(case: str, system: str, steps: int, env: dict) -> tuple[float, list[float]]:
    """`pipec run ... --nproc 4 --json`: the median step after the first two, and every step's loss."""
    target, model = CASES[case][system]
    doc = json.loads(
        pipec(["run", target, *DEFINES, "--model", model, "--nproc", str(P), "--steps", str(steps), "--json"], env)
    )
    secs = [s["seconds"] for s in doc["steps"]]
    return statistics.median(secs[2:] if len(secs) > 2 else secs), [s["loss"] for s in doc["steps"]]


def run_case(case: str, args: argparse.Namespace, tmp: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not args.smoke:
        env.update(CASES[case]["env"])
    load_start = load_average()
    info = {s: inspected(case, s, env) for s in SYSTEMS}
    sims = {f"{s}{k}": [] for s in SYSTEMS for k in ("", "_core_per_rank")}
    sim_last: dict = {}
    runs: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    losses: dict[str, list[float]] = {}
    for r in range(args.rounds):
        paths = {s: os.path.join(tmp, f"{case}.{r}.{s}.toml") for s in SYSTEMS}
        in_situ = args.in_situ
        chain_doc = profile(case, "chain", args.reps, paths["chain"], env, in_situ)
        if not in_situ:  # the graph on the chain's measurement of the same modules
            paths["graph"] = os.path.join(tmp, f"{case}.{r}.graph.json")
            Path(paths["graph"]).write_text(json.dumps(graph_costs(chain_doc, info["graph"])))
        else:
            profile(case, "graph", args.reps, paths["graph"], env, in_situ)
        for s in SYSTEMS:
            for k, cpr in (("", False), ("_core_per_rank", True)):
                sim_last[f"{s}{k}"] = simulated(CASES[case][s][0], paths[s], env, cpr)
                sims[f"{s}{k}"].append(sim_last[f"{s}{k}"]["step_s"])
        for s in SYSTEMS if r % 2 == 0 else reversed(SYSTEMS):  # ABBA over the rounds, as sidebyside.alternate
            step, losses[s] = measured(case, s, args.steps, env)
            runs[s].append(step)
    rec = summarize(f"stage_graph.{case}", runs, ratio=("chain", "graph"), load_start=load_start)
    med = {k: statistics.median(v) for k, v in sims.items()}
    step_gain_sim = med["chain"] / med["graph"]
    rec.update(
        case=case,
        p=P,
        m=M,
        schedules={s: CASES[case][s][0] for s in SYSTEMS},
        models={s: CASES[case][s][1] for s in SYSTEMS},
        env=env_of(case, args.smoke),
        measured_step_s={s: round(statistics.median(runs[s]), 6) for s in SYSTEMS},
        measured_step_gain=rec["ratio"],
        simulated_step_s={k: round(v, 6) for k, v in med.items()},
        simulated_rounds_s={k: [round(x, 6) for x in v] for k, v in sims.items()},
        simulated_step_gain=round(step_gain_sim, 4),
        simulated_step_gain_core_per_rank=round(med["chain_core_per_rank"] / med["graph_core_per_rank"], 4),
        gain_error_points=round(100 * (rec["ratio"] - step_gain_sim), 2),
        bytes_per_step={s: info[s]["bytes_per_step"] for s in SYSTEMS},
        simulated_bytes_per_step={s: sim_last[s]["bytes"] for s in SYSTEMS},
        bytes_ratio=round(info["graph"]["bytes_per_step"] / info["chain"]["bytes_per_step"], 4),
        edge_bytes={s: info[s]["edge_bytes"] for s in SYSTEMS},
        peak_bytes={s: info[s]["peak_bytes"] for s in SYSTEMS},
        simulated_peak_bytes={s: sim_last[s]["peak_bytes"] for s in SYSTEMS},
        peak_ratio=round(max(info["graph"]["peak_bytes"]) / max(info["chain"]["peak_bytes"]), 4),
        peak_input_bytes={s: info[s]["peak_input_bytes"] for s in SYSTEMS},
        peak_input_ratio=round(max(info["graph"]["peak_input_bytes"]) / max(info["chain"]["peak_input_bytes"]), 4),
        peak_total_bytes={s: info[s]["peak_total_bytes"] for s in SYSTEMS},
        peak_total_ratio=round(max(info["graph"]["peak_total_bytes"]) / max(info["chain"]["peak_total_bytes"]), 4),
        peak_ratio_per_rank=[
            round(g / c, 4) if c else None for g, c in zip(info["graph"]["peak_bytes"], info["chain"]["peak_bytes"])
        ],
        losses=losses,
        losses_equal=losses["chain"] == losses["graph"] and info["chain"]["loss"] == info["graph"]["loss"],
        last_profile={
            k: chain_doc.get(k)
            for k in ("F", "B", "latency", "bandwidth", "overhead", "ranks_per_node", "cores_per_node")
        },
    )
    return emit(rec)


def env_of(case: str, smoke: bool) -> dict:
    return {} if smoke else CASES[case]["env"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="profile + simulate + run rounds per case (default 5)")
    ap.add_argument("--steps", type=int, default=10, help="steps per pipec run (default 10; the first 2 dropped)")
    ap.add_argument("--reps", type=int, default=10, help="pipec profile --reps (default 10)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated (default: unet,two_encoders)")
    ap.add_argument(
        "--in-situ",
        action="store_true",
        help="simulate each system on its own `pipec profile --in-situ` instead of the graph on the chain's plain "
        "profile (noisier here: the in-situ op costs moved by 15%% from round to round, 2026-12-07)",
    )
    ap.add_argument("--inspect", nargs=2, metavar=("CASE", "SYSTEM"), help=argparse.SUPPRESS)
    smoke_flag(ap)
    args = ap.parse_args()
    OPNAMES.update(_opnames())
    if args.inspect:
        print(json.dumps(inspect(*args.inspect)))
        return
    if args.smoke:  # the model files' own small sizes, one round of 3 steps, a short profile: the format (tests)
        args.rounds, args.steps, args.reps = 1, 3, 2
    load_start = load_average()
    recs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in [c for c in args.cases.split(",") if c]:
            recs[case] = run_case(case, args, tmp)
    summary: dict = {"benchmark": "stage_graph.summary", "p": P, "m": M, "rounds": args.rounds, "smoke": args.smoke}
    if "two_encoders" in recs:
        te = recs["two_encoders"]
        summary["two_encoders"] = {
            "simulated_step_gain_core_per_rank": te["simulated_step_gain_core_per_rank"],
            "goal_simulated_gain": 1.08,
            "simulated_gain_met": te["simulated_step_gain_core_per_rank"] >= 1.08,
            "simulated_step_gain_this_machine": te["simulated_step_gain"],
            "measured_step_gain": te["measured_step_gain"],
            "gain_error_points": te["gain_error_points"],
            "gain_error_met": abs(te["gain_error_points"]) <= 5,
            "bytes_ratio": te["bytes_ratio"],
            "peak_ratio": te["peak_ratio"],
        }
    if "unet" in recs:
        un = recs["unet"]
        summary["unet"] = {
            "bytes_ratio": un["bytes_ratio"],
            "bytes_lower": un["bytes_ratio"] < 1,
            "peak_ratio": un["peak_ratio"],
            "peak_ratio_per_rank": un["peak_ratio_per_rank"],
            "peak_input_ratio": un["peak_input_ratio"],
            # the peak memory: what each rank holds for its micro-batches (saved tensors and held inputs, each
            # storage once), the highest rank's graph / chain; and the ranks where the graph holds less
            "peak_total_ratio": un["peak_total_ratio"],
            "peak_lower_on_ranks": [
                r for r in range(P) if un["peak_total_bytes"]["graph"][r] < un["peak_total_bytes"]["chain"][r]
            ],
            "peak_higher_on_ranks": [
                r for r in range(P) if un["peak_total_bytes"]["graph"][r] > un["peak_total_bytes"]["chain"][r]
            ],
            "peak_lower": un["peak_total_ratio"] < 1,
            "measured_step_gain": un["measured_step_gain"],
            "step_no_longer": un["measured_step_gain"] >= 1,
            "simulated_step_gain_this_machine": un["simulated_step_gain"],
            "simulated_step_gain_core_per_rank": un["simulated_step_gain_core_per_rank"],
            "gain_error_points": un["gain_error_points"],
            "gain_error_met": abs(un["gain_error_points"]) <= 5,
        }
    summary["losses_equal"] = all(r["losses_equal"] for r in recs.values())
    summary["load_avg_start"] = load_start
    emit(summary)


if __name__ == "__main__":
    main()
