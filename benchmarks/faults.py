"""How fast a pipec job ends after each fault, and whether it blames the right rank: one JSON line each.

    python benchmarks/faults.py [--rounds 3] [--timeout 10]
    python benchmarks/faults.py --smoke    # one fault (raise), one round: the format (the test suite's)

Faults, on `pipec run` (torchrun, gloo) of 1F1B p=3 m=3 with tests/models/faulty.py, injected in stage 1's
fifth forward (step 2): `raise` (an exception), `dead` (os._exit), `killed` (SIGKILL), `hung` (sleeps in
its forward: given up on after --timeout), `stopped` (SIGSTOP: its heartbeat stops). Then signals to `pipec run` during
training: `sigterm`, `sigint`, and `sigkill` (an orphan check: how long its ranks outlive it, and whether
its temporary folder is removed). Last, `mismatched`: two torchrun agents on 127.0.0.1 (two "nodes")
given 1f1b and gpipe. Each line gives the median seconds from the fault (the moment the model file marks,
or the signal) to the end of every process, the exit status, and whether the message names the rank
that failed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sidebyside import emit, load_average, smoke_flag  # noqa: E402

from pipec.runtime.host.spawned import alive, children  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = ["1f1b", "-D", "p=3", "-D", "m=3", "--model", "tests/models/faulty.py", "--nproc", "3"]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def job(dp: int) -> tuple[list[str], int]:
    """The job's arguments and the rank the fault hits: stage 1 of replica 0. Without data parallelism
    that is rank 1 of JOB; with `--dp` (1F1B p=2 on a ("pp", "dp") mesh) replica 0's pipeline holds the
    global ranks 0, dp, 2 dp, ..., so rank dp, and only that rank fails (PIPEC_FAULT_RANK)."""
    if dp == 1:
        return JOB, 1
    model = ["--model", "tests/models/faulty.py"]
    return ["1f1b", "-D", "p=2", "-D", "m=3", *model, "--nproc", str(2 * dp), "--dp", str(dp)], dp


def model_fault(kind: str, timeout: float, dp: int = 1) -> dict:
    fault = {"raise": "raise", "dead": "exit", "killed": "kill", "hung": "hang", "stopped": "stop"}[kind]
    argv, culprit = job(dp)
    with tempfile.TemporaryDirectory() as tmp:
        mark = Path(tmp) / "mark"
        env = _env(PIPEC_FAULT=fault, PIPEC_FAULT_STAGE="1", PIPEC_FAULT_CALL="4", PIPEC_FAULT_MARK=str(mark))
        if dp > 1:
            env["PIPEC_FAULT_RANK"] = str(culprit)
        cmd = [sys.executable, "-m", "pipec", "run", *argv, "--steps", "5", "--timeout", str(timeout)]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        workers: list[int] = []
        while proc.poll() is None and not mark.exists():
            workers = workers or [p for p in children(proc.pid)]
            time.sleep(0.02)
        _, err = proc.communicate(timeout=timeout + 120)
        end = time.time()
        while any(alive(p) for p in workers):
            time.sleep(0.02)
        end = max(end, time.time())
        at = float(mark.read_text()) if mark.exists() else float("nan")
    said = "failed|stopped responding or died|exited with status|was killed by SIGKILL"
    names = bool(re.search(rf"rank {culprit} ({said})", err))
    blames_other = bool(re.search(rf"rank (?!{culprit}\b)\d+ (failed|stopped responding or died)", err))
    return {"seconds": end - at, "exit": proc.returncode, "names_culprit": names and not blames_other, "stderr": err}


def _start_training(tmp: str) -> subprocess.Popen:
    env = _env(TMPDIR=tmp)
    cmd = [sys.executable, "-m", "pipec", "run", "1f1b", "-D", "p=2", "-D", "m=2", "--model", "examples/mlp.py"]
    proc = subprocess.Popen(
        [*cmd, "--steps", "100000"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.stdout.readline()  # the header: the ranks are up
    proc.stdout.readline()
    return proc


def signal_fault(kind: str) -> dict:
    sig = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigkill": signal.SIGKILL}[kind]
    with tempfile.TemporaryDirectory() as tmp:
        proc = _start_training(tmp)
        workers = [
            p for p in children(proc.pid) if "pipec.runtime.job.launch" in Path(f"/proc/{p}/cmdline").read_text()
        ]
        t0 = time.time()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        while any(alive(p) for p in workers) and time.time() - t0 < 60:
            time.sleep(0.02)
        seconds = time.time() - t0
        while list(Path(tmp).glob("pipec-run-*")) and time.time() - t0 < 60:
            time.sleep(0.02)
        left = [p.name for p in Path(tmp).glob("pipec-run-*")]
    says = sig == signal.SIGKILL or f"stopped by {sig.name}" in err
    return {"seconds": seconds, "exit": proc.returncode, "temporary_left": left, "says_signal": says, "stderr": err}


def mismatched(timeout: float) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["-D", "p=2", "-D", "m=2", "--model", "examples/mlp.py", "--timeout", str(timeout)]
    procs = []
    t0 = time.time()
    for node, name in enumerate(("1f1b", "gpipe")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)]
        cmd += ["--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        cmd += ["-m", "pipec.runtime.job.launch", name, *common]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    errs = [p.communicate(timeout=timeout + 120)[1] for p in procs]
    seconds = time.time() - t0
    names = any("was given `gpipe`" in e and "rank 0 runs `1f1b`" in e for e in errs)
    return {"seconds_from_launch": seconds, "exit": [p.returncode for p in procs], "names_both": names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=10.0, help="the job's --timeout (hung ranks)")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--dp", type=int, default=1, help="the model faults on a PP x DP job of 2 x DP ranks (default 1)")
    smoke_flag(ap)
    args = ap.parse_args()
    kinds = ["raise", "dead", "killed", "hung", "stopped", "sigterm", "sigint", "sigkill", "mismatched"]
    if args.smoke:  # one fault (an exception in stage 1), one round
        args.rounds, args.only = 1, ["raise"]
    for kind in args.only or kinds:
        load = load_average()
        runs = []
        for _ in range(args.rounds):
            if kind in ("raise", "dead", "killed", "hung", "stopped"):
                runs.append(model_fault(kind, args.timeout, args.dp))
            elif kind == "mismatched":
                runs.append(mismatched(60.0))
            else:
                runs.append(signal_fault(kind))
        key = "seconds_from_launch" if kind == "mismatched" else "seconds"
        rec = {
            "benchmark": "faults",
            "fault": kind,
            "median_s": round(statistics.median(r[key] for r in runs), 3),
            "max_s": round(max(r[key] for r in runs), 3),
            "exit": [r["exit"] for r in runs],
            "timeout": args.timeout,
            "dp": args.dp if kind in ("raise", "dead", "killed", "hung", "stopped") else 1,
            "culprit": job(args.dp)[1] if kind in ("raise", "dead", "killed", "hung", "stopped") else None,
            "load_avg_start": load,
        }
        for flag in ("names_culprit", "says_signal", "temporary_left", "names_both"):
            if flag in runs[0]:
                rec[flag] = [r[flag] for r in runs]
        emit(rec)


if __name__ == "__main__":
    main()
