"""The Program: one instruction stream per rank, and its two versioned serialisations.

Instructions are numpy columns per rank (a million-op schedule lowers to
millions of instructions); `RankProgram.instructions()` gives readable
`Instr`s. `group[j]` binds instruction j to j + 1: a batched send/receive
exchange (one `batch_isend_irecv`) or an overlapped compute pair.

Message stages: SEND_ACT/SEND_GRAD name the sending (local) stage, RECV_ACT/
RECV_GRAD the receiving (local) stage; the runtime keys a message by
(kind, micro-batch, sending stage), so it never relies on arrival order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from pipec.errors import PipecError, Source, Span, error

FORMAT = "pipec-program"
VERSION = 1

OPCODES = ("FWD", "BWD", "WGRAD", "RECV_ACT", "SEND_ACT", "RECV_GRAD", "SEND_GRAD", "REDUCE_GRAD", "STEP")
FWD, BWD, WGRAD, RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD, REDUCE_GRAD, STEP = range(len(OPCODES))
COMPUTE = (FWD, BWD, WGRAD)
RECVS = (RECV_ACT, RECV_GRAD)
SENDS = (SEND_ACT, SEND_GRAD)
_CODE = {name: i for i, name in enumerate(OPCODES)}


@dataclass(frozen=True)
class Instr:
    op: str
    mb: int = -1  # -1 where it does not apply (REDUCE_GRAD, STEP)
    stage: int = -1
    peer: int = -1  # -1 for local instructions
    group: bool = False  # bound to the next instruction

    def __str__(self) -> str:
        parts = [self.op]
        if self.mb >= 0:
            parts.append(str(self.mb))
        parts.append(str(self.stage))
        if self.peer >= 0:
            parts.append(str(self.peer))
        return " ".join(parts) + (" &" if self.group else "")


@dataclass(frozen=True, eq=False)
class RankProgram:
    op: np.ndarray
    mb: np.ndarray
    stage: np.ndarray
    peer: np.ndarray
    group: np.ndarray

    def __len__(self) -> int:
        return len(self.op)

    def instructions(self) -> list[Instr]:
        cols = (self.op.tolist(), self.mb.tolist(), self.stage.tolist(), self.peer.tolist(), self.group.tolist())
        return [Instr(OPCODES[o], m, s, p, bool(g)) for o, m, s, p, g in zip(*cols)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankProgram):
            return NotImplemented
        return all(np.array_equal(getattr(self, f), getattr(other, f)) for f in ("op", "mb", "stage", "peer", "group"))

    @staticmethod
    def from_instructions(instrs: list[Instr]) -> RankProgram:
        return RankProgram(
            np.array([_CODE[i.op] for i in instrs], dtype=np.int64),
            np.array([i.mb for i in instrs], dtype=np.int64),
            np.array([i.stage for i in instrs], dtype=np.int64),
            np.array([i.peer for i in instrs], dtype=np.int64),
            np.array([i.group for i in instrs], dtype=bool),
        )


@dataclass(frozen=True, eq=False)
class Program:
    name: str
    params: tuple[tuple[str, object], ...]
    num_stages: int
    num_ranks: int
    num_microbatches: int
    split_backward: bool
    placement: tuple[int, ...]
    ranks: tuple[RankProgram, ...]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Program):
            return NotImplemented
        head = ("name", "params", "num_stages", "num_ranks", "num_microbatches", "split_backward", "placement")
        return all(getattr(self, f) == getattr(other, f) for f in head) and self.ranks == other.ranks

    @property
    def num_instructions(self) -> int:
        return sum(len(r) for r in self.ranks)


# ---- JSON -------------------------------------------------------------------


def _rows(rp: RankProgram):
    return zip(rp.op.tolist(), rp.mb.tolist(), rp.stage.tolist(), rp.peer.tolist(), rp.group.tolist())


def to_json(prog: Program) -> str:
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "schedule": prog.name,
        "params": dict(prog.params),
        "num_stages": prog.num_stages,
        "num_ranks": prog.num_ranks,
        "num_microbatches": prog.num_microbatches,
        "split_backward": prog.split_backward,
        "placement": list(prog.placement),
        "opcodes": list(OPCODES),
        "ranks": [
            {
                "rank": r,
                "columns": ["op", "mb", "stage", "peer", "group"],
                "instructions": [
                    list(row)
                    for row in zip(
                        rp.op.tolist(), rp.mb.tolist(), rp.stage.tolist(), rp.peer.tolist(), rp.group.tolist()
                    )
                ],
            }
            for r, rp in enumerate(prog.ranks)
        ],
    }
    return json.dumps(doc, separators=(",", ":"))


def from_json(text: str) -> Program:
    try:
        doc = json.loads(text)
        if doc.get("format") != FORMAT:
            raise error("E501", f"not a pipec program (format is {doc.get('format')!r})")
        if doc.get("version") != VERSION:
            raise error(
                "E501", f"program format version {doc.get('version')} is not supported (this pipec reads {VERSION})"
            )
        codes = [_CODE[name] for name in doc["opcodes"]]
        ranks = []
        for rank in doc["ranks"]:
            rows = np.array(rank["instructions"], dtype=np.int64).reshape(-1, 5)
            ranks.append(
                RankProgram(
                    np.array(codes, dtype=np.int64)[rows[:, 0]],
                    rows[:, 1].copy(),
                    rows[:, 2].copy(),
                    rows[:, 3].copy(),
                    rows[:, 4].astype(bool),
                )
            )
        return Program(
            name=doc["schedule"],
            params=tuple(doc["params"].items()),
            num_stages=doc["num_stages"],
            num_ranks=doc["num_ranks"],
            num_microbatches=doc["num_microbatches"],
            split_backward=doc["split_backward"],
            placement=tuple(doc["placement"]),
            ranks=tuple(ranks),
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise error("E501", f"malformed program JSON: {e}") from None


# ---- text -------------------------------------------------------------------


def to_text(prog: Program) -> str:
    lines = [
        f"{FORMAT} {VERSION}",
        f"schedule {json.dumps(prog.name)} {json.dumps(dict(prog.params))}",
        f"stages {prog.num_stages} ranks {prog.num_ranks} microbatches {prog.num_microbatches}"
        f" split {str(prog.split_backward).lower()}",
        "place " + " ".join(map(str, prog.placement)),
    ]
    for r, rp in enumerate(prog.ranks):
        lines.append(f"rank {r}")
        lines.extend(str(i) for i in rp.instructions())
    return "\n".join(lines) + "\n"


def from_text(text: str, path: str = "<program>") -> Program:
    """Read the text form; a malformed file is an E501 diagnostic at its line."""
    lines = [(n, ln.strip()) for n, ln in enumerate(text.splitlines(), 1) if ln.strip() and not ln.startswith("#")]
    source = Source(path, text)
    at = 0

    def fail(message: str) -> PipecError:
        n, ln = lines[at] if at < len(lines) else (len(text.splitlines()) or 1, "")
        return error("E501", message, Span(n, 1, n, len(ln) + 1), source)

    try:
        magic, version = lines[0][1].split()
        if magic != FORMAT:
            raise fail("not a pipec program (expected `pipec-program 1` on the first line)")
        if int(version) != VERSION:
            raise fail(f"program format version {version} is not supported (this pipec reads {VERSION})")
        at = 1
        head = lines[1][1]
        if not head.startswith("schedule "):
            raise ValueError("expected `schedule NAME {params}`")
        decoder = json.JSONDecoder()
        rest = head[len("schedule ") :]
        name, end = decoder.raw_decode(rest)
        params = list(decoder.raw_decode(rest[end:].strip())[0].items())
        at = 2
        f = lines[2][1].split()
        stages, ranks, mbs, split = int(f[1]), int(f[3]), int(f[5]), f[7] == "true"
        at = 3
        placement = tuple(int(x) for x in lines[3][1].split()[1:])
        progs: list[list[Instr]] = []
        for at in range(4, len(lines)):
            words = lines[at][1].split()
            if words[0] == "rank":
                if int(words[1]) != len(progs):
                    raise ValueError(f"expected rank {len(progs)}")
                progs.append([])
                continue
            group = words[-1] == "&"
            words = words[:-1] if group else words
            op, nums = words[0], [int(w) for w in words[1:]]
            if op not in _CODE:
                raise ValueError(f"unknown instruction `{op}`")
            arity = 1 if op in ("REDUCE_GRAD", "STEP") else 2 if op in ("FWD", "BWD", "WGRAD") else 3
            if len(nums) != arity:
                raise ValueError(f"`{op}` takes {arity} number(s)")
            nums = ([-1] if arity == 1 else []) + nums + [-1] * (3 - max(arity, 2))
            progs[-1].append(Instr(op, nums[0], nums[1], nums[2], group))
        at = len(lines)
        if len(progs) != ranks:
            raise ValueError(f"expected {ranks} ranks, found {len(progs)}")
        return Program(
            name,
            tuple(params),
            stages,
            ranks,
            mbs,
            split,
            placement,
            tuple(RankProgram.from_instructions(p) for p in progs),
        )
    except (IndexError, ValueError, json.JSONDecodeError, AttributeError) as e:
        raise fail(f"malformed program text: {e}") from None
