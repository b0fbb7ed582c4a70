"""The partitioner's three inputs and outputs as files: the per-layer cost table, the rank description and
the partition file. One reader and one writer each; every malformed file is an E803 diagnostic, a partition
for another model E804, one for another number of stages E805, and a partition file that was edited (its
fingerprint is not that of its content) or whose layers do not cover the model exactly once, in order, E810.

The layer table (`pipec.runtime.profile.layers` writes it; JSON):

    {"format": "pipec-layer-costs", "version": 1,
     "model": {"path": "examples/uneven.py", "fingerprint": "<sha256>", "layers": ["embed", ...]},
     "microbatches": 8, "unit": "s",
     "layers": [{"name": "embed", "F": 1e-4, "B": 0.0, "W": 2e-4, "full_backward": 2e-4,
                 "act_bytes": 65536, "out_bytes": 32768, "param_bytes": 4096, "state_bytes": 0,
                 "params": [["weight", [64, 64]], ...]}, ...],
     "measured": {...how it was measured...}}

`F` is the layer's forward, `B` its input-gradient pass and `W` its weight-gradient pass (the split
backward), `full_backward` the two at once, all in seconds for one micro-batch; `act_bytes` what its forward
saves for the backward (one micro-batch), `out_bytes` the activation it hands on (the message when a stage
ends with it), `param_bytes` its parameters (their gradients are as large), `state_bytes` the optimizer's
state for them. `wact_bytes` (optional) is what its split backward keeps for W; the memory model's default
is half of `act_bytes`.

The model's fingerprint is the SHA-256 of its layers' names and parameter shapes (`fingerprint`): a
partition file names the layers it splits, and a file made for another model, or for the same model with
other shapes, is refused before any process starts.

Ranks (`--ranks`): `speed=1,1,0.5,0.5 mem=16GiB,16GiB,8GiB,8GiB` (a speed of 0.5 takes twice as long for
the same layers; `mem` the rank's memory limit in bytes, `-` for none), or a TOML file with `speed = [...]`
and `mem = [...]`. One value stands for every rank.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pipec.errors import PipecError, brief, brief_path, error

TABLE_FORMAT = "pipec-layer-costs"
PARTITION_FORMAT = "pipec-partition"
VERSION = 1  # the layer table's
PARTITION_VERSION = 2  # 2: the file's own `fingerprint` covers its split (version 1 files had only the model's)
WACT_SHARE = 0.5  # wact_bytes when a table does not give it: the memory model's default (pipec.sim.memory)
_TIMES = ("F", "B", "W", "full_backward")
_BYTES = ("act_bytes", "out_bytes", "param_bytes", "state_bytes")


def fingerprint(layers: Sequence[tuple[str, Sequence[tuple[str, Sequence[int]]]]]) -> str:
    """SHA-256 (hex) of the layers' names and their parameters' names and shapes, in order: the JSON text
    `[[layer, [[param, [d0, d1, ...]], ...]], ...]` without spaces. `pipec.runtime.model.partitioned` computes the
    same from the modules, so a table, a partition file and a model file can be told apart or matched."""
    doc = [[str(name), [[str(p), [int(d) for d in shape]] for p, shape in params]] for name, params in layers]
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class LayerTable:
    """Per-layer costs, in the model's order (see the module docstring); arrays of one value per layer."""

    names: tuple[str, ...]
    F: np.ndarray
    B: np.ndarray
    W: np.ndarray
    full_backward: np.ndarray
    act_bytes: np.ndarray
    wact_bytes: np.ndarray
    out_bytes: np.ndarray
    param_bytes: np.ndarray
    state_bytes: np.ndarray
    params: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...] = ()
    microbatches: int | None = None
    path: str | None = None
    measured: Mapping | None = None

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @property
    def fingerprint(self) -> str:
        return fingerprint(list(zip(self.names, self.params or [()] * len(self.names))))

    def to_json(self) -> dict:
        rows = []
        for i, name in enumerate(self.names):
            row = {"name": name}
            row.update({k: float(getattr(self, k)[i]) for k in _TIMES})
            row.update({k: int(getattr(self, k)[i]) for k in (*_BYTES, "wact_bytes")})
            row["params"] = [[p, list(shape)] for p, shape in (self.params[i] if self.params else ())]
            rows.append(row)
        doc = {"format": TABLE_FORMAT, "version": VERSION}
        doc["model"] = {"path": self.path, "fingerprint": self.fingerprint, "layers": list(self.names)}
        doc.update(microbatches=self.microbatches, unit="s", layers=rows)
        if self.measured:
            doc["measured"] = dict(self.measured)
        return doc


def make_table(rows: Sequence[Mapping], **kw: object) -> LayerTable:
    """A table from rows as the file holds them (missing times and bytes are 0; `full_backward` defaults to
    B + W, `wact_bytes` to half of `act_bytes`)."""

    def col(key: str, default=None) -> np.ndarray:
        vals = [r.get(key, default(r) if callable(default) else default) for r in rows]
        return np.asarray(vals, dtype=float)

    return LayerTable(
        names=tuple(str(r["name"]) for r in rows),
        F=col("F", 0.0),
        B=col("B", 0.0),
        W=col("W", 0.0),
        full_backward=col("full_backward", lambda r: r.get("B", 0.0) + r.get("W", 0.0)),
        act_bytes=col("act_bytes", 0),
        wact_bytes=col("wact_bytes", lambda r: WACT_SHARE * r.get("act_bytes", 0)),
        out_bytes=col("out_bytes", 0),
        param_bytes=col("param_bytes", 0),
        state_bytes=col("state_bytes", 0),
        params=tuple(tuple((str(p), tuple(int(d) for d in s)) for p, s in r.get("params", ())) for r in rows),
        **kw,
    )


def _load_json(path: str, what: str) -> object:
    from pipec.files import read_text

    try:
        text = read_text(path, what)
    except OSError as e:
        raise error("E803", f"cannot read {what} `{brief_path(path)}`: {e.strerror}") from None
    except UnicodeDecodeError:
        raise error("E803", f"{what} `{brief_path(path)}` is not UTF-8 text") from None
    try:
        doc = json.loads(text, parse_int=_int, parse_float=_finite, parse_constant=_constant)
    except (json.JSONDecodeError, ValueError) as e:
        raise error("E803", f"{what} `{brief_path(path)}` is not valid JSON: {brief(e, 200)}") from None
    except RecursionError:
        raise error("E803", f"{what} `{brief_path(path)}` nests its JSON too deeply") from None
    depth = _depth(doc)
    if depth > MAX_DEPTH:
        raise error(
            "E803",
            f"{what} `{brief_path(path)}` nests its JSON {depth} levels deep; the format has at most {MAX_DEPTH}",
        )
    return doc


# A number of either file: at most this many characters (a byte count or a shape has at most 20 digits;
# `1e400`'s infinity and a 5000-digit integer are damage, not sizes), and never NaN or infinite.
MAX_NUMBER_CHARS = 40
# How deep either file nests (a table's `measured` block included): its own layout is four levels deep.
MAX_DEPTH = 16


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"the number {brief(text)} is too long (at most {MAX_NUMBER_CHARS} characters)")
    return int(text)


def _finite(text: str) -> float:
    x = float(text)
    if len(text) > MAX_NUMBER_CHARS or not math.isfinite(x):
        raise ValueError(f"the number {brief(text)} is not a finite number of at most {MAX_NUMBER_CHARS} characters")
    return x


def _constant(text: str) -> float:
    raise ValueError(f"`{text}` is not a number a file may hold (numbers must be finite)")


def _depth(doc: object) -> int:
    """How deep a loaded document nests its lists and objects (iterative: json.loads took up to ~1000)."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, dict | list):
            deepest = max(deepest, d)
            todo.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return deepest


def _require(cond: bool, what: str, message: str) -> None:
    if not cond:
        raise error("E803", f"{what}: {message}")


def _head(doc: object, fmt: str, what: str, version: int = VERSION) -> Mapping:
    _require(isinstance(doc, Mapping), what, "expected a JSON object")
    _require(doc.get("format") == fmt, what, f"not a {fmt} file (its `format` is `{brief(doc.get('format'))}`)")
    got = doc.get("version")
    # `true` and `2.0` equal the version in Python, but are not what the writer writes
    ok = isinstance(got, int) and not isinstance(got, bool) and got == version
    _require(ok, what, f"version `{brief(json.dumps(got))}` is not supported (this pipec reads version {version})")
    return doc


MAX_MICROBATCHES = 10_000_000  # as a schedule's sizes (pipec/frontend/evaluate.py's MAX_SIZE)


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and 0 <= x <= 1e18


def read_table(path: str) -> LayerTable:
    """A layer table written by `pipec partition` or `pipec.runtime.profile.layers` (E803 when malformed)."""
    what = f"layer table `{brief_path(path)}`"
    doc = _head(_load_json(path, "layer table"), TABLE_FORMAT, what)
    rows = doc.get("layers")
    _require(isinstance(rows, list) and len(rows) > 0, what, "`layers` must be a non-empty list")
    seen = set()
    for i, row in enumerate(rows):
        _require(isinstance(row, Mapping) and isinstance(row.get("name"), str), what, f"layer {i} has no `name`")
        _require(row["name"] not in seen, what, f"layer name `{brief(row['name'])}` appears twice")
        seen.add(row["name"])
        for k in (*_TIMES, *_BYTES, "wact_bytes"):
            if k in row:
                _require(_number(row[k]), what, f"layer `{brief(row['name'])}`: `{k}` must be a number >= 0")
        params = row.get("params", [])
        ok = isinstance(params, list) and all(
            isinstance(p, list)
            and len(p) == 2
            and isinstance(p[0], str)
            and isinstance(p[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in p[1])
            for p in params
        )
        _require(ok, what, f"layer `{brief(row['name'])}`: `params` must be a list of [name, [dims...]]")
    m = doc.get("microbatches")
    ok = m is None or (isinstance(m, int) and not isinstance(m, bool) and 1 <= m <= MAX_MICROBATCHES)
    _require(ok, what, f"`microbatches` must be an integer from 1 to {MAX_MICROBATCHES:,}, got {brief(m)}")
    model = doc.get("model") if isinstance(doc.get("model"), Mapping) else {}
    table = make_table(rows, microbatches=m, path=model.get("path"), measured=doc.get("measured"))
    given = model.get("fingerprint")
    _require(given in (None, table.fingerprint), what, "its `fingerprint` is not that of its own layers (edited?)")
    return table


def write_json(path: str, doc: Mapping) -> None:
    from pipec.files import write_text

    write_text(path, json.dumps(doc, indent=1) + "\n")


# ---- ranks --------------------------------------------------------------------


@dataclass(frozen=True)
class Ranks:
    """Per-rank speed factors (1: the speed the table was measured at) and memory limits (bytes; NaN none)."""

    speed: tuple[float, ...] | None = None
    memory: tuple[float, ...] | None = None

    def speeds(self, R: int) -> np.ndarray:
        return _spread(self.speed, R, 1.0, "speed")

    def limits(self, R: int) -> np.ndarray:
        return _spread(self.memory, R, math.nan, "mem")


def _spread(vals: tuple[float, ...] | None, R: int, default: float, key: str) -> np.ndarray:
    if vals is None:
        return np.full(R, default)
    if len(vals) == 1:
        return np.full(R, vals[0])
    if len(vals) != R:
        raise error("E803", f"--ranks: `{key}` gives {len(vals)} values, but the schedule has {R} ranks")
    return np.asarray(vals, dtype=float)


def parse_ranks(text: str) -> Ranks:
    """`speed=1,1,0.5,0.5 mem=16GiB,...` or the path of a TOML file with `speed` and `mem` lists."""
    from pathlib import Path

    try:
        is_file = Path(text).is_file()
    except (OSError, ValueError):
        is_file = False
    if is_file:
        from pipec.files import read_text

        try:
            doc = tomllib.loads(read_text(text, "ranks file"))
        except OSError as e:
            raise error("E803", f"cannot read ranks file `{brief(text, 80)}`: {e.strerror}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, ValueError) as e:
            raise error("E803", f"ranks file `{brief(text, 80)}` is not valid TOML: {brief(e, 200)}") from None
        where = f"ranks file `{brief(text, 80)}`"
    else:
        doc = {}
        for item in text.split():
            key, sep, value = item.partition("=")
            if not sep or not value:
                raise error("E803", f"--ranks: expected KEY=V,V,... (speed=, mem=), got `{brief(item)}`")
            doc[key] = value.split(",")
        where = "--ranks"
    unknown = sorted(set(doc) - {"speed", "mem"})
    if unknown:
        raise error("E803", f"{where}: unknown key `{brief(unknown[0])}` (expected speed and mem)")
    out = {}
    for key, kind in (("speed", None), ("mem", "bytes")):
        if key not in doc:
            continue
        vals = doc[key] if isinstance(doc[key], list) else [doc[key]]
        parsed = []
        for v in vals:
            if kind is None:
                ok = _number(v) or (isinstance(v, str) and _float(v) is not None)
                x = float(v) if _number(v) else _float(v) if isinstance(v, str) else None
                if not ok or x is None or not x > 0:
                    raise error("E803", f"{where}: `speed` values must be numbers > 0, got `{brief(v)}`")
            elif v in ("-", "none"):
                x = math.nan
            else:
                from pipec.ir.units import quantity

                try:
                    x = quantity(v, "bytes", f"{where}: `mem`")
                except PipecError as e:
                    raise error("E803", e.diagnostics[0].message) from None
            parsed.append(x)
        if not parsed:
            raise error("E803", f"{where}: `{key}` is empty")
        out["speed" if key == "speed" else "memory"] = tuple(parsed)
    return Ranks(**out)


def _float(text: str) -> float | None:
    import re

    t = text.strip()
    if not re.fullmatch(r"\+?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?", t):
        return None
    x = float(t)
    return x if math.isfinite(x) else None


# ---- partition files ----------------------------------------------------------


def split_fingerprint(model_fingerprint: str, layers: Sequence[str], stages: Sequence[Sequence[str]]) -> str:
    """SHA-256 (hex) of what a partition file tells the run to build: the model's fingerprint, its layer names
    in order and each stage's layer names, as the JSON text `[model_fingerprint, [layer, ...], [[layer, ...],
    ...]]` without spaces. The file keeps it as its `fingerprint`, so a layer removed, moved or renamed by
    hand (with the model's fingerprint left as it was) is refused instead of training another model."""
    doc = [str(model_fingerprint), [str(x) for x in layers], [[str(x) for x in s] for s in stages]]
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class PartitionFile:
    """What `pipec run --partition` and the API need: the model's fingerprint and layers, the schedule, and
    each stage's layer names in stage order. `what` names the file in diagnostics."""

    fingerprint: str
    layers: tuple[str, ...]
    schedule: str
    params: Mapping[str, object]
    stages: tuple[tuple[str, ...], ...]
    doc: Mapping
    what: str = "the partition"

    def check_model(self, fp: str, layers: Sequence[str], model: str) -> None:
        """E810 when the file's layers do not cover the model's exactly once, in order, yet its fingerprint is
        the model's (the file was edited); E804 when the fingerprints differ (another model, or other shapes)."""
        wrong = coverage(self.layers, layers, model)
        if wrong is not None and fp == self.fingerprint:
            raise error(
                "E810",
                f"{self.what} does not split `{brief(model, 80)}` as written: {wrong}",
                notes=("its `model.fingerprint` is this model's, so the layer lists were edited by hand; "
                       "make the file again with `pipec partition`",),
            )  # fmt: skip
        if fp != self.fingerprint:
            same_names = tuple(layers) == self.layers
            why = (
                "the same layer names with other parameter shapes"
                if same_names
                else f"{len(layers)} layers ({', '.join(map(brief, layers[:4]))}{', ...' if len(layers) > 4 else ''})"
                f" where the file has {len(self.layers)} ({', '.join(map(brief, self.layers[:4]))}"
                f"{', ...' if len(self.layers) > 4 else ''})"
            )
            notes = (f"model fingerprint {fp[:16]}..., the file's {self.fingerprint[:16]}...",)
            raise error(
                "E804",
                f"{self.what} was made for another model: `{brief(model, 80)}` has {why}",
                notes=notes + ((wrong,) if wrong is not None else ()),
            )

    def check_fingerprint(self) -> None:
        """E810 unless the file's `fingerprint` is that of its model fingerprint, layers and stages."""
        if self.doc.get("fingerprint") != split_fingerprint(self.fingerprint, self.layers, self.stages):
            raise error(
                "E810",
                f"{self.what} was edited: its `fingerprint` is not that of its model, layers and stages "
                f"({len(self.layers)} layers in {len(self.stages)} stages)",
                notes=(
                    "a split changed by hand could train another model; make the file again with `pipec partition`",
                ),
            )

    def check_stages(self, num_stages: int, schedule: str) -> None:
        """E805 unless the schedule has as many stages as the file."""
        if num_stages != len(self.stages):
            raise error(
                "E805",
                f"the partition file splits the model into {len(self.stages)} stages, "
                f"but `{brief(schedule)}` has {num_stages}",
                notes=(f"it was made for {self.schedule} {_params_text(self.params)}",),
            )


def coverage(given: Sequence[str], layers: Sequence[str], model: str = "the model") -> str | None:
    """What keeps `given` (a partition's layers, stage after stage) from being `layers` (the model's, in
    order) exactly once each, in words; None when they are. The first problem found, in this order: a
    layer named twice, a name the model lacks (renamed or unknown), a layer of the model in no stage, two
    layers out of the model's order (swapped)."""
    given, layers = list(given), list(layers)
    if given == layers:
        return None
    seen: set[str] = set()
    for name in given:
        if name in seen:
            return f"layer `{brief(name)}` appears twice (a layer belongs to one stage, once)"
        seen.add(name)
    known = set(layers)
    unknown = [n for n in given if n not in known]
    if unknown:
        return f"layer `{brief(unknown[0])}` is not a layer of `{brief(model, 80)}` (renamed, or another model's?)"
    missing = [n for n in layers if n not in seen]
    if missing:
        return f"`{brief(model, 80)}`'s layer `{brief(missing[0])}` is in no stage (removed?)"
    at = {n: i for i, n in enumerate(layers)}
    for a, b in zip(given, given[1:]):
        if at[a] > at[b]:
            return f"layer `{brief(b)}` comes after `{brief(a)}`, but the model runs it before (swapped?)"
    return "its layers are not the model's, in order"  # not reached: same set, same length, in order


def _params_text(params: Mapping[str, object]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def partition_doc(
    table: LayerTable, schedule: str, params: Mapping[str, object], stages: Sequence[Sequence[str]], **extra
) -> dict:
    """The partition file's document (the one writer of the format)."""
    doc = {"format": PARTITION_FORMAT, "version": PARTITION_VERSION}
    doc["fingerprint"] = split_fingerprint(table.fingerprint, table.names, stages)
    doc["model"] = {"fingerprint": table.fingerprint, "layers": list(table.names), "path": table.path}
    doc["schedule"] = {"name": schedule, "params": dict(params)}
    doc["stages"] = [list(s) for s in stages]
    doc.update(extra)
    return doc


def read_partition(path: str, *, verify: bool = True) -> PartitionFile:
    """A partition file: E803 when it is not one (not JSON, wrong types), E810 when its stages do not hold
    its layers once each, in order, or (`verify`) its `fingerprint` is not that of its content. A caller with
    the model at hand passes verify=False, checks the model first (`check_model` says which layer is wrong),
    then `check_fingerprint`."""
    return parse_partition(_load_json(path, "partition file"), f"partition file `{brief_path(path)}`", verify=verify)


def _names(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(n, str) for n in x)


def parse_partition(doc: object, what: str = "the partition", *, verify: bool = True) -> PartitionFile:
    """A partition document already loaded (a dict), checked as `read_partition` checks a file."""
    if (
        isinstance(doc, Mapping)
        and doc.get("format") == PARTITION_FORMAT
        and type(doc.get("version")) is int
        and doc["version"] == 1
    ):
        raise error(
            "E803",
            f"{what}: version 1, written before a partition file's fingerprint covered its split",
            notes=("make it again with `pipec partition ... -o FILE`",),
        )
    doc = _head(doc, PARTITION_FORMAT, what, PARTITION_VERSION)
    model, sched, stages = doc.get("model"), doc.get("schedule"), doc.get("stages")
    _require(isinstance(model, Mapping), what, "no `model` object")
    fp, layers = model.get("fingerprint"), model.get("layers")
    _require(_sha256(fp), what, "`model.fingerprint` must be a SHA-256 in hex")
    _require(_names(layers) and len(layers) > 0, what, "`model.layers` must be a non-empty list of layer names")
    _require(isinstance(sched, Mapping) and isinstance(sched.get("name"), str), what, "no `schedule.name`")
    params = sched.get("params", {})
    _require(isinstance(params, Mapping), what, "`schedule.params` must be an object")
    _require(
        all(_scalar(v) for v in params.values()),
        what,
        "`schedule.params` values must be numbers, booleans or strings (a schedule's parameters)",
    )
    _require(
        isinstance(stages, list) and stages and all(_names(s) and s for s in stages),
        what,
        "`stages` must be a list of non-empty lists of layer names",
    )
    _require(_sha256(doc.get("fingerprint")), what, "`fingerprint` must be a SHA-256 in hex")
    dup = coverage(layers, list(dict.fromkeys(layers)))
    if dup is not None:
        raise error("E810", f"{what}: `model.layers`: {dup}")
    wrong = coverage([x for s in stages for x in s], layers, "its `model.layers`")
    if wrong is not None:
        raise error("E810", f"{what}: its stages must hold every layer of `model.layers` once, in order: {wrong}")
    part = PartitionFile(fp, tuple(layers), sched["name"], dict(params), tuple(tuple(s) for s in stages), doc, what)
    if verify:
        part.check_fingerprint()
    return part


def _scalar(x: object) -> bool:
    """A parameter's value: a bool, a finite number or a string (what the language's parameters hold)."""
    if isinstance(x, float):
        return math.isfinite(x)
    return isinstance(x, bool | int | str)


def _sha256(x: object) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)
