"""`pipec profile --in-situ`: the costs of ops as they run in the schedule, on every rank at once.

Op times measured one at a time (`pipec.runtime.profile.stages`, in one process per rank at once on CPUs) leave
out what a run adds: the executor's transfers between ops, and the caches the schedule's own order
leaves cold. Here the
schedule's ranks run as `pipec run` runs them (one gloo process each, bound the same way, the runtime's
`Runner`) for `warmup + reps` steps on `batch(0)`, recording every step after the warmup. The cost file
then gets, per stage, the median time of each op over those steps, and the `overhead` estimated from
the gaps between them (pipec.runtime.profile.overhead.per_instruction). What the simulator has left to predict
is how the ops and messages wait for each other.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import defaultdict

from pipec.formats.program_file import from_json, to_json
from pipec.ir.program import Program
from pipec.runtime.errors import CommError, PipelineError
from pipec.runtime.host import spawned


def profile_in_situ(
    program: Program,
    model_path: str,
    *,
    reps: int = 20,
    warmup: int = 3,
    threads: int = 1,
    seed: int = 0,
    loss_scale: float | None = None,
    timeout: float = 60.0,
    experts: bool = False,
) -> dict:
    """Run the Program on its number of local gloo processes; returns {"ops": {(op, stage): median s},
    "overhead": s or None, "step_s": median step time, "steps": recorded steps, "step": {stage: median s
    of its STEP}, "collectives": {(op, stage): median s the rank spent in it}, "outside_s": median over
    steps of the largest rank's time outside its instructions (set-up, the loss all-reduce), "delivery": messages
    as the run delivered them (`pipec.runtime.profile.overhead.deliveries`)}. `timeout` is how long a
    rank waits for a peer (as `pipec run --timeout`); the whole run is given `timeout` per step. A Program
    with `dp` > 1 runs as `pipec run --dp` runs it: ranks x dp processes on a ("pp", "dp") mesh, each
    replica on its share of the batch; the ops are replica 0's (its processes are ranks r * dp). `experts`:
    with the Program's expert parallelism and overlapped pairs, as the run has them (their all-to-alls, the
    transfer thread's CPU in the ops' `ops_cpu`, the pairs' `handoff`); the ops' wall times then hold the
    all-to-alls' waits and the other op of a pair, so only their CPU is the ops' own (the profile takes it
    where processes outnumber CPUs). Without, every replica holds every expert and nothing is exchanged."""
    if reps < 1 or warmup < 0:
        raise ValueError("reps must be at least 1 and warmup at least 0")
    spec = dict(
        program=to_json(program),
        model=os.path.abspath(model_path),
        reps=reps,
        warmup=warmup,
        threads=threads,
        seed=seed,
        loss_scale=loss_scale,
        timeout=timeout,
        experts=experts and program.experts.size > 1,
    )
    procs = program.num_ranks * program.dp
    result = spawned.run_gloo(_rank, procs, spec, timeout=timeout * (warmup + reps + 2))
    if isinstance(result, str):
        raise PipelineError(f"the in-situ profile of {program.name} failed: {result}")
    return result[0]


def _rank(rank: int, world: int, port: int, spec: dict, out) -> None:
    # bound as `pipec run` binds its ranks
    dist = spawned.join_gloo(rank, world, port, threads=spec["threads"], timeout=spec["timeout"])
    from pipec.runtime.model.contract import load_model
    from pipec.runtime.runner import Runner, StageOptions, Transport

    runner = None
    try:
        program = from_json(spec["program"])
        model = load_model(spec["model"])
        runner = Runner(
            program,
            model.build_stage,
            model.loss_fn,
            rank=rank if program.dp == 1 else None,  # with replicas the mesh says (Runner makes it)
            options=StageOptions(
                optimizer=model.optimizer, dtype=model.dtype, seed=spec["seed"], loss_scale=spec["loss_scale"]
            ),
            transport=Transport(timeout=spec["timeout"], experts=program.experts if spec["experts"] else None),
        )
        from pipec.runtime.exec.microbatch import batch_of

        x, y = batch_of(model.batch(0), f"{model.path}: batch(0)")
        steps, seconds = [], []
        for k in range(spec["warmup"] + spec["reps"]):
            res = runner.step(x, y, record=k >= spec["warmup"])
            if k >= spec["warmup"]:
                steps.append(runner.events())
                seconds.append(res.seconds)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (steps, seconds))
        replica0 = gathered[:: program.dp]  # global rank r * dp: rank r of replica 0
        summary = None
        if rank == 0:
            summary = summarize(program, [g[0] for g in replica0], [g[1] for g in gathered])
            # every replica's own op medians: the replicas meet at their blocking collectives, so the
            # slowest one's pace is the step's (on shared CPUs their identical stages run at different speeds)
            summary["ops_by_replica"] = [
                _op_medians(program, [g[0] for g in gathered[d :: program.dp]]) for d in range(program.dp)
            ]
        out.put(("result", rank, summary))
    except Exception as e:  # noqa: BLE001 - reported by the parent, which names the profile
        if not isinstance(e, PipelineError):  # the model's own code: where it failed
            import traceback

            traceback.print_exc()
        # a rank that lost its peer says which; the parent prefers a culprit's message to its peers'
        spawned.failed(out, rank, e.peer if isinstance(e, CommError) else rank, f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        runner = None
        spawned.leave_gloo(dist)


def _op_medians(program: Program, events: list[list[list[tuple]]]) -> dict:
    """{(op, stage): median s} over the recorded steps of these ranks' events (events[rank][step])."""
    from pipec.runtime.exec.measure import timeline

    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    for k in range(len(events[0])):
        tl = timeline(program, [events[r][k] for r in range(len(events))])
        for op, s, a, b in zip(tl.op.tolist(), tl.stage.tolist(), tl.start.tolist(), tl.end.tolist()):
            times[(op, s)].append(b - a)
    return {k: statistics.median(v) for k, v in times.items()}


def ops_cpu(events: list[list[list[tuple]]]) -> dict[tuple[int, int], float]:
    """Per (opcode, stage), the mean CPU seconds of its ops in these events (events[rank][step]): the op's
    thread's (a compute event's 7th field) and the expert group's transfer thread's for the op's all-to-alls
    (their 9th), which the op would spend itself if it issued them."""
    cpu: dict[tuple[int, int], list[float]] = defaultdict(list)
    for per_rank in events:
        for evs in per_rank:
            moved: dict[tuple[int, int, int], float] = defaultdict(float)
            for e in evs:
                if e[0] == "alltoall":
                    moved[(e[1], e[2], e[3])] += e[8]
            for e in evs:
                if e[0] == "compute":
                    cpu[(e[1], e[3])].append(e[6] + moved.get((e[1], e[2], e[3]), 0.0))
    return {k: statistics.fmean(v) for k, v in cpu.items()}


def handoff(events: list[list[list[tuple]]]) -> float | None:
    """The mean wake-up of an overlapped pair's op taking its turn (the executor's ("handoff", seconds)
    events, pipec.runtime.exec.pairs), or None where no pair handed a turn over."""
    waits = [e[1] for per_rank in events for evs in per_rank for e in evs if e[0] == "handoff"]
    return statistics.fmean(waits) if waits else None


def summarize(program: Program, events: list[list[list[tuple]]], seconds: list[list[float]]) -> dict:
    """events[rank][step]: each recorded step's events; seconds[rank][step]: each rank's step time."""
    from pipec.runtime.exec.measure import timeline
    from pipec.runtime.profile.overhead import deliveries, per_instruction

    timelines = [timeline(program, [events[r][k] for r in range(len(events))]) for k in range(len(events[0]))]
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    for tl in timelines:
        for op, s, a, b in zip(tl.op.tolist(), tl.stage.tolist(), tl.start.tolist(), tl.end.tolist()):
            times[(op, s)].append(b - a)
    # The optimizer steps (STEP s, with FSDP2's final callback and reshard), the collectives as the ranks
    # spent them (blocking on gloo), and each rank's time in the step outside its instructions.
    step_t: dict[int, list[float]] = defaultdict(list)
    coll_t: dict[tuple[int, int], list[float]] = defaultdict(list)
    outside: list[float] = []
    for k in range(len(events[0])):
        per_rank = []
        for r in range(len(events)):
            run = bounds = None
            for e in events[r][k]:
                if e[0] == "step":
                    step_t[e[1]].append(e[3] - e[2])
                elif e[0] == "collective":
                    coll_t[(e[1], e[2])].append(e[4] - e[3])
                elif e[0] == "run":
                    run = e
                elif e[0] == "bounds":
                    bounds = e
            if run is not None and bounds is not None:
                per_rank.append(max(run[1] - bounds[1], 0.0) + max(bounds[2] - run[2], 0.0))
        if per_rank:
            outside.append(max(per_rank))
    return {
        "step": {s: statistics.median(v) for s, v in step_t.items()},
        "collectives": {k: statistics.median(v) for k, v in coll_t.items()},
        "outside_s": statistics.median(outside) if outside else None,
        "ops": {k: statistics.median(v) for k, v in times.items()},
        # their means too: a step adds its ops up, and on shared CPUs their times have a long tail
        "ops_mean": {k: statistics.fmean(v) for k, v in times.items()},
        # and the CPU they took: where processes outnumber cores, what the simulator shares out (docs/simulate.md)
        "ops_cpu": ops_cpu(events),
        "handoff": handoff(events),
        "overhead": per_instruction(program, timelines),
        "overhead_with_stalls": per_instruction(program, timelines, stall=math.inf),
        "delivery": deliveries(timelines),
        "step_s": statistics.median(max(per) for per in zip(*seconds)),
        "steps": len(timelines),
    }
