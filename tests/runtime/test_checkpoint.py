"""Checkpoints and resume (pipec run --checkpoint DIR [--checkpoint-every K] [--resume]), multi-process.

A resumed run equals an uninterrupted one bitwise (float64 parameters and Adam's state), also after a
SIGKILL of the job; a partial save is ignored; another schedule with the same stages resumes; other
stages are refused.

Two jobs go through `pipec run` and torchrun, end to end: the job that is killed (--checkpoint,
--checkpoint-every, and the SIGKILL of the launcher) and a resume with --check (--resume). The others start
their two ranks from tests/support/runtime_harness.py's fork server (pipec.runtime.job.launch, the code every
torchrun worker runs, with the same options): the checkpoint logic is all in the ranks, and a job
started there costs about a second instead of three imports of torch."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from repo import ROOT

torch = pytest.importorskip("torch")

from runtime_harness import RankResult, launch  # noqa: E402

MLP = {"MLP_DEPTH": "4", "MLP_WIDTH": "16", "MLP_BATCH": "8"}
MODEL = ["-D", "p=2", "-D", "m=2", "--model", "examples/mlp.py"]
JOB = [*MODEL, "--nproc", "2"]


def pipec(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **MLP)
    return subprocess.run(
        [sys.executable, "-m", "pipec", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def ranks(schedule: str, *args: str, model: list[str] = MODEL) -> list[RankResult]:
    """The job `pipec run SCHEDULE MODEL --nproc 2 ARGS` would start, its two ranks forked from the
    harness's fork server: each rank's exit status and output (rank 0 prints the job's lines)."""
    results, _, _ = launch(2, "launch", [schedule, *model, *args], env=MLP, timeout=120.0)
    return results


def tensors(ckpt: Path, tmp: Path) -> dict:
    """Every tensor of a DCP checkpoint, read back in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    flat: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return {k: v for k, v in flat.items() if "/rng" not in k}


def losses(stdout: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+)/\d+: loss (\S+),", stdout, flags=re.M)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 5-step run, checkpointed after every step."""
    folder = tmp_path_factory.mktemp("straight")
    r = ranks("1f1b", "--steps", "5", "--checkpoint", str(folder), "--checkpoint-every", "1")
    assert all(x.returncode == 0 for x in r), [x.stderr for x in r]
    assert sorted(losses(r[0].stdout)) == [1, 2, 3, 4, 5], r[0].stdout
    return folder, losses(r[0].stdout)


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and any("optim" in k for k in a)  # Adam's moments are compared too
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"not bitwise equal: {differ[:5]}"


@pytest.mark.slow  # test_checkpoint_trust's two-rank fallback resumes bitwise equal to the uninterrupted run
def test_a_resumed_run_equals_an_uninterrupted_one_bitwise(straight, tmp_path):
    folder, straight_losses = straight
    ck = tmp_path / "ck"
    # --resume with no checkpoint folder yet: from the start
    first = ranks("1f1b", "--steps", "2", "--checkpoint", str(ck), "--resume")
    assert all(r.returncode == 0 for r in first), [r.stderr for r in first]
    assert "step 1/2: loss" in first[0].stdout and "resumed from" not in first[0].stdout, first[0].stdout
    assert (ck / "latest").read_text().splitlines()[0] == "step-000002"
    again = pipec("run", "1f1b", *JOB, "--steps", "4", "--checkpoint", str(ck), "--resume", "--check")
    assert again.returncode == 0, again.stderr
    assert f"resumed from {ck}/step-000002: steps 3 to 4" in again.stdout
    assert "OK: largest relative error 0.00e+00" in again.stdout  # the reference was brought to step 2 too
    assert losses(again.stdout) == {3: straight_losses[3], 4: straight_losses[4]}
    assert (ck / "latest").read_text().splitlines()[0] == "step-000004"
    assert_same(tensors(ck / "step-000004", tmp_path), tensors(folder / "step-000004", tmp_path))


@pytest.mark.slow  # resume from the last complete one: test_checkpoint_trust (partial folders, fallback)
def test_a_killed_run_resumes_from_its_last_complete_checkpoint(straight, tmp_path):
    folder, _ = straight
    ck = tmp_path / "ck"
    env = dict(os.environ, OMP_NUM_THREADS="1", **MLP)
    cmd = [sys.executable, "-m", "pipec", "run", "1f1b", *JOB, "--steps", "1000", "--checkpoint", str(ck)]
    out = dict(stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    proc = subprocess.Popen([*cmd, "--checkpoint-every", "1"], cwd=ROOT, env=env, **out)
    for line in proc.stdout:
        if line.startswith("checkpoint: ") and line.strip().endswith("step-000002"):
            break
    proc.send_signal(signal.SIGKILL)  # wherever it is now: training step 3, or saving it
    proc.wait(timeout=30)
    done = int((ck / "latest").read_text().splitlines()[0].split("-")[1])
    assert done >= 2
    (ck / f"step-{done + 1:06d}.partial").mkdir(exist_ok=True)  # as a kill during a save leaves it
    r = ranks("1f1b", "--steps", "5", "--checkpoint", str(ck), "--resume")
    assert all(x.returncode == 0 for x in r), [x.stderr for x in r]
    assert f"resumed from {ck}/step-{done:06d}" in r[0].stdout
    assert not list(ck.glob("*.partial"))
    assert_same(tensors(ck / "step-000005", tmp_path), tensors(folder / "step-000005", tmp_path))


def test_another_schedule_with_the_same_stages_resumes_and_other_stages_are_refused(straight, tmp_path):
    folder, _ = straight
    r = ranks("gpipe", "--steps", "5", "--checkpoint", str(folder), "--resume")
    assert all(x.returncode == 0 for x in r), [x.stderr for x in r]
    assert f"{folder}/step-000005 is after step 5: nothing left to run for --steps 5" in r[0].stdout
    # (an empty folder resumes from the start: the first run of the bitwise test above)
    (tmp_path / "g2").mkdir()
    import shutil

    shutil.copytree(folder / "step-000005", tmp_path / "g2" / "step-000005")
    (tmp_path / "g2" / "latest").write_text("step-000005\n")
    again = ranks("gpipe", "--steps", "6", "--checkpoint", str(tmp_path / "g2"), "--resume")
    assert all(x.returncode == 0 for x in again), [x.stderr for x in again]
    assert f"resumed from {tmp_path / 'g2'}/step-000005: steps 6 to 6" in again[0].stdout
    assert "step 6/6: loss" in again[0].stdout
    interleaved = ["-D", "p=2", "-D", "v=2", "-D", "m=2", "--model", "examples/mlp.py"]
    other = ranks("interleaved-1f1b", "--steps", "6", "--checkpoint", str(folder), "--resume", model=interleaved)
    assert all(x.returncode != 0 for x in other)
    want = "holds 2 stages (schedule `1f1b`), but this program has 4"
    assert all(want in x.stderr for x in other), [x.stderr for x in other]


def test_resume_without_a_checkpoint_folder_is_misuse():
    r = pipec("run", "1f1b", *JOB, "--resume")
    assert r.returncode == 2 and "--checkpoint-every and --resume need --checkpoint DIR" in r.stderr
