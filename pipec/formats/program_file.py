"""Program files: the two versioned serialisations of a `pipec.ir.program.Program` (JSON and text), their
readers and writers.

Both readers validate what they read (`pipec.ir.validate`), so nothing read from a file runs unproven:
E501 for a malformed file, E502 for one that breaks a rule of docs/program.md. The writers stream
(`write_json`, `write_text` to an open file), so a million-op Program is never held twice as one string;
their rows are laid out by numpy (`pipec.formats.rowtext`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO

import numpy as np

from pipec.errors import PipecError, Source, Span, brief, error
from pipec.formats import rowtext
from pipec.ir.experts import Experts
from pipec.ir.opcodes import BY_NAME, CODE, OPCODES
from pipec.ir.program import Instr, Program, RankProgram
from pipec.ir.schedule import Slicing
from pipec.ir.validate import validate

FORMAT = "pipec-program"
VERSION = 1


# ---- JSON -------------------------------------------------------------------

_COLUMNS = ["op", "mb", "stage", "peer", "group"]


def _json_chunks(prog: Program) -> Iterator[str]:
    head = {
        "format": FORMAT,
        "version": VERSION,
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
        yield ("," if r else "") + f'{{"rank":{r},"columns":{json.dumps(_COLUMNS, separators=(",", ":"))},'
        yield '"instructions":[' + _json_rows(rp) + "]}"
    yield "]}"


def _dp_head(prog: Program) -> dict[str, object]:
    """`dp` and `dp_kind` where they are not the defaults (1, "ddp"), and `slicing` where there is one, so a
    Program without data parallelism or slices is written byte for byte as before them; readers take their
    absence as the defaults."""
    out: dict[str, object] = {}
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
            raise error("E501", f"not a pipec program (format is {got!r})", source=Source(path, ""))
        if doc.get("version") != VERSION:
            raise error(
                "E501",
                f"program format version {doc.get('version')} is not supported (this pipec reads {VERSION})",
                source=Source(path, ""),
            )
        unknown = [name for name in doc["opcodes"] if name not in CODE]
        if unknown:
            raise ValueError(f"unknown instruction {unknown[0]!r}")
        codes = np.array([CODE[name] for name in doc["opcodes"]] + [-1], dtype=np.int64)
        ranks = []
        for rank in doc["ranks"]:
            if rank["columns"] != _COLUMNS:
                raise ValueError(f"columns must be {_COLUMNS}")
            rows = np.array(rank["instructions"], dtype=np.int64).reshape(-1, 5)
            opc = rows[:, 0]
            opc = np.where((opc >= 0) & (opc < len(codes) - 1), opc, len(codes) - 1)
            ranks.append(
                RankProgram(
                    codes[opc], rows[:, 1].copy(), rows[:, 2].copy(), rows[:, 3].copy(), rows[:, 4].astype(bool)
                )
            )
        if not isinstance(doc["placement"], list):
            raise ValueError(f"placement must be a list of ranks, got {type(doc['placement']).__name__}")
        prog = Program(
            name=str(doc["schedule"]),
            params=tuple(doc["params"].items()),
            num_stages=_size(doc["num_stages"], "num_stages"),
            num_ranks=_size(doc["num_ranks"], "num_ranks"),
            num_microbatches=_size(doc["num_microbatches"], "num_microbatches"),
            split_backward=bool(doc["split_backward"]),
            placement=tuple(doc["placement"]),
            ranks=tuple(ranks),
            dp=doc.get("dp", 1),
            dp_kind=doc.get("dp_kind", "ddp"),
            slicing=_slicing(doc.get("slicing"), _size(doc["num_microbatches"], "num_microbatches")),
            experts=_experts(doc.get("experts")),
            moe_layers=_moe_layers(doc.get("moe_layers")),
            forward_only=_flag(doc.get("forward_only", False), "forward_only"),
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, RecursionError) as e:
        raise error("E501", f"malformed program JSON: {e}", source=Source(path, "")) from None
    validate(prog, Source(path, ""))
    return prog


# ---- text -------------------------------------------------------------------


def _text_chunks(prog: Program) -> Iterator[str]:
    yield (
        f"{FORMAT} {VERSION}\n"
        f"schedule {json.dumps(prog.name)} {json.dumps(dict(prog.params))}\n"
        f"stages {prog.num_stages} ranks {prog.num_ranks} microbatches {prog.num_microbatches}"
        f" split {str(prog.split_backward).lower()}\n"
        "place "
        + " ".join(map(str, prog.placement))
        + "\n"
        + "".join(f"{k} {_head_value(v)}\n" for k, v in _dp_head(prog).items())
    )
    for r, rp in enumerate(prog.ranks):
        yield f"rank {r}\n" + _text_rows(rp)


def _json_rows(rp: RankProgram) -> str:
    """`[op,mb,stage,peer,group],...` for every instruction, as json.dumps writes them."""
    n = len(rp)
    if n == 0:
        return ""
    body = rowtext.join_rows(
        [
            rowtext.literal("[", n),
            rowtext.integers(rp.op),
            rowtext.integers(rp.mb, ","),
            rowtext.integers(rp.stage, ","),
            rowtext.integers(rp.peer, ","),
            rowtext.choice([",false],", ",true],"], rp.group.astype(np.int64)),
        ]
    )
    return body[:-1].decode()


def _text_rows(rp: RankProgram) -> str:
    """One line per instruction: the name, the operands the instruction table gives it, `&` if grouped."""
    n = len(rp)
    if n == 0:
        return ""
    op = np.clip(rp.op, 0, len(OPCODES) - 1)
    tokens = [rowtext.choice(OPCODES, op)]
    for name, col in (("mb", rp.mb), ("stage", rp.stage), ("peer", rp.peer)):
        mat, lengths = rowtext.integers(col, " ")
        tokens.append((mat, np.where(_HAS_OPERAND[name][op], lengths, 0)))
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
        if len(head_words) != 2:
            raise fail("not a pipec program (expected `pipec-program 1` on the first line)")
        magic, version = head_words
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
        if len(f) != 8 or f[0::2] != ["stages", "ranks", "microbatches", "split"] or f[7] not in ("true", "false"):
            raise ValueError("expected `stages S ranks R microbatches M split true|false`")
        stages, ranks = _size(int(f[1]), "stages"), _size(int(f[3]), "ranks")
        mbs, split = _size(int(f[5]), "microbatches"), f[7] == "true"
        at = 3
        words = lines[3][1].split()
        if words[0] != "place":
            raise ValueError("expected `place` and the rank of each stage")
        placement = tuple(int(x) for x in words[1:])
        # optional header lines `dp N`, `dp_kind K`, `slicing {...}`, `experts {...}`, `moe_layers [...]` (JSON),
        # `forward_only true`
        dp: dict[str, object] = {
            "dp": 1,
            "dp_kind": "ddp",
            "slicing": None,
            "experts": None,
            "moe_layers": None,
            "forward_only": "false",
        }
        body = 4
        while body < len(lines) and lines[body][1].split()[0] in dp:
            at = body
            words = lines[body][1].split(maxsplit=1)
            if len(words) != 2:
                raise ValueError(f"expected `{words[0]} VALUE`")
            if words[0] == "slicing":
                dp["slicing"] = _slicing(json.loads(words[1]), mbs)
            elif words[0] in ("experts", "moe_layers"):
                dp[words[0]] = json.loads(words[1])
            else:
                dp[words[0]] = int(words[1]) if words[0] == "dp" else words[1]
            body += 1
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
            nums = [int(w) for w in words[1:]]
            if len(nums) != len(operands):
                raise ValueError(f"`{op}` takes {len(operands)} number(s): {', '.join(operands)}")
            vals = [-1, -1, -1]
            for x, v in zip(operands, nums):
                vals[pick[x]] = v
            progs[-1].append(Instr(op, vals[0], vals[1], vals[2], group))
            line_of[-1].append(n)
        at = len(lines)  # the count of `rank` sections against `ranks`: validate's E502, as for JSON
        prog = Program(
            name,
            tuple(params),
            stages,
            ranks,
            mbs,
            split,
            placement,
            tuple(RankProgram.from_instructions(p) for p in progs),
            dp=dp["dp"],  # type: ignore[arg-type]  # checked by validate (E502)
            dp_kind=dp["dp_kind"],  # type: ignore[arg-type]
            slicing=dp["slicing"],  # type: ignore[arg-type]
            experts=_experts(dp["experts"]),
            moe_layers=_moe_layers(dp["moe_layers"]),
            forward_only=_flag(dp["forward_only"], "forward_only"),
        )
    except (IndexError, ValueError, json.JSONDecodeError, AttributeError, OverflowError) as e:
        raise fail(f"malformed program text: {e}") from None

    def locate(r: int, j: int) -> Span | None:
        """The instruction's line, or the `rank r` line for a problem of the whole rank."""
        if not 0 <= r < len(line_of):
            return None
        n = line_of[r][j] if 0 <= j < len(line_of[r]) else rank_line[r]
        return Span(n, 1, n, len(source.line(n)) + 1)

    validate(prog, source, locate)
    return prog


def is_program_text(text: str) -> bool:
    """Whether a file's text is a Program (either form) rather than a schedule."""
    head = text.lstrip()[:200]
    return head.startswith("{") and f'"{FORMAT}"' in head or head.startswith(FORMAT)


def parse_program(text: str, path: str = "<program>") -> Program:
    """A Program's text in either form (told apart by its first character), validated."""
    return from_json(text, path) if text.lstrip().startswith("{") else from_text(text, path)


def read_program(path: str) -> Program:
    """A Program file in either form, validated."""
    from pipec.files import read_text  # bounded, and refuses /dev/zero or a FIFO (E901)

    try:
        text = read_text(path, "program file")
    except (OSError, UnicodeDecodeError) as e:
        raise error("E000", f"cannot read {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    return parse_program(text, path)
