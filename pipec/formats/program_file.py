"""Program files: the two versioned serialisations of a `pipec.ir.program.Program` (JSON and text), their
readers and writers.

Both readers validate what they read (`pipec.ir.validate`), so nothing read from a file runs unproven:
E501 for a malformed file, E502 for one that breaks a rule of docs/program.md.

Two versions. A chain Program (`Program.graph is None`) is written as version 1, byte for byte as before
stage graphs; one with a stage graph (pipec.ir.graph) as version 2: the head carries its edges (`edges`),
and every rank its `other` column (the JSON form's sixth column; the text form's last operand of a
transfer, `SEND_ACT i s peer other`), the stage at the other end of each transfer's edge. Both readers
read both versions, and check a version 2 file's graph (`check_graph`) and columns before validating. A
Program carrying a buffer plan (`Program.buffers`, pipec.passes.bufferplan) is written as version 3: the
head's `buffers` (the JSON object of `pipec.formats.plan_file`; the text form's `buffers` line), `edges` and
the `other` column as version 2 where there is a graph, else as version 1; the readers prove the plan
(`pipec.passes.bufferplan.prove`, E502) after validating. A Program with an order family (`Program.family`)
is version 3 too, its head's `family` (`pipec.formats.family_field`, re-proven on reading). The writers stream
(`write_json`, `write_text` to an open file), so a million-op Program is never held twice as one string;
their rows are laid out by numpy (`pipec.formats.rowtext`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import PurePath
from typing import IO

import numpy as np

from pipec.errors import PipecError, Source, Span, brief, error
from pipec.formats import family_field, plan_file, rowtext
from pipec.ir.experts import Experts
from pipec.ir.graph import MAX_EDGES, StageGraph, check_graph
from pipec.ir.opcodes import BY_NAME, CODE, IS_P2P, OPCODES
from pipec.ir.program import Instr, Program, RankProgram
from pipec.ir.schedule import Slicing
from pipec.ir.validate import validate

FORMAT = "pipec-program"
VERSION = 1
# A Program with a stage graph is written as this version (a chain Program as VERSION, unchanged).
GRAPH_VERSION = 2
# The versions this reader reads (the writer writes VERSION, or GRAPH_VERSION for a graph). A file of another
# version is refused by name, never read as if it were one of these.
READS = (1, 2, 3)
# A Program carrying a buffer plan is written as this version, with a graph or without.
PLAN_VERSION = 3
# How every E501 of a file begins, so that a damaged file is never mistaken for a schedule with a syntax error.
NOT_A_PROGRAM = "this is not a valid Program file"


def _version_message(shown: object) -> str:
    reads = ", ".join(map(str, READS[:-1])) + f" and {READS[-1]}"
    return f"program format version {brief(shown)} is not supported (this pipec reads {reads})"


def _version_of(prog: Program) -> int:
    """The version a Program is written as: 3 with a buffer plan or an order family, else 2 with a stage
    graph, else 1."""
    if prog.buffers is not None or family_field.written(prog):
        return PLAN_VERSION
    return VERSION if prog.graph is None else GRAPH_VERSION


def _check_version(version: object, source: Source) -> None:
    """E501 unless the JSON form's `version` is an integer this reader reads: `true` and `1.0` equal 1 in
    Python but are not the writer's version, and a 5000-digit number is quoted by its ends only."""
    if isinstance(version, bool) or not isinstance(version, int) or version not in READS:
        raise error("E501", f"{NOT_A_PROGRAM}: {_version_message(json.dumps(version))}", source=source)


# A parameter's value is what the language's parameter types hold (int, float, bool, str: docs/language.md):
# never a list or object, which a damaged or hostile file could nest thousands deep for every later
# json.dumps (a worker's Program file, the sameness hash) to recurse through.
_INT64 = 2**63 - 1
_MAX_TEXT = 10_000


def _params(doc: object) -> tuple[tuple[str, object], ...]:
    """The `params` object as the Program's pairs; ValueError (E501) for a value that is no parameter's."""
    if not isinstance(doc, dict):
        raise ValueError(f"`params` must be an object of parameter values, got {type(doc).__name__}")
    for name, value in doc.items():
        ok = (
            isinstance(value, bool)
            or isinstance(value, int)
            and -_INT64 <= value <= _INT64
            or isinstance(value, float)
            and math.isfinite(value)
            or isinstance(value, str)
            and len(value) <= _MAX_TEXT
        )
        if not ok or len(name) > _MAX_TEXT:
            shown = type(value).__name__ if isinstance(value, dict | list) else brief(value)
            raise ValueError(
                f"parameter `{brief(name)}` must be an int within 64 bits, a finite float, a bool or a string"
                f" of up to {_MAX_TEXT:,} characters, got {shown}"
            )
    return tuple(doc.items())


def _placement(doc: object) -> tuple[int, ...]:
    """The rank of each stage; whether they fit the ranks is validate's (E502), their type is read here."""
    if not isinstance(doc, list) or any(isinstance(r, bool) or not isinstance(r, int) for r in doc):
        raise ValueError(f"placement must be a list of ranks, got {brief(json.dumps(doc))}")
    if any(not 0 <= r <= MAX_SIZE for r in doc):
        raise ValueError(f"placement's ranks must be integers from 0 to {MAX_SIZE:,}")
    return tuple(doc)


def _rows(doc: object, columns: list[str] | None = None) -> np.ndarray:
    """A rank's `instructions` as an (n, 5) int64 array (n, 6 with a stage graph's `other`); ValueError
    (E501) for rows that are not five (six) integers (numpy would cast `1.5` or `"1"` to an integer without
    a word) or beyond int64."""
    columns = columns or _COLUMNS
    if not isinstance(doc, list):
        raise ValueError(f"`instructions` must be a list of rows, got {type(doc).__name__}")
    if not doc:
        return np.zeros((0, len(columns)), dtype=np.int64)
    rows = np.array(doc)
    if rows.ndim != 2 or rows.shape[1] != len(columns) or rows.dtype.kind not in "iub":
        count = {5: "five", 6: "six"}[len(columns)]
        raise ValueError(f"each instruction must be a row of {count} integers [{', '.join(columns)}]")
    return rows.astype(np.int64)


def _graph(doc: object, num_stages: int) -> StageGraph:
    """A version 2 file's `edges` (a list of [from, to] stage pairs) as its StageGraph; ValueError (E501)
    when they are not pairs of stages or not a stage graph (`check_graph`: an edge out of range, going back
    or twice, a stage other than the last without outputs)."""
    pair = lambda e: (  # noqa: E731
        isinstance(e, list) and len(e) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in e)
    )
    if not isinstance(doc, list) or len(doc) > MAX_EDGES or not all(pair(e) for e in doc):
        raise ValueError(f"`edges` must be a list of up to {MAX_EDGES:,} [from, to] stage pairs")
    why = check_graph(num_stages, [(u, v) for u, v in doc])
    if why is not None:
        raise ValueError(f"`edges` is not a stage graph of {num_stages} stages: {why}")
    return StageGraph.of(num_stages, doc)


def _others(rank: int, code: np.ndarray, other: np.ndarray) -> np.ndarray:
    """A version 2 rank's `other` column, checked: -1 on every instruction but a transfer (ValueError,
    E501, naming the first other). Whether a transfer's `other` is an edge of the graph is validate's."""
    known = code >= 0
    wrong = known & ~IS_P2P[np.maximum(code, 0)] & (other != -1)
    if wrong.any():
        j = int(np.flatnonzero(wrong)[0])
        raise ValueError(
            f"rank {rank}, instruction #{j}: `other` is {int(other[j])} on {OPCODES[int(code[j])]}, which is not"
            " a transfer (only SEND_ACT, RECV_ACT, SEND_GRAD and RECV_GRAD name a stage at the other end)"
        )
    return other


def _operand(word: str) -> int:
    """An integer of the text form as the writer writes it: ASCII digits, an optional `-`, at most 18 digits
    (int() would take `1_0`, `+1`, Unicode digits and 5000-digit numbers)."""
    digits = word[1:] if word.startswith("-") else word
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
        raise ValueError(f"expected an integer of at most 18 digits, got `{brief(word)}`")
    return int(word)


# ---- JSON -------------------------------------------------------------------

_COLUMNS = ["op", "mb", "stage", "peer", "group"]
# A version 2 (stage graph) rank's columns: `other`, each transfer's stage at the other end of its edge.
_GRAPH_COLUMNS = [*_COLUMNS, "other"]


def _json_chunks(prog: Program) -> Iterator[str]:
    columns = json.dumps(_COLUMNS if prog.graph is None else _GRAPH_COLUMNS, separators=(",", ":"))
    head = {
        "format": FORMAT,
        "version": _version_of(prog),
        "schedule": prog.name,
        "params": dict(prog.params),
        "num_stages": prog.num_stages,
        "num_ranks": prog.num_ranks,
        "num_microbatches": prog.num_microbatches,
        "split_backward": prog.split_backward,
        "placement": list(prog.placement),
        **_dp_head(prog),
        "opcodes": list(OPCODES),
    }
    yield json.dumps(head, separators=(",", ":"))[:-1] + ',"ranks":['
    for r, rp in enumerate(prog.ranks):
        yield ("," if r else "") + f'{{"rank":{r},"columns":{columns},'
        yield '"instructions":[' + _json_rows(rp, prog.graph is not None) + "]}"
    yield "]}"


def _dp_head(prog: Program) -> dict[str, object]:
    """`edges` where there is a stage graph, `dp` and `dp_kind` where they are not the defaults (1, "ddp"),
    and `slicing` where there is one, so a Program without a graph, data parallelism or slices is written
    byte for byte as before them; readers take their absence as the defaults."""
    out: dict[str, object] = {}
    if prog.graph is not None:
        out["edges"] = prog.graph.to_json()
    if prog.dp != 1:
        out["dp"] = prog.dp
    if prog.dp_kind != "ddp":
        out["dp_kind"] = prog.dp_kind
    if prog.slicing is not None:
        out["slicing"] = prog.slicing.describe()
    if prog.experts != Experts():
        out["experts"] = {"size": prog.experts.size, "num": prog.experts.num}
    if prog.moe_layers:
        out["moe_layers"] = list(prog.moe_layers)
    if prog.forward_only:  # an evaluation pass: without it a reader would take its FWDs for a training step's
        out["forward_only"] = True
    if prog.buffers is not None:  # version 3
        out["buffers"] = plan_file.to_doc(prog.buffers)
    if family_field.written(prog):  # version 3
        out["family"] = family_field.to_doc(prog.family, prog.num_ranks)
    return out


def _flag(value: object, what: str) -> bool:
    """A header's true/false (JSON's booleans, or the text form's words); ValueError (E501) otherwise."""
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):
        return value == "true"
    raise ValueError(f"`{what}` must be true or false, got {str(value)[:40]!r}")


def _experts(doc: object) -> Experts:
    """The `experts` header (`{"size": N, "num": E}`) back as Experts; ValueError (E501) when malformed or
    out of range (E425's rule, said in the reader's words)."""
    if doc is None:
        return Experts()
    if not isinstance(doc, dict) or set(doc) != {"size", "num"}:
        raise ValueError("`experts` must hold size and num")
    try:
        return Experts(doc["size"], doc["num"])
    except PipecError as e:
        raise ValueError(e.diagnostics[0].message) from None


def _moe_layers(doc: object) -> tuple[int, ...]:
    """The `moe_layers` header (a list, one count per stage) as a tuple; whether it fits is validate's."""
    if doc is None:
        return ()
    if not isinstance(doc, list):
        raise ValueError("`moe_layers` must be a list with one MoE layer count per stage")
    return tuple(doc)


def _head_value(v: object) -> str:
    """A header line's value in the text form: a word, or the slicing's JSON object on one line."""
    if isinstance(v, bool):
        return str(v).lower()
    return json.dumps(v, separators=(",", ":")) if isinstance(v, dict | list) else str(v)


def _slicing(doc: object, units: int) -> Slicing | None:
    """The `slicing` header (JSON object, or the text form's `slicing {...}` line) back as a Slicing;
    ValueError (E501) when its fields are not integers of the right counts. Whether the slices cover their
    sequence is validate's (E502)."""
    if doc is None:
        return None
    if not isinstance(doc, dict) or set(doc) != {"slices", "seqlen", "tokens", "lengths"}:
        raise ValueError("`slicing` must hold slices, seqlen, tokens and lengths")
    n, seqlen = _size(doc["slices"], "slicing.slices"), _size(doc["seqlen"], "slicing.seqlen")
    tokens, lengths = doc["tokens"], doc["lengths"]
    if not isinstance(tokens, list) or not isinstance(lengths, list) or len(tokens) != n or units % n:
        raise ValueError(f"`slicing` needs {n} slice lengths and micro-batches in whole sequences")
    if len(lengths) != units // n:
        raise ValueError(f"`slicing.lengths` needs one length per sequence ({units // n})")
    return Slicing(
        units // n,
        n,
        seqlen,
        tuple(_size(t, "slicing.tokens") for t in tokens),
        tuple(_size(t, "slicing.lengths") for t in lengths),
    )


def _json_graph(doc: dict) -> StageGraph | None:
    """The stage graph of a JSON Program: version 2 must carry `edges`, version 1 must not, version 3 may."""
    if doc["version"] == PLAN_VERSION:
        return _graph(doc["edges"], _size(doc["num_stages"], "num_stages")) if "edges" in doc else None
    if doc["version"] == VERSION:
        if "edges" in doc:
            raise ValueError(f"`edges` (a stage graph) needs format version {GRAPH_VERSION}, not {VERSION}")
        return None
    if "edges" not in doc:
        raise ValueError(f"a version {GRAPH_VERSION} Program needs `edges`, its stage graph")
    return _graph(doc["edges"], _size(doc["num_stages"], "num_stages"))


def write_json(prog: Program, fh: IO[str]) -> None:
    """The JSON form, written rank by rank."""
    for chunk in _json_chunks(prog):
        fh.write(chunk)


def to_json(prog: Program) -> str:
    return "".join(_json_chunks(prog))


def from_json(text: str, path: str = "<program>") -> Program:
    """Read the JSON form and validate it; a malformed file is an E501 diagnostic, an invalid one E502."""
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise error(
                "E501", f"{NOT_A_PROGRAM}: not a pipec program (format is {brief(repr(got))})", source=Source(path, "")
            )
        _check_version(doc.get("version"), Source(path, ""))
        graph = _json_graph(doc)
        columns = _COLUMNS if graph is None else _GRAPH_COLUMNS
        unknown = [name for name in doc["opcodes"] if name not in CODE]
        if unknown:
            raise ValueError(f"unknown instruction {unknown[0]!r}")
        codes = np.array([CODE[name] for name in doc["opcodes"]] + [-1], dtype=np.int64)
        ranks = []
        for r, rank in enumerate(doc["ranks"]):
            if rank["columns"] != columns:
                version = f"a version {doc['version']} Program's " if graph is not None else ""
                raise ValueError(f"{version}columns must be {columns}")
            rows = _rows(rank["instructions"], columns)
            opc = rows[:, 0]
            opc = np.where((opc >= 0) & (opc < len(codes) - 1), opc, len(codes) - 1)
            other = None if graph is None else _others(r, codes[opc], rows[:, 5].copy())
            ranks.append(
                RankProgram(
                    codes[opc],
                    rows[:, 1].copy(),
                    rows[:, 2].copy(),
                    rows[:, 3].copy(),
                    rows[:, 4].astype(bool),
                    other,
                )
            )
        if not isinstance(doc["placement"], list):
            raise ValueError(f"placement must be a list of ranks, got {type(doc['placement']).__name__}")
        prog = Program(
            name=str(doc["schedule"]),
            params=_params(doc["params"]),
            num_stages=_size(doc["num_stages"], "num_stages"),
            num_ranks=_size(doc["num_ranks"], "num_ranks"),
            num_microbatches=_size(doc["num_microbatches"], "num_microbatches"),
            split_backward=bool(doc["split_backward"]),
            placement=_placement(doc["placement"]),
            ranks=tuple(ranks),
            dp=doc.get("dp", 1),
            dp_kind=doc.get("dp_kind", "ddp"),
            slicing=_slicing(doc.get("slicing"), _size(doc["num_microbatches"], "num_microbatches")),
            experts=_experts(doc.get("experts")),
            moe_layers=_moe_layers(doc.get("moe_layers")),
            forward_only=_flag(doc.get("forward_only", False), "forward_only"),
            graph=graph,
            buffers=_buffers(
                doc["version"], doc.get("buffers"), _size(doc["num_ranks"], "num_ranks"), doc.get("family")
            ),
            family=family_field.from_doc(doc["version"], doc.get("family"), doc["num_ranks"]),
        )
    except RecursionError:
        raise error(
            "E501", f"{NOT_A_PROGRAM}: malformed program JSON: it nests too deeply", source=Source(path, "")
        ) from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
        raise error(
            "E501", f"{NOT_A_PROGRAM}: malformed program JSON: {brief(e, 200)}", source=Source(path, "")
        ) from None
    validate(prog, Source(path, ""))
    _prove(prog, Source(path, ""))
    return prog


def _buffers(version: int, doc: object, num_ranks: int, family: object = None):
    """A file's `buffers` (version 3 only, and there required unless it has a `family`) as its BufferPlan;
    ValueError (E501) otherwise."""
    if version != PLAN_VERSION:
        if doc is not None:
            raise ValueError(f"`buffers` (a buffer plan) needs format version {PLAN_VERSION}, not {version}")
        return None
    if doc is None and family is None:
        raise ValueError(f"a version {PLAN_VERSION} Program needs `buffers`, its buffer plan, or `family`")
    if doc is None:
        return None
    return plan_file.from_doc(doc, num_ranks)


def _prove(prog: Program, source: Source) -> None:
    """A plan and a family read from a file hold for their Program, or E502 (pipec.passes.bufferplan,
    pipec.formats.family_field)."""
    family_field.prove(prog, source)
    if prog.buffers is not None:
        from pipec.passes.bufferplan import prove

        prove(prog, prog.buffers, source)


# ---- text -------------------------------------------------------------------


def _text_chunks(prog: Program) -> Iterator[str]:
    yield (
        f"{FORMAT} {_version_of(prog)}\n"
        f"schedule {json.dumps(prog.name)} {json.dumps(dict(prog.params))}\n"
        f"stages {prog.num_stages} ranks {prog.num_ranks} microbatches {prog.num_microbatches}"
        f" split {str(prog.split_backward).lower()}\n"
        "place "
        + " ".join(map(str, prog.placement))
        + "\n"
        + "".join(f"{k} {_head_value(v)}\n" for k, v in _dp_head(prog).items())
    )
    for r, rp in enumerate(prog.ranks):
        yield f"rank {r}\n" + _text_rows(rp, prog.graph is not None)


def _json_rows(rp: RankProgram, graph: bool = False) -> str:
    """`[op,mb,stage,peer,group],...` for every instruction, as json.dumps writes them; with a stage graph
    `[op,mb,stage,peer,group,other]`."""
    n = len(rp)
    if n == 0:
        return ""
    tokens = [
        rowtext.literal("[", n),
        rowtext.integers(rp.op),
        rowtext.integers(rp.mb, ","),
        rowtext.integers(rp.stage, ","),
        rowtext.integers(rp.peer, ","),
    ]
    if graph:
        tokens += [rowtext.choice([",false", ",true"], rp.group.astype(np.int64)), rowtext.integers(_other(rp), ",")]
        tokens.append(rowtext.literal("],", n))
    else:
        tokens.append(rowtext.choice([",false],", ",true],"], rp.group.astype(np.int64)))
    return rowtext.join_rows(tokens)[:-1].decode()


def _other(rp: RankProgram) -> np.ndarray:
    """A rank's `other` column as written: -1 on every instruction when the rank has none."""
    return rp.other if rp.other is not None else np.full(len(rp), -1, dtype=np.int64)


def _text_rows(rp: RankProgram, graph: bool = False) -> str:
    """One line per instruction: the name, the operands the instruction table gives it (with a stage graph,
    then a transfer's `other`), `&` if grouped."""
    n = len(rp)
    if n == 0:
        return ""
    op = np.clip(rp.op, 0, len(OPCODES) - 1)
    tokens = [rowtext.choice(OPCODES, op)]
    for name, col in (("mb", rp.mb), ("stage", rp.stage), ("peer", rp.peer)):
        mat, lengths = rowtext.integers(col, " ")
        tokens.append((mat, np.where(_HAS_OPERAND[name][op], lengths, 0)))
    if graph:  # version 2: a transfer's stage at the other end of its edge, after the peer
        mat, lengths = rowtext.integers(_other(rp), " ")
        tokens.append((mat, np.where(IS_P2P[op], lengths, 0)))
    tokens.append(rowtext.choice(["\n", " &\n"], rp.group.astype(np.int64)))
    return rowtext.join_rows(tokens).decode()


# Which opcodes write each operand; the text form writes them in this order (the table lists them so).
_HAS_OPERAND = {x: np.array([x in BY_NAME[name].operands for name in OPCODES]) for x in ("mb", "stage", "peer")}


def write_text(prog: Program, fh: IO[str]) -> None:
    """The text form, written rank by rank."""
    for chunk in _text_chunks(prog):
        fh.write(chunk)


# A Program's sizes, as the language bounds a schedule's (pipec/frontend/evaluate.py's MAX_SIZE): a
# 400-digit count is malformed (E501), and never reaches arithmetic or a message whole.
MAX_SIZE = 10_000_000


def _size(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
        raise ValueError(f"`{what}` must be an integer from 1 to {MAX_SIZE:,}, got {brief(value)}")
    return value


def to_text(prog: Program) -> str:
    return "".join(_text_chunks(prog))


def from_text(text: str, path: str = "<program>") -> Program:
    """Read the text form and validate it; a malformed file is an E501 diagnostic at its line, an
    invalid one E502 at the line of the first problem."""
    # Lines as Source counts them: "\n" ends a line (a CRLF line loses its "\r"), nothing else does.
    raw = [ln.removesuffix("\r") for ln in text.split("\n")]
    lines = [(n, ln.strip()) for n, ln in enumerate(raw, 1) if ln.strip() and not ln.lstrip().startswith("#")]
    source = Source(path, text)
    at = 0

    def fail(message: str) -> PipecError:
        n, ln = lines[at] if at < len(lines) else (len(raw), "")
        return error("E501", message, Span(n, 1, n, len(ln) + 1), source)

    pick = {"mb": 0, "stage": 1, "peer": 2}
    line_of: list[list[int]] = []  # per rank, the line of each instruction
    rank_line: list[int] = []
    try:
        head_words = lines[0][1].split()
        if len(head_words) != 2 or head_words[0] != FORMAT:
            raise fail(f"{NOT_A_PROGRAM}: not a pipec program (expected `{FORMAT} {VERSION}` on the first line)")
        if head_words[1] not in map(str, READS):  # the writer's digits exactly: not `01`, `+1` or `1_0`
            raise fail(f"{NOT_A_PROGRAM}: {_version_message(head_words[1])}")
        version = int(head_words[1])
        at = 1
        head = lines[1][1]
        if not head.startswith("schedule "):
            raise ValueError("expected `schedule NAME {params}`")
        decoder = json.JSONDecoder()
        rest = head[len("schedule ") :]
        name, end = decoder.raw_decode(rest)
        if not isinstance(name, str):
            raise ValueError("the schedule's name must be a string")
        params = _params(decoder.raw_decode(rest[end:].strip())[0])
        at = 2
        f = lines[2][1].split()
        if len(f) != 8 or f[0::2] != ["stages", "ranks", "microbatches", "split"] or f[7] not in ("true", "false"):
            raise ValueError("expected `stages S ranks R microbatches M split true|false`")
        stages, ranks = _size(int(f[1]), "stages"), _size(int(f[3]), "ranks")
        mbs, split = _size(int(f[5]), "microbatches"), f[7] == "true"
        at = 3
        words = lines[3][1].split()
        if words[0] != "place":
            raise ValueError("expected `place` and the rank of each stage")
        placement = _placement([int(x) for x in words[1:]])
        # optional header lines `edges [[u,v],...]` (version 2 only, and there required), `dp N`, `dp_kind K`,
        # `slicing {...}`, `experts {...}`, `moe_layers [...]` (JSON), `forward_only true`
        dp: dict[str, object] = {
            "edges": None,
            "dp": 1,
            "dp_kind": "ddp",
            "slicing": None,
            "experts": None,
            "moe_layers": None,
            "forward_only": "false",
            "buffers": None,
            "family": None,
        }
        body = 4
        while body < len(lines) and lines[body][1].split()[0] in dp:
            at = body
            words = lines[body][1].split(maxsplit=1)
            if len(words) != 2:
                raise ValueError(f"expected `{words[0]} VALUE`")
            if words[0] == "edges":
                if version == VERSION:
                    raise ValueError(f"`edges` (a stage graph) needs format version {GRAPH_VERSION}, not {VERSION}")
                dp["edges"] = _graph(json.loads(words[1]), stages)
            elif words[0] == "slicing":
                dp["slicing"] = _slicing(json.loads(words[1]), mbs)
            elif words[0] == "family":  # read here, so that a bad one is E501 at its line
                dp["family"] = family_field.from_doc(version, json.loads(words[1]), ranks)
            elif words[0] in ("experts", "moe_layers", "buffers"):
                dp[words[0]] = json.loads(words[1])
            else:
                dp[words[0]] = _operand(words[1]) if words[0] == "dp" else words[1]
            body += 1
        graph = dp["edges"]
        if version == GRAPH_VERSION and graph is None:
            at = min(body, len(lines) - 1)
            raise ValueError(
                f"a version {GRAPH_VERSION} Program needs an `edges [[from, to], ...]` line, its stage graph"
            )
        progs: list[list[Instr]] = []
        for at in range(body, len(lines)):
            n, line = lines[at]
            words = line.split()
            if words[0] == "rank":
                if len(words) != 2 or int(words[1]) != len(progs):
                    raise ValueError(f"expected `rank {len(progs)}`")
                progs.append([])
                line_of.append([])
                rank_line.append(n)
                continue
            if not progs:
                raise ValueError("an instruction before the first `rank` line")
            group = words[-1] == "&"
            words = words[:-1] if group else words
            op = words[0]
            if op not in CODE:
                raise ValueError(f"unknown instruction `{op}`")
            operands = BY_NAME[op].operands
            nums = [_operand(w) for w in words[1:]]
            transfer = graph is not None and bool(IS_P2P[CODE[op]])
            if len(nums) != len(operands) + transfer:
                if graph is not None and not transfer and len(nums) == len(operands) + 1:
                    raise ValueError(
                        f"`{op}` is not a transfer: it names no stage at the other end (`other`), only"
                        f" {len(operands)} number(s): {', '.join(operands)}"
                    )
                names = (*operands, "other") if transfer else operands
                raise ValueError(f"`{op}` takes {len(names)} number(s): {', '.join(names)}")
            vals = [-1, -1, -1]
            for x, v in zip(operands, nums):
                vals[pick[x]] = v
            progs[-1].append(Instr(op, vals[0], vals[1], vals[2], group, nums[-1] if transfer else -1))
            line_of[-1].append(n)
        at = len(lines)  # the count of `rank` sections against `ranks`: validate's E502, as for JSON
        prog = Program(
            name,
            params,
            stages,
            ranks,
            mbs,
            split,
            placement,
            tuple(_text_rank(p, graph is not None) for p in progs),
            dp=dp["dp"],  # type: ignore[arg-type]  # checked by validate (E502)
            dp_kind=dp["dp_kind"],  # type: ignore[arg-type]
            slicing=dp["slicing"],  # type: ignore[arg-type]
            experts=_experts(dp["experts"]),
            moe_layers=_moe_layers(dp["moe_layers"]),
            forward_only=_flag(dp["forward_only"], "forward_only"),
            graph=graph,  # type: ignore[arg-type]
            buffers=_buffers(version, dp["buffers"], ranks, dp["family"]),
            family=dp["family"],  # type: ignore[arg-type]
        )
    except RecursionError:
        raise fail(f"{NOT_A_PROGRAM}: malformed program text: its JSON values nest too deeply") from None
    except (IndexError, KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise fail(f"{NOT_A_PROGRAM}: malformed program text: {brief(e, 200)}") from None

    def locate(r: int, j: int) -> Span | None:
        """The instruction's line, or the `rank r` line for a problem of the whole rank."""
        if not 0 <= r < len(line_of):
            return None
        n = line_of[r][j] if 0 <= j < len(line_of[r]) else rank_line[r]
        return Span(n, 1, n, len(source.line(n)) + 1)

    validate(prog, source, locate)
    _prove(prog, source)
    return prog


def _text_rank(instrs: list[Instr], graph: bool) -> RankProgram:
    """A rank of the text form: with a stage graph its `other` column always (-1 off the transfers), as the
    JSON form and the lowering hold it."""
    rp = RankProgram.from_instructions(instrs)
    if not graph:
        return rp
    other = np.array([i.other for i in instrs], dtype=np.int64)
    return RankProgram(rp.op, rp.mb, rp.stage, rp.peer, rp.group, other)


def _suffix(path: str | None) -> str:
    return PurePath(path).suffix.lower() if path else ""


def is_program_text(text: str, path: str | None = None) -> bool:
    """Whether a file's text is a Program (either form) rather than a schedule: it begins with the text
    form's header, or looks like JSON (its first non-blank character `{` or `[`: no schedule, .pipe or
    torch CSV, begins so), or is named `.json`. A damaged Program is then reported as one (E501), never
    parsed as schedule source ("unexpected `{`; expected `schedule`"). A `.pipe` or `.csv` file is a
    schedule unless it holds a Program's header."""
    head = text.lstrip()[:200]
    if head.startswith(FORMAT) or head.startswith("{") and f'"{FORMAT}"' in head:
        return True
    if _suffix(path) in (".pipe", ".csv"):
        return False
    return head[:1] in ("{", "[") or _suffix(path) == ".json"


def parse_program(text: str, path: str = "<program>") -> Program:
    """A Program's text in either form, validated: the text form when it begins with its header, else JSON
    when it looks like JSON or is named `.json`, else the text form (whose reader names what it expected)."""
    head = text.lstrip()
    if not head.startswith(FORMAT) and (head[:1] in ("{", "[") or _suffix(path) == ".json"):
        return from_json(text, path)
    return from_text(text, path)


def read_program(path: str) -> Program:
    """A Program file in either form, validated."""
    from pipec.files import read_text  # bounded, and refuses /dev/zero or a FIFO (E901)

    try:
        text = read_text(path, "program file")
    except (OSError, UnicodeDecodeError) as e:
        raise error("E000", f"cannot read {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    return parse_program(text, path)
