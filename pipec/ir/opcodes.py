"""The Program's instruction vocabulary: every opcode's meaning, declared once.

Each row says what an instruction is: its operands, which resource it runs on,
for a compute which op kind it executes (and so its cost and memory effect),
for a transfer which side of a message it is, which message it names and where
its peer sits. Lowering, the dry run, the validator, the simulator, the list
scheduler, the executor, the overhead probe and the torch exporter and
importer read these rows (or the numpy columns derived from them below); none
restates a rule. Adding an opcode is a row here plus the code that executes it
(docs/program.md says the steps).

Message keys. A message is named by (what travels, micro-batch, sending
stage). An instruction on stage `s` names the sending stage `s + key_stage`
and has its peer on the rank that owns stage `s + peer_stage`: `SEND_ACT i s`
sends stage s's output to the owner of s + 1, where `RECV_ACT i s+1` receives
it, both naming the message (act, i, s).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipec.ir.graph import StageGraph, message_edge

# Resources an instruction runs on (the simulator gives each its own clock where they overlap).
COMPUTE_RES = "compute"
P2P_RES = "p2p"
LOCAL_RES = "local"
COLL_RES = "collective"  # data-parallel collectives: a stream of their own that overlaps compute
HOST_RES = "host"  # the rank's link to host memory (offload/reload of saved activations), overlapping compute

# What a message carries: index into MESSAGES; MESSAGE_NOUNS says it in words.
MESSAGES = ("act", "grad")
MESSAGE_NOUNS = ("activation", "gradient")
ACT_MSG, GRAD_MSG = 0, 1

# The op kinds of a Schedule, in its kind order (Schedule.kinds indexes these).
OP_KINDS = ("F", "B", "W")

# Group classes: a group binds an instruction to the next one, at most GROUP_MAX together.
GROUP_MAX = 2
OVERLAP = "overlap"  # two computes the runtime may interleave (DualPipe's F&B)
EXCHANGE = "exchange"  # a send and a receive with the same peer, issued as one batch_isend_irecv


@dataclass(frozen=True)
class Opcode:
    """One instruction kind.

    operands: the numbers the text form writes after the name, in order ("mb", "stage", "peer").
    resource: where it runs (compute, p2p, collective or local).
    kind: for a compute, the Schedule op kind it executes ("F", "B", "W"): that kind's cost and memory
        effect (an F holds `act` until its B; a split B holds `wact` until its W).
    side, message, key_stage, peer_stage: for a transfer, "send" or "recv", what travels, and the
        offsets from its stage to the message's sending stage and to the stage its peer owns.
    needs: for a compute, the message it consumes as (message, offset of the sending stage), received
        from a peer or handed over locally when both stages share the rank.
    sends: for a compute, the opcode that carries its output to the next stage in its direction.
    after: for a compute, the op kind on its own stage and micro-batch that must come first.
    group: the group class it may join, or None.
    cost: for an instruction on the compute resource that is not an op of the Schedule (RECOMPUTE), the op
        kind whose cost it takes.
    a2a: for a compute, the op kind whose all-to-alls it issues on a stage with MoE layers, each on the
        rank's expert link (a communication stream of its own, overlapping the other op of its pair)
        (`pipec.ir.experts.all_to_alls`: a forward dispatch and combine per layer, a backward their
        gradients), cutting it into compute segments; None: it issues none (WGRAD, RECOMPUTE: a
        recomputed forward with expert parallelism is refused, pipec.passes.experts).
    doc: one line for docs/program.md and `pipec compile` readers.
    """

    name: str
    operands: tuple[str, ...]
    resource: str
    doc: str
    kind: str | None = None
    side: str | None = None
    message: str | None = None
    key_stage: int = 0
    peer_stage: int = 0
    needs: tuple[str, int] | None = None
    sends: str | None = None
    after: str | None = None
    group: str | None = None
    cost: str | None = None
    a2a: str | None = None


TABLE: tuple[Opcode, ...] = (
    Opcode(
        "FWD",
        ("mb", "stage"),
        COMPUTE_RES,
        "forward of micro-batch i on stage s (the last stage also computes the loss)",
        kind="F",
        needs=("act", -1),
        sends="SEND_ACT",
        group=OVERLAP,
        a2a="F",
    ),
    Opcode(
        "BWD",
        ("mb", "stage"),
        COMPUTE_RES,
        "backward; the input gradient only when the schedule splits backward, else the full backward",
        kind="B",
        needs=("grad", +1),
        sends="SEND_GRAD",
        after="F",
        group=OVERLAP,
        a2a="B",
    ),
    Opcode(
        "WGRAD", ("mb", "stage"), COMPUTE_RES, "weight gradient of a split backward", kind="W", after="B", group=OVERLAP
    ),
    Opcode(
        "RECV_ACT",
        ("mb", "stage", "peer"),
        P2P_RES,
        "post the receive of stage s's input activation (s is the receiving stage)",
        side="recv",
        message="act",
        key_stage=-1,
        peer_stage=-1,
        group=EXCHANGE,
    ),
    Opcode(
        "SEND_ACT",
        ("mb", "stage", "peer"),
        P2P_RES,
        "send stage s's output activation (s is the sending stage)",
        side="send",
        message="act",
        key_stage=0,
        peer_stage=+1,
        group=EXCHANGE,
    ),
    Opcode(
        "RECV_GRAD",
        ("mb", "stage", "peer"),
        P2P_RES,
        "post the receive of the gradient of stage s's output (s is the receiving stage)",
        side="recv",
        message="grad",
        key_stage=+1,
        peer_stage=+1,
        group=EXCHANGE,
    ),
    Opcode(
        "SEND_GRAD",
        ("mb", "stage", "peer"),
        P2P_RES,
        "send the gradient of stage s's input (s is the sending stage)",
        side="send",
        message="grad",
        key_stage=0,
        peer_stage=-1,
        group=EXCHANGE,
    ),
    Opcode(
        "REDUCE_GRAD",
        ("stage",),
        COLL_RES,
        "start stage s's gradient reduction across its data-parallel replicas (all-reduce for ddp, "
        "reduce-scatter for fsdp), asynchronously; STEP s waits for it",
    ),
    Opcode("STEP", ("stage",), LOCAL_RES, "optimizer step of stage s (waits for its REDUCE_GRAD)"),
    Opcode(
        "UNSHARD",
        ("stage",),
        COLL_RES,
        "start the all-gather of stage s's sharded parameters (fsdp), asynchronously; stage s's next compute "
        "waits for it",
    ),
    Opcode("RESHARD", ("stage",), LOCAL_RES, "free stage s's gathered parameters, keeping its shard (fsdp)"),
    # Memory ops (docs/memory.md). A FWD whose (mb, stage) has a RECOMPUTE in the same stream keeps only its
    # input; the RECOMPUTE, after that FWD and before its BWD, runs the forward again to rebuild what BWD
    # needs. OFFLOAD moves a micro-batch's saved activations of a stage (what its FWD keeps) to host memory
    # after the FWD; RELOAD brings them back before the BWD, which waits for it. Both run on the host link.
    Opcode(
        "RECOMPUTE",
        ("mb", "stage"),
        COMPUTE_RES,
        "run micro-batch i's forward on stage s again, from the input its FWD kept, before its BWD",
        cost="F",
    ),
    Opcode(
        "OFFLOAD",
        ("mb", "stage"),
        HOST_RES,
        "start moving micro-batch i's saved activations of stage s to host memory, asynchronously",
    ),
    Opcode(
        "RELOAD",
        ("mb", "stage"),
        HOST_RES,
        "start moving micro-batch i's saved activations of stage s back from host memory; its BWD waits for it",
    ),
)

OPCODES: tuple[str, ...] = tuple(o.name for o in TABLE)
CODE: dict[str, int] = {o.name: i for i, o in enumerate(TABLE)}
BY_NAME: dict[str, Opcode] = {o.name: o for o in TABLE}

(
    FWD,
    BWD,
    WGRAD,
    RECV_ACT,
    SEND_ACT,
    RECV_GRAD,
    SEND_GRAD,
    REDUCE_GRAD,
    STEP,
    UNSHARD,
    RESHARD,
    RECOMPUTE,
    OFFLOAD,
    RELOAD,
) = (CODE[n] for n in OPCODES)
MEMOPS = ("RECOMPUTE", "OFFLOAD", "RELOAD")  # the ops a schedule may place as `Schedule.memops`


def _column(f, dtype=np.int64) -> np.ndarray:
    return np.array([f(o) for o in TABLE], dtype=dtype)


# Columns indexed by opcode, so vectorised passes ask `IS_SEND[op]` of a whole rank at once.
IS_COMPUTE = _column(lambda o: o.kind is not None, bool)  # an op of the Schedule (F, B, W)
ON_COMPUTE = _column(lambda o: o.resource == COMPUTE_RES, bool)  # occupies the compute resource (RECOMPUTE too)
IS_HOST = _column(lambda o: o.resource == HOST_RES, bool)
IS_MEMOP = _column(lambda o: o.name in MEMOPS, bool)
COST_KIND = _column(lambda o: OP_KINDS.index(o.kind or o.cost) if (o.kind or o.cost) else -1)  # whose cost it takes
IS_SEND = _column(lambda o: o.side == "send", bool)
IS_RECV = _column(lambda o: o.side == "recv", bool)
IS_P2P = IS_SEND | IS_RECV
IS_COLLECTIVE = _column(lambda o: o.resource == COLL_RES, bool)
HAS_MB = _column(lambda o: "mb" in o.operands, bool)
HAS_PEER = _column(lambda o: "peer" in o.operands, bool)
KIND_OF = _column(lambda o: OP_KINDS.index(o.kind) if o.kind else -1)  # opcode -> Schedule kind, -1 if none
MSG_OF = _column(lambda o: MESSAGES.index(o.message) if o.message else -1)
KEY_STAGE = _column(lambda o: o.key_stage)
PEER_STAGE = _column(lambda o: o.peer_stage)
NEEDS_MSG = _column(lambda o: MESSAGES.index(o.needs[0]) if o.needs else -1)
NEEDS_STAGE = _column(lambda o: o.needs[1] if o.needs else 0)
GROUP_CLASS = tuple(o.group for o in TABLE)
A2A_KIND = _column(lambda o: OP_KINDS.index(o.a2a) if o.a2a else -1)  # whose all-to-alls it issues, -1: none

COMPUTE = tuple(CODE[n] for n in OPCODES if BY_NAME[n].kind is not None)
SENDS = tuple(CODE[n] for n in OPCODES if BY_NAME[n].side == "send")
RECVS = tuple(CODE[n] for n in OPCODES if BY_NAME[n].side == "recv")

# Schedule kind -> its compute opcode, and (per kind) the opcodes that carry its output and its input.
COMPUTE_OF_KIND = np.array([next(CODE[o.name] for o in TABLE if o.kind == k) for k in OP_KINDS], dtype=np.int64)
SEND_OF_KIND = np.array([CODE[s] if (s := BY_NAME[OPCODES[c]].sends) else -1 for c in COMPUTE_OF_KIND], dtype=np.int64)
RECV_OF_KIND = np.array(
    [
        next((CODE[o.name] for o in TABLE if o.side == "recv" and (o.message, o.key_stage) == op.needs), -1)
        if (op := BY_NAME[OPCODES[c]]).needs
        else -1
        for c in COMPUTE_OF_KIND
    ],
    dtype=np.int64,
)
HAS_SEND = np.array([BY_NAME[OPCODES[c]].sends is not None for c in COMPUTE_OF_KIND], dtype=bool)
# The message each kind's output is (sending stage = its own) and the offset of the stage that consumes it.
OUT_MSG = np.array([MSG_OF[s] if h else -1 for s, h in zip(SEND_OF_KIND, HAS_SEND)], dtype=np.int64)
OUT_PEER_STAGE = np.array([PEER_STAGE[s] if h else 0 for s, h in zip(SEND_OF_KIND, HAS_SEND)], dtype=np.int64)
IN_STAGE = np.array([NEEDS_STAGE[c] for c in COMPUTE_OF_KIND], dtype=np.int64)
IN_MSG = np.array([NEEDS_MSG[c] for c in COMPUTE_OF_KIND], dtype=np.int64)
# The kind whose output each message is (act: F, grad: B), and the kind each kind must follow on its stage.
PRODUCER_KIND = np.array([int(np.flatnonzero(OUT_MSG == k)[0]) for k in range(len(MESSAGES))], dtype=np.int64)
AFTER_KIND = np.array(
    [OP_KINDS.index(BY_NAME[OPCODES[c]].after or "F") if BY_NAME[OPCODES[c]].after else -1 for c in COMPUTE_OF_KIND],
    dtype=np.int64,
)


def message_key(
    op: np.ndarray,
    mb: np.ndarray,
    stage: np.ndarray,
    num_stages: int,
    m: int,
    other: np.ndarray | None = None,
    graph: StageGraph | None = None,
) -> np.ndarray:
    """Each transfer's message as one integer; -1 for the rest. On the chain (message * S + sending stage) *
    m + mb. On a stage graph (`other`: each transfer's stage at the other end, RankProgram.other) the key
    (message, micro-batch, edge): (message * E + edge id) * m + mb, E the graph's edge count; keys of both
    forms lie in 0 .. message_keys(...) - 1."""
    if graph is None:
        sender = stage + KEY_STAGE[op]
        return np.where(IS_P2P[op], (MSG_OF[op] * num_stages + sender) * m + mb, -1)
    edge = message_edge(graph, stage, np.maximum(other, 0))
    p2p = IS_P2P[op] & (edge >= 0)
    return np.where(p2p, (MSG_OF[op] * graph.num_edges + edge) * m + mb, -1)


def message_keys(num_stages: int, m: int, graph: StageGraph | None = None) -> int:
    """How many message keys there are (a table indexed by `message_key` has this length)."""
    return len(MESSAGES) * (num_stages if graph is None else graph.num_edges) * m


def peer_stage(op: np.ndarray, stage: np.ndarray) -> np.ndarray:
    """The stage at the other end of each transfer (its peer is that stage's owner)."""
    return stage + PEER_STAGE[op]


_CLASSES = sorted({g for g in GROUP_CLASS if g})
_GROUP_ID = np.array([_CLASSES.index(g) if g else -1 for g in GROUP_CLASS], dtype=np.int64)


def may_group(a: np.ndarray, b: np.ndarray, peer_a: np.ndarray, peer_b: np.ndarray) -> np.ndarray:
    """Whether each instruction a may bind the instruction b after it (the executor runs exactly these):
    two of one group class; for an exchange, a send and a receive with the same peer. Vectorised."""
    ga = _GROUP_ID[a]
    same = (ga >= 0) & (ga == _GROUP_ID[b])
    exchange = (peer_a == peer_b) & (IS_SEND[a] != IS_SEND[b])
    return same & np.where(ga == _CLASSES.index(EXCHANGE), exchange, True)
