"""Units: the one table of time, size and rate units, and the one way amounts of bytes are written for people.

Every reader of a quantity with a unit (the language's `40ms` and `16MiB`, cost files and `--cost`,
`--memory-limit`, partition's `--ranks`) scales by this table, and every writer (the `.pipe` writer, the
tables and reports) writes from it, so `10Gbps` means the same number everywhere and reads back exactly.

A unit is (kind, multiply, divide): a value in it is `value * multiply / divide` in the kind's base unit
(seconds, bytes, bits per second), so `5us` is exactly `5 / 1e6` seconds, the float a writer needs to
find again.
"""

from __future__ import annotations

import math
import re

from pipec.errors import brief, error
from pipec.files import BINARY, fmt_bytes  # noqa: F401 - one writer of bytes for people, below every floor

# The largest quantity a cost may take (seconds, bytes, bit/s): far beyond any real cost, and small
# enough that sums and products over millions of ops stay finite (1e308 overflowed to inf, then nan).
MAX_QUANTITY = 1e18
MIN_BANDWIDTH = 1e-6  # bit/s; a smaller one makes bytes / bandwidth overflow

# name -> (kind, multiply, divide); kinds: "time" (seconds), "bytes", "bandwidth" (bits per second).
UNITS: dict[str, tuple[str, float, float]] = {
    "ns": ("time", 1.0, 1e9),
    "us": ("time", 1.0, 1e6),
    "ms": ("time", 1.0, 1e3),
    "s": ("time", 1.0, 1.0),
    "B": ("bytes", 1.0, 1.0),
    "KB": ("bytes", 1e3, 1.0),
    "MB": ("bytes", 1e6, 1.0),
    "GB": ("bytes", 1e9, 1.0),
    "KiB": ("bytes", 2.0**10, 1.0),
    "MiB": ("bytes", 2.0**20, 1.0),
    "GiB": ("bytes", 2.0**30, 1.0),
    "bps": ("bandwidth", 1.0, 1.0),
    "Kbps": ("bandwidth", 1e3, 1.0),
    "Mbps": ("bandwidth", 1e6, 1.0),
    "Gbps": ("bandwidth", 1e9, 1.0),
    "Tbps": ("bandwidth", 1e12, 1.0),
    "B/s": ("bandwidth", 8.0, 1.0),
    "KB/s": ("bandwidth", 8e3, 1.0),
    "MB/s": ("bandwidth", 8e6, 1.0),
    "GB/s": ("bandwidth", 8e9, 1.0),
    "TB/s": ("bandwidth", 8e12, 1.0),
}

# The units the schedule language writes after a number (grammar/pipe.lark's QUANTITY token): no `ns`, and
# bandwidths in bits per second only.
LANGUAGE = ("us", "ms", "s", "bps", "Kbps", "Mbps", "Gbps", "Tbps", "B", "KB", "MB", "GB", "KiB", "MiB", "GiB")


def of_kind(kind: str, among: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The units of one kind ("time", "bytes", "bandwidth"), in table order; only those in `among` if given."""
    return tuple(u for u, (k, _, _) in UNITS.items() if k == kind and (among is None or u in among))


def scale(value: float, unit: str) -> float:
    """`value` given in `unit`, in its kind's base unit (seconds, bytes, bits per second)."""
    _, mul, div = UNITS[unit]
    return value * mul / div


def exact_text(x: float, units: tuple[str, ...], digits) -> str | None:
    """The shortest `<number><unit>` among `units` that `scale` reads back as exactly `x` (`digits` writes a
    number); the first of equal length wins. None when none does."""
    best = None
    for unit in units:
        _, mul, div = UNITS[unit]
        text = digits(x * div / mul)
        if float(text) * mul / div == x and (best is None or len(text) + len(unit) < len(best)):
            best = text + unit
    return best


def quantity(value: object, kind: str, what: str) -> float:
    """A number, or a string with a unit of this kind ("40ms", "10Gbps", "16MiB"), as seconds, bit/s or bytes."""
    if isinstance(value, bool):
        raise error("E801", f"{what}: expected a number, got `{brief(value)}`")
    if isinstance(value, int | float):
        try:
            x = float(value)
        except OverflowError:  # a 400-digit integer
            raise error("E801", f"{what}: `{brief(value)}` is out of range (at most {MAX_QUANTITY:g})") from None
    elif isinstance(value, str):
        text = value.strip().replace(" ", "")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)(.*)", text)
        units = of_kind(kind)  # a "number" has none
        if not m or (m.group(2) and m.group(2) not in units):
            raise error(
                "E801",
                f"{what}: cannot read `{brief(value)}` as a {kind} (a number, or with a unit: {', '.join(units)})",
            )
        x = scale(float(m.group(1)), m.group(2)) if m.group(2) else float(m.group(1))
    else:
        raise error("E801", f"{what}: expected a number, got `{brief(value)}`")
    if kind == "bandwidth":
        if not x > 0:
            raise error("E801", f"{what}: bandwidth must be positive, got `{brief(value)}`")
        if not (x == math.inf or MIN_BANDWIDTH <= x <= MAX_QUANTITY):
            raise error(
                "E801",
                f"{what}: bandwidth `{brief(value)}` is out of range ({MIN_BANDWIDTH:g} to {MAX_QUANTITY:g} bit/s,"
                " or inf for a free link)",
            )
    elif not (math.isfinite(x) and x >= 0):
        raise error("E801", f"{what}: expected a finite number >= 0, got `{brief(value)}`")
    elif x > MAX_QUANTITY:
        raise error("E801", f"{what}: `{brief(value)}` is out of range (at most {MAX_QUANTITY:g})")
    return x
