"""Every rank of a job runs the same Program and the same model file, or the job stops at start-up.

Nodes launched by hand (torchrun on each node) can be given different schedules, parameters or model
files; without this check such a job deadlocks until the peer timeout and then blames a live rank. Each
rank publishes a fingerprint (the Program's JSON form and the model file's bytes, hashed) and a short
description in the job's store; every rank compares its own with rank 0's and a mismatch fails within
seconds, naming both ranks and what each runs.
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta

from pipec.formats.program_file import write_json
from pipec.ir.program import Program
from pipec.runtime.errors import PipelineError


class _Hasher:
    """A text sink that hashes what is written to it (the Program is streamed, never held as one string)."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()

    def write(self, text: str) -> int:
        self.h.update(text.encode())
        return len(text)


def describe(program: Program, model_path: str) -> str:
    params = " ".join(f"{k}={v}" for k, v in program.params)
    return f"`{program.name}` ({params}) with {os.path.basename(model_path)}"


def fingerprint(program: Program, model_path: str) -> str:
    sink = _Hasher()
    write_json(program, sink)
    with open(model_path, "rb") as f:
        sink.h.update(f.read())
    return sink.h.hexdigest()[:16]


def check_same_program(store, rank: int, program: Program, model_path: str, timeout: float, attempt: str = "0") -> None:
    """Publish this rank's fingerprint and compare it with rank 0's; PipelineError on a mismatch."""
    mine = f"{fingerprint(program, model_path)} {describe(program, model_path)}"
    key = f"pipec/attempt{attempt}/program/"
    store.set(key + str(rank), mine)
    if rank == 0:
        return
    store.wait([key + "0"], timedelta(seconds=timeout))
    theirs = store.get(key + "0").decode()
    if theirs.split(" ", 1)[0] != mine.split(" ", 1)[0]:
        raise PipelineError(
            f"rank {rank} was given {mine.split(' ', 1)[1]}, but rank 0 runs {theirs.split(' ', 1)[1]}"
            f" (fingerprints {mine.split(' ', 1)[0]} and {theirs.split(' ', 1)[0]}): every node of a job must"
            " be launched with the same schedule, parameters and model file"
        )
