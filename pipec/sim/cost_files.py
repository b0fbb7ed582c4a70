"""Cost files and overrides: reading and writing what `pipec.sim.costs.cost_model` takes.

A cost document is a mapping of the keys `pipec.sim.costs` describes (per-stage lists or one number,
links, data-parallel and host settings). It comes from a cost file (TOML or JSON, `read_cost_file`),
`--cost` overrides (`F=1,B=2,latency=40ms`, `parse_overrides`), either of those (`cost_spec`), or a
mapping given to the API (`normalize`); `dump_costs` writes one (what `pipec profile` writes). Every
quantity may carry a unit of `pipec.ir.units` ("40ms", "10Gbps", "16MiB").
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pipec.errors import brief, brief_path, error
from pipec.ir.schedule import STAGE_COST_KEYS
from pipec.ir.units import quantity
from pipec.sim.topology_links import LINK_CLASSES

if TYPE_CHECKING:
    from pipec.sim.timeline import Timeline

FORMAT = "pipec-costs"
# Version 2 (what `dump_costs` writes, so every `pipec profile` file) declares what it holds, so that a
# reader tells a whole file from a cut one: `keys`, the names of its top-level entries; `stages`, the
# length of every per-stage list; and last, the `[end]` table with `keys` = their count, which a
# truncated file lacks wherever it was cut. Version 1 and files without a version (hand-written) are read
# as they are.
VERSION = 2
VERSIONS = (1, 2)
_SEAL = ("stages", "keys", "end")  # what dump_costs adds to declare a whole file
_META = ("format", "version", "comment", "unit", "measured", "schedule", "params", "stages", "keys", "end")
# A number as --cost takes it: ASCII digits only (float() would also take `1_0` and Arabic-Indic digits).
_NUMBER = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?(?:inf|nan)", re.IGNORECASE)
_KEY_KIND = {"F": "time", "B": "time", "W": "time", "comm": "time", "act_bytes": "bytes", "grad_bytes": "bytes"}
_KEY_KIND.update({"param_bytes": "bytes", "reduce_grad": "time", "unshard": "time", "step": "time"})
_KEY_KIND.update({k: "bytes" for k in ("saved_bytes", "wsaved_bytes", "input_bytes", "state_bytes")})
_KEY_KIND["offload"] = "time"
_KEY_KIND.update({"attn": "number", "op_fixed": "time"})
_KEY_KIND.update({"moe_layers": "number", "a2a": "time", "a2a_bytes": "bytes"})

# ---- reading overrides --------------------------------------------------------


def _per_stage(value: object, kind: str, what: str):
    if isinstance(value, list | tuple):
        if not value:
            raise error("E801", f"{what}: an empty list")
        return [quantity(v, kind, f"{what}[{i}]") for i, v in enumerate(value)]
    return quantity(value, kind, what)


def _link(value: object, what: str) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise error("E801", f"{what}: expected a table with `latency` and/or `bandwidth`")
    out = {}
    for k, v in value.items():
        if k == "latency":
            out["latency"] = quantity(v, "time", f"{what}.latency")
        elif k == "bandwidth":
            out["bandwidth"] = quantity(v, "bandwidth", f"{what}.bandwidth")
        else:
            raise error("E801", f"{what}: unknown key `{k}` (expected latency, bandwidth)")
    return out


def normalize(doc: Mapping, what: str = "costs") -> dict:
    """Check a cost document (from a file or `--cost`) and convert its quantities; unknown keys are errors."""
    out: dict = {}
    links: dict[str, dict[str, float]] = {}
    version = doc.get("version")
    if "version" in doc and (type(version) is not int or version not in VERSIONS):  # not 1.0, "2" or true
        shown = repr(version) if isinstance(version, str) else str(version).lower() if version is not None else "null"
        raise error(
            "E801",
            f"{what}: cost file version {brief(shown)} is not supported (this pipec reads "
            f"{', '.join(map(str, VERSIONS))})",
        )
    if version == 2:
        _check_whole(doc, what)
    for key, value in doc.items():
        if key in _META:
            if key == "format" and value != FORMAT:
                raise error("E801", f"{what}: format is `{brief(value)}`, expected `{FORMAT}`")
            if key == "unit" and value not in ("s", "seconds"):
                raise error("E801", f'{what}: times must be in seconds (`unit = "s"`), got `{brief(value)}`')
            continue
        if key in _KEY_KIND:
            out[key] = _per_stage(value, _KEY_KIND[key], f"{what}: {key}")
        elif key in ("T_F", "T_B", "T_W"):
            if key[2:] in doc:
                raise error("E801", f"{what}: give `{key[2:]}` (per stage) or `{key}` (per rank), not both")
            out[key] = quantity(value, "time", f"{what}: {key}")
        elif key == "bytes":  # both directions across each boundary
            out["act_bytes"] = _per_stage(value, "bytes", f"{what}: bytes")
        elif key == "overhead":
            out["overhead"] = quantity(value, "time", f"{what}: overhead")
        elif key in ("step_overhead", "pair_handoff"):
            out[key] = quantity(value, "time", f"{what}: {key}")
        elif key == "dp_blocking":
            if value not in (0, 1) or not isinstance(value, bool | int | float):
                raise error("E801", f"{what}: dp_blocking must be 0 or 1 (or a boolean), got `{brief(value)}`")
            out["dp_blocking"] = bool(value)
        elif key == "host_latency":
            out["host_latency"] = quantity(value, "time", f"{what}: host_latency")
        elif key == "host_bandwidth":
            out["host_bandwidth"] = quantity(value, "bandwidth", f"{what}: host_bandwidth")
        elif key == "dp_latency":
            out["dp_latency"] = quantity(value, "time", f"{what}: dp_latency")
        elif key == "dp_bandwidth":
            out["dp_bandwidth"] = quantity(value, "bandwidth", f"{what}: dp_bandwidth")
        elif key == "ep_latency":
            out["ep_latency"] = quantity(value, "time", f"{what}: ep_latency")
        elif key == "ep_bandwidth":
            out["ep_bandwidth"] = quantity(value, "bandwidth", f"{what}: ep_bandwidth")
        elif key == "latency":
            for c in LINK_CLASSES:
                links.setdefault(c, {})["latency"] = quantity(value, "time", f"{what}: latency")
        elif key == "bandwidth":
            for c in LINK_CLASSES:
                links.setdefault(c, {})["bandwidth"] = quantity(value, "bandwidth", f"{what}: bandwidth")
        elif key.startswith(("latency.", "bandwidth.")):
            attr, cls = key.split(".", 1)
            if cls not in LINK_CLASSES:
                raise error("E801", f"{what}: unknown link class `{cls}` (known: {', '.join(LINK_CLASSES)})")
            kind = "time" if attr == "latency" else "bandwidth"
            links.setdefault(cls, {})[attr] = quantity(value, kind, f"{what}: {key}")
        elif key == "links":
            if not isinstance(value, Mapping):
                raise error("E801", f"{what}: `links` must be a table of link classes")
            for cls, spec in value.items():
                if cls not in LINK_CLASSES:
                    raise error("E801", f"{what}: unknown link class `{cls}` (known: {', '.join(LINK_CLASSES)})")
                links.setdefault(cls, {}).update(_link(spec, f"{what}: links.{cls}"))
        elif key in ("ranks_per_node", "cores_per_node"):
            whole = isinstance(value, float) and value.is_integer()  # `--cost ranks_per_node=4` reads 4.0
            if isinstance(value, bool) or not isinstance(value, int) and not whole or not 1 <= value <= 10_000_000:
                raise error("E801", f"{what}: {key} must be a positive integer, got `{brief(value)}`")
            out[key] = int(value)
        else:
            known = ", ".join(
                STAGE_COST_KEYS
                + ("T_F", "T_B", "T_W", "bytes", "overhead", "latency", "bandwidth", "links", "ranks_per_node")
                + ("cores_per_node",)
                + ("dp_latency", "dp_bandwidth", "step_overhead", "dp_blocking", "host_latency", "host_bandwidth")
                + ("ep_latency", "ep_bandwidth", "pair_handoff")
            )
            raise error("E801", f"{what}: unknown cost `{brief(key)}` (known: {known})")
    if links:
        out["links"] = links
    out["_from"] = what
    return out


def _check_whole(doc: Mapping, what: str) -> None:
    """A version-2 document holds every entry its `keys` name, per-stage lists of `stages` values, and the
    `end` marker counting its keys; a file cut short lacks the marker (it comes last) and what followed."""
    keys = doc.get("keys")
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise error("E801", f"{what}: a version 2 cost file lists its entries in `keys`, and this one does not")
    missing = [k for k in keys if k not in doc]
    end = doc.get("end")
    ended = isinstance(end, Mapping) and end.get("keys") == len(keys) and not isinstance(end.get("keys"), bool)
    if missing or not ended:
        lacks = ", ".join(f"`{brief(k)}`" for k in missing[:12]) + (", ..." if len(missing) > 12 else "")
        parts = ([f"the entries {lacks}"] if missing else []) + ([] if ended else ["the `[end]` marker"])
        raise error(
            "E801",
            f"{what} is incomplete (truncated?): it lacks {' and '.join(parts)}",
            notes=(f"it declares {len(keys)} entries: {', '.join(map(brief, keys[:20]))}",),
        )
    stages = doc.get("stages")
    if stages is None:
        return
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= 10_000_000:
        raise error("E801", f"{what}: `stages` must be a positive integer, got `{brief(stages)}`")
    for k in STAGE_COST_KEYS:
        v = doc.get(k)
        if isinstance(v, list) and len(v) != stages:
            raise error("E801", f"{what}: `{k}` lists {len(v)} values but the file declares {stages} stages")


def parse_overrides(text: str) -> dict:
    """`F=1,B=2,W=1` (also `latency=40ms`, `bandwidth.cross=10Gbps`, `act_bytes=16MiB`) as a cost document."""
    doc: dict = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise error("E801", f"--cost: expected KEY=VALUE, got `{brief(item)}`")
        value = value.strip()
        doc[key.strip()] = float(value) if _NUMBER.fullmatch(value) else value
    if not doc:
        raise error("E801", "--cost: nothing given")
    return normalize(doc, "--cost")


def read_cost_file(path: str | Path) -> dict:
    """A cost file: TOML (`.toml`) or JSON (anything else); see docs/simulate.md for the keys."""
    from pipec.files import read_text

    path = Path(path)
    try:
        text = read_text(path, "cost file")
    except OSError as e:
        raise error("E801", f"cannot read cost file `{brief_path(path)}`: {e.strerror}") from None
    except UnicodeDecodeError:
        raise error("E801", f"cost file `{path}` is not UTF-8 text") from None
    if not text.strip():  # 0 bytes (or blanks): never the defaults in disguise
        raise error("E801", f"cost file `{path}` is empty")
    kind = "TOML" if path.suffix == ".toml" else "JSON"
    try:
        doc = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, ValueError) as e:  # ValueError: int digits limit
        raise error("E801", f"cost file `{path}` is not valid {kind}: {brief(e, 200)}") from None
    except RecursionError:
        raise error("E801", f"cost file `{path}` nests its {kind} too deeply") from None
    if not isinstance(doc, Mapping):
        raise error("E801", f"cost file `{path}` must hold a table of costs")
    return normalize(doc, str(path))


def cost_spec(text: str) -> dict:
    """One `--cost` argument: KEY=VALUE pairs, or the path of a cost file."""
    try:
        is_file = Path(text).is_file()
    except (OSError, ValueError):  # too long, or a NUL: not a path
        is_file = False
    if "=" in text and not is_file:
        return parse_overrides(text)
    return read_cost_file(text)


def dump_costs(doc: Mapping, toml: bool = True) -> str:
    """Write a cost document (plain numbers, lists and `links` tables) as TOML or JSON; the runtime's
    profiler writes its measurements with this, so `read_cost_file` reads them back. The text is format
    version 2: it names its entries (`keys`), the length of its per-stage lists (`stages`) and ends with
    the `end` marker, so that `read_cost_file` refuses a copy cut short."""
    skip = ("format", "version", *_SEAL)
    body = {k: v for k, v in doc.items() if not (k.startswith("_") or k in skip or v == {})}  # {}: no table
    lengths = {len(v) for k, v in body.items() if k in STAGE_COST_KEYS and isinstance(v, list | tuple)}
    head: dict = {"format": FORMAT, "version": VERSION}
    if len(lengths) == 1:
        head["stages"] = lengths.pop()
    head["keys"] = list(body)
    end = {"keys": len(body)}
    if not toml:
        return json.dumps({**head, **body, "end": end}, indent=2) + "\n"

    def val(v) -> str:
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, float) and not math.isfinite(v):
            return "inf" if v > 0 else "nan"
        return repr(v) if isinstance(v, float) else str(int(v))

    lines = [f"{k} = {val(v)}" for k, v in head.items()]
    tables = []
    for k, v in body.items():
        if isinstance(v, Mapping):
            for cls, spec in v.items():
                tables.append(f"\n[{k}.{cls}]")
                tables.extend(f"{a} = {val(x)}" for a, x in spec.items())
        else:
            lines.append(f"{k} = {val(v)}")
    tables += ["\n[end]", f"keys = {end['keys']}"]  # last: a file cut anywhere before it lacks it
    return "\n".join(lines + tables) + "\n"


def costs_of_timeline(tl: Timeline, what: str = "the measured run") -> dict:
    """A cost document from a run's timeline (`pipec run --trace`): each stage's median F, B and W duration
    over its micro-batches, in seconds. Why: a measured run laid over a simulation in default unit costs
    compares seconds with units; simulated in the run's own op times, the two share an axis, and what
    differs is what the machine model leaves out (messages, waits, dispatch)."""
    import numpy as np

    from pipec.ir.opcodes import COMPUTE_OF_KIND, OP_KINDS

    S = int(tl.stage.max()) + 1 if len(tl.stage) else 0
    doc: dict = {}
    for kind, code in zip(OP_KINDS, COMPUTE_OF_KIND.tolist()):
        sel = np.asarray(tl.op) == code
        if not sel.any():
            continue
        dur = (np.asarray(tl.end) - np.asarray(tl.start))[sel]
        stage = np.asarray(tl.stage)[sel]
        per = [float(np.median(dur[stage == s])) if (stage == s).any() else None for s in range(S)]
        if None in per:
            continue  # a kind measured on some stages only: left to the defaults
        doc[kind] = per
    return normalize(doc, what) if doc else {}
