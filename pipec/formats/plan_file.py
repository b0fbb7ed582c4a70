"""The buffer plan's field of a version 3 Program file (`pipec.formats.program_file`; docs/program.md): the plan
(`pipec.ir.buffers.BufferPlan`) as one JSON object, written in the JSON form's head and on the text form's
`buffers` line alike, and read back with every value's type and range checked (ValueError, which the
Program readers turn into E501). Whether the plan holds for the Program is the proof's
(`pipec.passes.bufferplan.prove`, E502), run by the readers after validating.

A pool row ends with its `bank` (the pools sharing slots) and the object holds `ahead` (the receives posted
ahead the plan is for); a version 3 file written before either (pool rows without `bank`, no `ahead`) reads
as each pool its own slots and receives where the Program places them, which is what that plan meant."""

from __future__ import annotations

import json
import math

import numpy as np

from pipec.ir.buffers import KINDS, BufferPlan, Pool, RankPlan

# A plan's sizes, as a Program's (program_file.MAX_SIZE bounds stages, ranks, micro-batches).
MAX_INT = 10_000_000
_POOL_FIELDS = ["kind", "stage", "edge", "tokens", "host", "slots", "size", "bound", "bank"]
_OLD_POOL_FIELDS = _POOL_FIELDS[:-1]  # the first version 3 files: no banks


def to_doc(plan: BufferPlan) -> dict:
    """The plan as the file's `buffers` object: per rank its pools (rows of `pool_fields`) and its
    tensors (rows [pool, micro-batch, slot], in the plan's order)."""
    ranks = []
    for rp in plan.ranks:
        pools = [[p.kind, p.stage, p.edge, p.tokens, p.host, p.slots, p.size, p.bound, p.bank] for p in rp.pools]
        rows = np.stack([rp.pool, rp.mb, rp.slot], axis=1).tolist() if len(rp) else []
        ranks.append({"pools": pools, "tensors": rows})
    return {"unit": plan.unit, "ahead": plan.ahead, "pool_fields": _POOL_FIELDS, "ranks": ranks}


def to_json(plan: BufferPlan) -> str:
    return json.dumps(to_doc(plan), separators=(",", ":"))


def _int(x: object, what: str, lo: int = -1) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= MAX_INT:
        raise ValueError(f"buffer plan: {what} must be an integer from {lo} to {MAX_INT:,}, got {str(x)[:40]}")
    return x


def _pool(row: object, fields: list[str]) -> Pool:
    if not isinstance(row, list) or len(row) != len(fields):
        raise ValueError(f"buffer plan: a pool must be a row of {len(fields)} values {fields}")
    kind, stage, edge, tokens, host, slots, size, bound, *bank = row
    if kind not in KINDS:
        raise ValueError(f"buffer plan: unknown tensor kind {str(kind)[:40]!r} (known: {', '.join(KINDS)})")
    if not isinstance(host, bool) or not isinstance(bound, str) or len(bound) > 200:
        raise ValueError("buffer plan: a pool's host must be true or false and its bound a short string")
    ok = isinstance(size, int | float) and not isinstance(size, bool) and math.isfinite(size) and size >= 0
    if not ok:
        raise ValueError(f"buffer plan: a pool's size must be a finite number >= 0, got {str(size)[:40]}")
    return Pool(
        kind,
        _int(stage, "a pool's stage", 0),
        _int(edge, "a pool's edge"),
        _int(tokens, "a pool's tokens"),
        host,
        _int(slots, "a pool's slots", 0),
        float(size),
        bound,
        _int(bank[0], "a pool's bank") if bank else -1,
    )


def from_doc(doc: object, num_ranks: int) -> BufferPlan:
    """The file's `buffers` object back as a BufferPlan; ValueError when malformed."""
    if not isinstance(doc, dict) or not {"unit", "pool_fields", "ranks"} <= set(doc) <= {
        "unit",
        "ahead",
        "pool_fields",
        "ranks",
    }:
        raise ValueError("`buffers` must hold unit, pool_fields and ranks (and may hold ahead)")
    fields = doc["pool_fields"]
    if doc["unit"] not in ("units", "bytes") or fields not in (_POOL_FIELDS, _OLD_POOL_FIELDS):
        raise ValueError(f"`buffers` needs unit `units` or `bytes` and pool_fields {_POOL_FIELDS}")
    ahead = _int(doc.get("ahead", 0), "`buffers`' ahead", 0)
    ranks = doc["ranks"]
    if not isinstance(ranks, list) or len(ranks) != num_ranks:
        raise ValueError(f"`buffers` needs one entry per rank ({num_ranks})")
    out = []
    for r, entry in enumerate(ranks):
        if not isinstance(entry, dict) or set(entry) != {"pools", "tensors"} or not isinstance(entry["pools"], list):
            raise ValueError(f"buffer plan, rank {r}: expected pools and tensors")
        pools = tuple(_pool(p, fields) for p in entry["pools"])
        rows = entry["tensors"]
        if not isinstance(rows, list):
            raise ValueError(f"buffer plan, rank {r}: tensors must be a list of [pool, micro-batch, slot] rows")
        arr = np.array(rows) if rows else np.zeros((0, 3), dtype=np.int64)
        if arr.ndim != 2 or arr.shape[1] != 3 or arr.dtype.kind not in "iu":
            raise ValueError(f"buffer plan, rank {r}: each tensor must be a row of three integers [pool, mb, slot]")
        arr = arr.astype(np.int64)
        if len(arr) and ((arr < 0).any() or (arr[:, 0] >= len(pools)).any() or (arr > MAX_INT).any()):
            raise ValueError(f"buffer plan, rank {r}: a tensor names a pool, micro-batch or slot out of range")
        out.append(RankPlan(pools, arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy()))
    return BufferPlan(doc["unit"], tuple(out), ahead)
