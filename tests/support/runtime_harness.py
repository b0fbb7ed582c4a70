"""Launching a few ranks of one job for the runtime tests, without torchrun: each rank's exit status and
output are observed one by one, and no launcher kills the others when one fails.

Ranks are forked from a fork server that has imported torch (and torch._dynamo, which every torch
optimizer imports on creation) once, so a rank starts in milliseconds instead of seconds of imports;
that is what keeps these multi-process tests cheap on two cores. The job's store is served from the
test process, as torchrun's agent serves it, so a rank may die without taking the store with it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from repo import ROOT

PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "pipec.runtime.runner", "pipec.runtime.job.launch"]
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
        warm = _ctx.Process(target=_nothing)  # start the server (and its imports) now, outside any timing
        warm.start()
        warm.join()
    return _ctx


def _nothing() -> None:
    pass


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str
    pid: int  # the rank's process: names it made (shared-memory channels) carry it


def _rank_main(entry: str, argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    os.environ.update(env)
    os.chdir(ROOT)
    fo, fe = os.open(out, os.O_WRONLY | os.O_CREAT), os.open(err, os.O_WRONLY | os.O_CREAT)
    os.dup2(fo, 1)
    os.dup2(fe, 2)
    sys.argv = [entry, *argv]
    if entry == "launch":
        from pipec.runtime.job.launch import main
    else:
        sys.path.insert(0, str(ROOT / "tests" / "support"))
        from runtime_worker import main
    code = 1
    try:
        code = main(argv) or 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch(
    nproc: int,
    entry: str,
    argv: list[str] | list[list[str]],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    stopped: tuple[int, ...] = (),
) -> tuple[list[RankResult], float, int]:
    """Run ranks 0..nproc-1 of one job: entry "launch" (pipec.runtime.job.launch) or "worker"
    (tests/support/runtime_worker.py) with ARGV (one list for all, or one list per rank, as separately launched
    nodes would be). Returns the results, the wall time and the number of keys the ranks left in the
    store. Fails the test (never hangs) past `timeout`. Ranks in `stopped` are expected to stop
    themselves (SIGSTOP): the wall time is that of the others, and they are killed once those are done."""
    import tempfile

    import pytest
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        WORLD_SIZE=str(nproc),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS="1",
        **(env or {}),
    )
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="pipec-ranks-")
    files = [(os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")) for r in range(nproc)]
    procs = []
    start = time.monotonic()
    for r in range(nproc):
        e = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        mine = argv[r] if argv and isinstance(argv[0], list) else argv
        p = ctx.Process(target=_rank_main, args=(entry, mine, e, *files[r]))
        p.start()
        procs.append(p)
    for r, p in enumerate(procs):
        if r not in stopped:
            p.join(max(0.1, timeout - (time.monotonic() - start)))
    elapsed = time.monotonic() - start
    hung = [r for r, p in enumerate(procs) if p.is_alive() and r not in stopped]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = [
        RankResult(r, p.exitcode, Path(files[r][0]).read_text(), Path(files[r][1]).read_text(), p.pid)
        for r, p in enumerate(procs)
    ]
    if hung:
        pytest.fail(f"ranks {hung} still running after {timeout} s (a hang):\n" + "\n".join(x.stderr for x in results))
    return results, elapsed, store.num_keys()


def _json_rank_main(target, rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
    target(rank, out)


def json_ranks(target, nproc: int, tmp_path: Path, timeout: float = 120.0) -> list:
    """Run `target(rank, out)` (a module-level function) in ranks 0..nproc-1 of one gloo job, each with
    torchrun's environment set and writing its result as JSON to `out`; the results, in rank order. Fails
    the test (never hangs) past `timeout`, and when a rank exits non-zero."""
    import json

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    outs = [str(tmp_path / f"{r}.json") for r in range(nproc)]
    ctx = _context()
    procs = [ctx.Process(target=_json_rank_main, args=(target, r, nproc, store.port, outs[r])) for r in range(nproc)]
    for p in procs:
        p.start()
    start = time.monotonic()
    for p in procs:
        p.join(max(0.1, timeout - (time.monotonic() - start)))
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"ranks {alive} still running after {timeout:g} s"
    assert [p.exitcode for p in procs] == [0] * nproc
    return [json.loads(Path(o).read_text()) for o in outs]
