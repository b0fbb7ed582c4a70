"""Rows of numbers to text with numpy, for the Program writers: a million instructions in well under a
second instead of a Python loop per row.

A row is a sequence of tokens. Each token column is a byte matrix (one row per output row, padded) and a
length per row; `join_rows` lays the columns side by side and keeps, row by row, the first `length`
bytes of each token: one boolean mask over the whole matrix, read in row-major order, is exactly the
concatenated text.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Token = tuple[np.ndarray, np.ndarray]  # (n x width uint8 matrix, n lengths)


def literal(text: str, n: int) -> Token:
    """The same text on every row."""
    b = np.frombuffer(text.encode(), dtype=np.uint8)
    return np.broadcast_to(b, (n, len(b))), np.full(n, len(b), dtype=np.int64)


def choice(texts: Sequence[str], index: np.ndarray) -> Token:
    """texts[index[i]] on row i (an opcode's name, `true` or `false`)."""
    raw = [t.encode() for t in texts]
    width = max((len(b) for b in raw), default=0)
    table = np.zeros((len(raw), max(width, 1)), dtype=np.uint8)
    for i, b in enumerate(raw):
        table[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
    lengths = np.array([len(b) for b in raw], dtype=np.int64)
    return table[index], lengths[index]


def integers(values: np.ndarray, prefix: str = "") -> Token:
    """Each value in decimal, after `prefix` (a separator such as " " or ",")."""
    v = np.asarray(values, dtype=np.int64)
    if len(v) == 0:
        return np.zeros((0, 1), dtype=np.uint8), np.zeros(0, dtype=np.int64)
    lo, hi = int(v.min()), int(v.max())
    if hi - lo < 1 << 20:  # a table of every value in range: one gather
        return choice([prefix + str(x) for x in range(lo, hi + 1)], v - lo)
    values = np.sort(v)
    values = values[np.r_[True, values[1:] != values[:-1]]]  # the distinct values (np.unique imports numpy.ma)
    return choice([prefix + str(x) for x in values.tolist()], np.searchsorted(values, v))


def join_rows(tokens: Sequence[Token]) -> bytes:
    """The rows' text: each row's tokens in order, each cut to its length (0 leaves it out)."""
    if not tokens or len(tokens[0][1]) == 0:
        return b""
    mats = [np.ascontiguousarray(m) for m, _ in tokens]
    masks = [np.arange(m.shape[1]) < lengths[:, None] for m, (_, lengths) in zip(mats, tokens)]
    return np.hstack(mats)[np.hstack(masks)].tobytes()
