"""The runtime's user-facing errors: each prints as one message, never a traceback."""

from __future__ import annotations


class PipelineError(Exception):
    """A run cannot go on: bad model file, shape mismatch, wrong world size, a failed peer."""


class ModelError(PipelineError):
    """A missing or malformed model file; the message names the file and what is wrong."""


class ShapeError(PipelineError):
    """A stage's output does not fit the next stage's input, or shapes changed after the first step."""


class CommError(PipelineError):
    """A transfer failed or timed out; `peer` is the rank at the other end."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class CollectiveError(CommError):
    """A data-parallel collective failed or timed out; `peers` are the other job ranks it waited on (the
    one to blame is found from their reported positions: pipec.runtime.job.launch)."""

    def __init__(self, message: str, peers: list[int]) -> None:
        super().__init__(message, peers[0] if peers else -1)
        self.peers = peers


def wrong_world_size(program, world: int) -> str:
    params = " ".join(f"{k}={v}" for k, v in program.params)
    return (
        f"the program for `{program.name}` ({params}) has {program.num_ranks} ranks, but this job has {world} "
        f"processes; launch it with {program.num_ranks} (torchrun --nproc-per-node/--nnodes, or pipec run --nproc)"
    )


class PeerLostError(CommError):
    """A job-wide collective outside the Program (the step's statistics, a checkpoint's barrier) failed
    because a peer was lost; `peer` is its rank in the job (not a Program rank), found by its heartbeat."""
