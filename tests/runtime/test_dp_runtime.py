"""PP x DP on the runtime: pipelines x data-parallel replicas on a ("pp", "dp") DeviceMesh, over gloo.

After 3 steps, gradients (every step) and parameters (the last) must equal a single-process float64
reference over the whole global batch to 1e-10. The default suite runs a few representative cells; the
whole grid (4 schedules x {2x2, 4x2} x {ddp, fsdp}) is behind `-m dp_grid`:

    pytest tests/runtime/test_dp_runtime.py -m dp_grid -p no:cacheprovider
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

import pytest
from repo import ROOT

torch = pytest.importorskip("torch")

from runtime_harness import _context  # noqa: E402

TOL = 1e-10
STEPS = 3
# small enough for 8 gloo processes on 2 cores: 8-wide blocks, one per stage at p=4 interleaved (8 stages)
BATCH = 32
MODEL_ENV = {"MLP_WIDTH": "8", "MLP_DEPTH": "4", "MLP_BATCH": str(BATCH)}
ENV = {**MODEL_ENV, "OMP_NUM_THREADS": "1"}
SCHEDULES = {
    "1f1b": "1f1b:p={p},m={m}",
    "interleaved": "interleaved-1f1b:p={p},m={m},v=2",
    "zb-h1": "zb-h1:p={p},m={m}",
    "zb-v": "zb-v:p={p},m={m}",
}


def launch_dp(nproc: int, argv: list[str], timeout: float = 240.0) -> tuple[list[dict], float]:
    """Ranks 0..nproc-1 of one job running tests/support/dp_worker.py; their JSON results and the wall time.
    Fails (never hangs) past `timeout`, with every rank's standard error."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = dict(
        ENV,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        WORLD_SIZE=str(nproc),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    ctx = _context()
    import dp_worker

    tmp = tempfile.mkdtemp(prefix="pipec-dp-")
    files = [(os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")) for r in range(nproc)]
    start = time.monotonic()
    procs = []
    for r in range(nproc):
        env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        p = ctx.Process(target=dp_worker.rank_main, args=([tmp, *argv], env, *files[r]))
        p.start()
        procs.append(p)
    for p in procs:
        p.join(max(0.1, timeout - (time.monotonic() - start)))
    elapsed = time.monotonic() - start
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errs = "\n".join(f"rank {r}: {Path(e).read_text()[-3000:]}" for r, (_, e) in enumerate(files))
    if hung:
        pytest.fail(f"ranks {hung} still running after {timeout} s (a hang):\n{errs}")
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        pytest.fail(f"ranks {bad} failed:\n{errs}")
    return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nproc)], elapsed


def check(results: list[dict], configs: list[str], p: int, dp: int) -> None:
    for spec in configs:
        per_rank = [r[spec] for r in results]
        # every (pp, dp) coordinate once; replicas of a pipeline rank hold the same stages
        assert sorted((r["pp"], r["dp"]) for r in per_rank) == [(a, b) for a in range(p) for b in range(dp)]
        stages = {}
        for r in per_rank:
            stages.setdefault(r["pp"], set()).add(tuple(r["stages"]))
        assert all(len(v) == 1 for v in stages.values()), stages
        if ":fsdp" in spec:
            assert all(r["sharded"] for r in per_rank), f"{spec}: parameters are not sharded"
        for r in per_rank:
            assert r["grads"] > 0
            assert len(r["grad_err"]) == STEPS
            assert max(r["grad_err"]) <= TOL, f"{spec} rank {r['pp']},{r['dp']}: gradients {r['grad_err']}"
            assert r["param_err"] <= TOL, f"{spec} rank {r['pp']},{r['dp']}: parameters {r['param_err']}"
            losses = [e for e in r["loss_err"] if e is not None]
            assert all(e <= TOL for e in losses), f"{spec}: loss {r['loss_err']}"
        assert any(r["loss_err"][0] is not None for r in per_rank)  # the last stage's ranks report the loss
        # each replica ran its own 1/dp of the global batch, in m micro-batches
        m = int(spec.split("m=")[1].split(",")[0].split(":")[0])
        rows = [r["mb_rows"] for r in per_rank if "mb_rows" in r]
        assert len(rows) == dp and all(x == [BATCH // (dp * m)] * m for x in rows), rows


def configs_for(schedules: list[str], p: int, kinds: list[str], extra: str = "") -> list[str]:
    m = 2 * p
    return [SCHEDULES[s].format(p=p, m=m) + f":{k}{extra}" for s in schedules for k in kinds]


def cell(name: str, p: int, kind: str, opts: str = "") -> str:
    return SCHEDULES[name].format(p=p, m=2 * p) + f":{kind}" + (f":{opts}" if opts else "")


def test_1f1b_ddp_and_zbv_fsdp_2x2():
    """The default suite's representative cells: 1F1B under ddp, ZB-V (split backward, two stages per
    rank, UNSHARD/RESHARD windows mid-step) under fsdp; 2 ranks x 2 replicas."""
    cfgs = [cell("1f1b", 2, "ddp"), cell("zb-v", 2, "fsdp")]
    results, elapsed = launch_dp(4, [str(STEPS), "2", *cfgs])
    assert all(r[cfgs[1]]["unshards"] > 0 for r in results)  # the lowering placed windows
    check(results, cfgs, 2, 2)
    print(f"2x2 1f1b ddp + zb-v fsdp: {elapsed:.1f} s")


@pytest.mark.dp_grid
@pytest.mark.parametrize("p", [2, 4], ids=["2x2", "4x2"])
def test_grid(p):
    """Every schedule x {ddp, fsdp} on p ranks x 2 replicas (one job per mesh size, so the processes start
    once); per-block FSDP and the (pp, dp) sub-mesh form of mesh= ride along. Opt-in (minutes on 2 cores):
    pyproject.toml deselects it unless `-m dp_grid` is given."""
    cfgs = configs_for(list(SCHEDULES), p, ["ddp", "fsdp"])
    # per-block sharding and the sub-mesh form; Belady windows (several gathers a step) without prefetch;
    # today's tail placement with windows inserted by hand (gathered and freed between F, B and W)
    cfgs += [cell("zb-h1", p, "fsdp", "block,pair"), cell("zb-v", p, "fsdp", "g1,p0")]
    cfgs += [cell("interleaved", p, "fsdp", "g1"), cell("zb-v", p, "fsdp", "hand"), cell("1f1b", p, "ddp", "hand")]
    results, elapsed = launch_dp(2 * p, [str(STEPS), "2", *cfgs], timeout=600.0)
    check(results, cfgs, p, 2)
    for spec in cfgs:
        print(f"{p}x2 {spec}: {max(r[spec]['seconds'] for r in results):.1f} s")
    worst = max(max(max(r[c]["grad_err"]), r[c]["param_err"]) for r in results for c in cfgs)
    print(f"{p}x2 grid: {len(cfgs)} cells, {elapsed:.1f} s, largest relative error {worst:.1e}")


def test_bad_input_is_refused_before_any_step():
    """Each refused in the Runner's constructor with a message saying what is wrong: FSDP over parameters
    shared across stages or blocks, a Program whose dp or ranks disagree with the mesh, UNSHARD in ddp."""
    results, _ = launch_dp(2, [str(STEPS), "2", "BAD"], timeout=120.0)
    for r in results:
        assert "same Parameter" in r["tied_stages"] and "stage 0" in r["tied_stages"], r["tied_stages"]
        assert "stage 1" in r["tied_stages"] and "shared across stages" in r["tied_stages"]
        assert "same Parameter" in r["tied_blocks"] and "block" in r["tied_blocks"], r["tied_blocks"]
        assert "'dp' dimension has 2 replicas" in r["dp_mismatch"] and "dp=4" in r["dp_mismatch"]
        assert "'pp' dimension has 1 ranks" in r["pp_mismatch"] and "has 2" in r["pp_mismatch"]
        assert "UNSHARD" in r["unshard_in_ddp"] and "ddp" in r["unshard_in_ddp"], r["unshard_in_ddp"]


def test_launch_refuses_a_world_dp_does_not_fit(tmp_path):
    """torchrun-launched ranks whose world is not ranks x dp stop before any communication, each saying
    why (3 processes for 2 ranks x --dp 2; 4 processes for 2 ranks x --dp 3)."""
    from runtime_harness import launch

    model = str(ROOT / "examples" / "mlp.py")
    for nproc, dp, want in ((3, 2, "--dp 2 does not divide the 3 processes"), (4, 3, "--dp 3 does not divide")):
        argv = ["1f1b", "-D", "p=2", "-D", "m=4", "--model", model, "--dp", str(dp)]
        results, _, _ = launch(nproc, "launch", argv, env=MODEL_ENV, timeout=120.0)
        for r in results:
            assert r.returncode == 1, r.stderr
            assert want in r.stderr and "Traceback" not in r.stderr, r.stderr
    argv = ["1f1b", "-D", "p=2", "-D", "m=2", "--model", model, "--dp", "2"]
    results, _, _ = launch(2, "launch", argv, env=MODEL_ENV, timeout=120.0)
    assert all("that is 4 processes, but this job has 2" in r.stderr for r in results), results[0].stderr


def test_pipec_run_refuses_bad_dp_before_starting_processes():
    import subprocess
    import sys

    model = str(ROOT / "examples" / "mlp.py")
    base = [sys.executable, "-m", "pipec", "run", "1f1b", "-D", "p=2", "-D", "m=4", "--model", model]
    cases = [
        (["--dp", "3", "--nproc", "4"], "--dp 3 does not divide the 4 processes"),
        (["--dp", "2", "--local"], "--local runs one pipeline"),
        (["--dp", "2", "--dp-unit", "block"], "--dp-unit block shards per block: it needs --dp-kind fsdp"),
    ]
    for extra, want in cases:
        p = subprocess.run(base + extra, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert p.returncode == 2, (extra, p.stderr)
        assert want in p.stderr and "Traceback" not in p.stderr, (extra, p.stderr)


def test_a_replica_that_hangs_is_given_up_on_after_the_timeout():
    """Job rank 3 (pp 1, replica 1) hangs in a forward of step 2: its pipeline peer times out on a
    transfer, its replica peer on the collective (REDUCE_GRAD); every rank exits within the timeout and a
    few seconds, naming a rank and an instruction, never hanging."""
    from runtime_harness import launch

    argv = ["1f1b", "-D", "p=2", "-D", "m=2", "--model", "tests/models/dp_hang.py", "--dp", "2", "--timeout", "3"]
    results, elapsed, _ = launch(4, "launch", argv, env={"PIPEC_HANG_RANK": "3"}, timeout=60)
    for r in results:
        assert r.returncode != 0, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        assert re.search(r"step 2, instruction #\d+ `", r.stderr), r.stderr
    # every rank names the hung rank 3: rank 0's reduction with rank 1 (waiting on rank 3 in its pipeline)
    # times out too, and waits for rank 1's own report rather than blaming it
    for r in results[:3]:
        assert "rank 3 stopped responding" in r.stderr, (r.rank, r.stderr)
    print(f"a hung replica: every rank out in {elapsed:.1f} s; rank 2 said: {results[2].stderr.strip()[-400:]}")
    assert elapsed < 30


def test_world_and_flags_are_checked_in_words():
    import argparse
    import dataclasses

    from pipec.api import load
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime.exec.replicas import check_world
    from pipec.runtime.job.launch import with_dp

    assert check_world(2, 2, 4) is None
    assert "--dp 3 does not divide the 4 processes" in check_world(2, 3, 4)
    assert "that is 4 processes, but this job has 6" in check_world(2, 2, 6)
    prog = compile_schedule(load("1f1b", p=2, m=2)).program
    two = dataclasses.replace(prog, dp=2, dp_kind="fsdp")
    ns = argparse.Namespace
    assert with_dp(prog, ns(dp=1, dp_kind="ddp")) is prog
    assert with_dp(two, ns(dp=1, dp_kind="ddp")) is two  # no flags: the Program's own
    assert with_dp(two, ns(dp=2, dp_kind="fsdp")) is two
    with pytest.raises(ValueError, match="compiled for data parallelism 1 x ddp, not the --dp 2 --dp-kind ddp"):
        with_dp(prog, ns(dp=2, dp_kind="ddp"))
    with pytest.raises(ValueError, match="2 x fsdp, not the --dp 2 --dp-kind ddp"):
        with_dp(two, ns(dp=2, dp_kind="ddp"))


def test_local_pipeline_refuses_a_data_parallel_program():
    import dataclasses

    from pipec.api import load
    from pipec.passes.compiler import compile_schedule
    from pipec.runtime import LocalPipeline, PipelineError, load_model

    model = load_model(str(ROOT / "examples" / "mlp.py"))
    prog = dataclasses.replace(compile_schedule(load("1f1b", p=2, m=2)).program, dp=2)
    with pytest.raises(PipelineError, match="2 data-parallel replicas.*runs one pipeline"):
        LocalPipeline(prog, model.build_stage, model.loss_fn)


def test_reference_over_replicas_is_the_global_batch_in_replica_order():
    """Reference(replicas=N) runs replica d's rows (part d of N, then m micro-batches), each loss scaled
    1/(N m): with rows that split evenly that is exactly one pipeline of N m micro-batches."""
    from pipec.runtime import Reference, load_model
    from pipec.runtime.exec.replicas import slice_replica

    model = load_model(str(ROOT / "examples" / "mlp.py"))
    x, y = model.batch(0)
    two = Reference(model.build_stage, model.loss_fn, 2, 2, replicas=2, dtype=torch.float64)
    one = Reference(model.build_stage, model.loss_fn, 2, 4, dtype=torch.float64)
    assert two.step(x, y) == pytest.approx(one.step(x, y), rel=1e-15)
    for k, g in two.named_gradients().items():
        assert torch.allclose(g, one.named_gradients()[k], rtol=1e-13, atol=0), k
    assert torch.equal(slice_replica(x, 2, 1), x[x.shape[0] // 2 :])
    assert slice_replica(x, 1, 0) is x


def test_checkpoint_of_sharded_stages_resumes_under_another_data_parallelism(tmp_path):
    """fsdp 2x2 saves after 2 steps (DCP writes each shard once); ddp 2x2 resumes it for step 3 and still
    equals the reference over the global batch."""
    from runtime_harness import launch

    base = ["zb-v", "-D", "p=2", "-D", "m=4", "--model", "examples/mlp.py", "--dp", "2"]
    base += ["--checkpoint", str(tmp_path), "--timeout", "60"]
    results, _, _ = launch(4, "launch", [*base, "--dp-kind", "fsdp", "--steps", "2"], env=MODEL_ENV, timeout=120)
    assert all(r.returncode == 0 for r in results), results[0].stderr
    assert (tmp_path / "latest").read_text().splitlines()[0] == "step-000002"
    argv = [*base, "--dp-kind", "ddp", "--steps", "3", "--resume", "--check"]
    results, _, _ = launch(4, "launch", argv, env=MODEL_ENV, timeout=120)
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    out = results[0].stdout
    assert "resumed from" in out and "steps 3 to 3" in out, out
    assert "OK: largest relative error" in out, out


@pytest.mark.parametrize("kind", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_collective_whose_replica_hangs_times_out_naming_rank_and_instruction(kind):
    """One pipeline rank x 2 replicas: job rank 1 hangs in a forward of step 2, so rank 0 has no transfer
    to wait on, only the collective (REDUCE_GRAD's all-reduce or reduce-scatter under ddp, an fsdp
    stage's gather). It gives up after --timeout with a message naming its rank and instruction."""
    from runtime_harness import launch

    argv = ["1f1b", "-D", "p=1", "-D", "m=2", "--model", "tests/models/dp_hang.py", "--dp", "2", "--timeout", "3"]
    results, elapsed, _ = launch(2, "launch", [*argv, "--dp-kind", kind], env={"PIPEC_HANG_RANK": "1"}, timeout=60)
    err = results[0].stderr
    assert results[0].returncode != 0 and "Traceback" not in err, err
    assert re.search(r"rank 0 \(replica 0\): .* at step 2, instruction #\d+ `(REDUCE_GRAD|STEP|FWD) 0.*`", err), err
    assert "timed out" in err, err
    # the replica that never joined is blamed, by its last reported position, not the rank that waited
    blamed = r"rank 1 stopped responding or died \(its last reported position: step 2, instruction #\d+ `FWD"
    assert re.search(blamed, err), err
    assert all(r.returncode != 0 for r in results)
    assert elapsed < 30


def test_pipec_run_refuses_more_local_processes_than_the_machine_holds_unless_forced(monkeypatch):
    """A typo in --dp (or -D p) must not start two million processes: refused, with what it would cost."""
    from cli_helpers import run_cli

    import pipec.runtime.job.run as run_mod

    argv = ["run", "1f1b", "-D", "p=2", "-D", "m=2", "--model", "examples/mlp.py", "--dp", "1000000"]
    rc, out, err = run_cli(*argv)
    assert rc == 2 and "starts 2000000 processes" in err and "--force" in err, err
    started = []
    monkeypatch.setattr(run_mod, "run_torchrun", lambda opts, program, nproc, *a: started.append(nproc) or 0)
    assert run_cli(*argv, "--force")[0] == 0 and started == [2_000_000]  # insisting starts them
