"""A small MLP model file that fails on purpose, for the runtime's fault tests.

PIPEC_FAULT=raise|exit|kill|hang|stop, PIPEC_FAULT_STAGE=s, PIPEC_FAULT_CALL=k: stage s's k-th real forward
(counted from 0 over all steps, not counting shape inference) raises, ends its process (`exit`: status 3;
`kill`: SIGKILL; after a short pause, so the rank has published where it is), hangs, or stops its process
(SIGSTOP).
PIPEC_FAULT=exit-in-allreduce: the process of stage s exits (status 3) inside its k-th job-wide all-reduce
(counted from 0; the runtime's per-step statistics are one a step), outside every instruction.
PIPEC_FAULT=enospc-at-save: from its k-th checkpoint save on (counted from 0), every process (or only the job's
rank PIPEC_FAULT_RANK) finds the disk full: each fsync fails with ENOSPC, as on a file system that filled up.
"""

import errno
import os
import signal
import time

import torch
from torch import nn

WIDTH = 8
FAULT = os.environ.get("PIPEC_FAULT", "")
FAULT_STAGE = int(os.environ.get("PIPEC_FAULT_STAGE", "-1"))
FAULT_CALL = int(os.environ.get("PIPEC_FAULT_CALL", "0"))
# with data parallelism every replica holds stage s: PIPEC_FAULT_RANK=r limits the fault to the job's rank r
FAULT_RANK = os.environ.get("PIPEC_FAULT_RANK")
dtype = torch.float64
_patched: list[int] = []  # build_stage runs once per stage a rank holds: the disk fills once


def _mark() -> None:
    """Write the moment of the fault to PIPEC_FAULT_MARK, if set (benchmarks/faults.py times exits from it)."""
    if os.environ.get("PIPEC_FAULT_MARK"):
        with open(os.environ["PIPEC_FAULT_MARK"], "w") as f:
            f.write(repr(time.time()))


class Faulty(nn.Module):
    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage
        self.layer = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta" and torch.is_grad_enabled():
            if self.stage == FAULT_STAGE and self.calls == FAULT_CALL and FAULT_RANK in (None, os.environ.get("RANK")):
                if FAULT == "raise":
                    _mark()
                    raise RuntimeError("injected failure")
                if FAULT == "exit":
                    time.sleep(0.5)
                    _mark()
                    os._exit(3)
                if FAULT == "kill":
                    time.sleep(0.5)
                    _mark()
                    os.kill(os.getpid(), signal.SIGKILL)
                if FAULT == "hang":
                    _mark()
                    time.sleep(3600)
                if FAULT == "stop":  # the whole process stops answering, its threads too (as SIGSTOP does)
                    time.sleep(0.5)
                    _mark()
                    os.kill(os.getpid(), signal.SIGSTOP)
            self.calls += 1
        return torch.tanh(self.layer(x))


def _full_disk_from_save(k: int) -> None:
    """os.fsync fails with ENOSPC during and after the k-th torch.distributed.checkpoint.save of this process."""
    import torch.distributed.checkpoint as dcp

    real_save, real_fsync, saves = dcp.save, os.fsync, [0]

    def fsync(fd):
        if saves[0] > k:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    def save(*args, **kwargs):
        saves[0] += 1
        return real_save(*args, **kwargs)

    dcp.save, os.fsync = save, fsync


def build_stage(stage: int, num_stages: int) -> nn.Module:
    if FAULT == "enospc-at-save" and FAULT_RANK in (None, os.environ.get("RANK")) and not _patched:
        _patched.append(stage)
        _full_disk_from_save(FAULT_CALL)
    if FAULT == "exit-in-allreduce" and stage == FAULT_STAGE:
        import torch.distributed as dist

        real, calls = dist.all_reduce, [0]

        def all_reduce(*args, **kwargs):
            if calls[0] == FAULT_CALL:
                time.sleep(0.5)  # the others are in it by now
                _mark()
                os._exit(3)
            calls[0] += 1
            return real(*args, **kwargs)

        dist.all_reduce = all_reduce
    return Faulty(stage)


def loss_fn(output, target):
    return ((output - target) ** 2).mean()


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(12, WIDTH, generator=g, dtype=dtype), torch.randn(12, WIDTH, generator=g, dtype=dtype)
