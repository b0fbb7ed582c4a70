"""torch.distributed.pipelining's schedule CSV (torch 2.13): its action types, as pipec opcodes.

torch writes one row per rank and one action per cell (`_PipelineScheduleRuntime._dump_csv`) and reads
the same file back (`_load_csv`); torchtitan loads a custom schedule from it. An action is
`{stage}{type}{micro-batch}` (`0F1`, `2I0`, `2W0`, `1SEND_F2`, `1RECV_B0`), `{stage}{type}` for
`UNSHARD`, `RESHARD` and `REDUCE_GRAD`, or `(sub;sub)OVERLAP_F_B` for an overlapped pair. An empty cell
is a bubble. There are two formats:

- compute only: `F` forward, `I` input gradient, `W` weight gradient, `B` full backward and
  `OVERLAP_F_B`; torch adds the communication itself (`_add_send_recv`);
- compute + communication: the same plus `SEND_F`/`RECV_F` (activations), `SEND_B`/`RECV_B`
  (gradients), `UNSHARD`/`RESHARD` (FSDP) and `REDUCE_GRAD`. A send names the sending stage, a
  receive the receiving stage, like pipec's Program.

In pipec terms: torch's `I` is our `B` and `W` our `W` (a split backward, `ops F, B, W`); torch's `B` is
our full backward `B` (`ops F, B`), or `B` then `W` in a split schedule. A pair `F & B` is
`(F;B)OVERLAP_F_B`, with torch's full backward `B` inside when our `B` is followed by its `W`.

What both directions share lives here: the action types and the instruction-table row each stands for
(`OPCODE_OF`), which of them compute, communicate or take no micro-batch, and the name torch gives a
pipec opcode (`torch_name`). pipec.formats.torch_csv_reader reads a CSV into a Schedule (and writes it
back as `.pipe`); pipec.formats.torch_csv_writer is the one writer of the CSV. Plain text only: nothing
here imports torch.
"""

from __future__ import annotations

from pipec.ir.opcodes import BY_NAME, COMPUTE_RES

TORCH_VERSION = "2.13"

# torch's action types as pipec opcodes: the one thing this module adds to the instruction table
# (pipec.ir.opcodes), which says what each is: compute or transfer, which side of which message, where the
# peer sits. torch's `I` is the input gradient (our BWD in a split schedule); its `B`, the full backward,
# is our BWD too, followed by a WGRAD when the schedule splits backward.
OPCODE_OF = {
    "F": "FWD",
    "I": "BWD",
    "B": "BWD",
    "W": "WGRAD",
    "SEND_F": "SEND_ACT",
    "RECV_F": "RECV_ACT",
    "SEND_B": "SEND_GRAD",
    "RECV_B": "RECV_GRAD",
    "REDUCE_GRAD": "REDUCE_GRAD",
    "UNSHARD": "UNSHARD",
    "RESHARD": "RESHARD",
}
COMPUTE = tuple(k for k, op in OPCODE_OF.items() if BY_NAME[op].resource == COMPUTE_RES)
COMMS = tuple(k for k, op in OPCODE_OF.items() if BY_NAME[op].side is not None)
NO_MB = tuple(k for k, op in OPCODE_OF.items() if "mb" not in BY_NAME[op].operands)  # REDUCE_GRAD, UNSHARD, RESHARD
_TORCH_NAME = {op: k for k, op in reversed(OPCODE_OF.items())}  # the first name of each opcode


def torch_name(op: str, split: bool) -> str:
    """torch's action type for a pipec opcode: BWD is torch's `I` in a split schedule, its full backward
    `B` otherwise."""
    if op == "BWD":
        return "I" if split else "B"
    return _TORCH_NAME[op]
