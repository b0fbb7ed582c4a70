"""The units of quantities (time, bandwidth, size) and the one reader of a quantity: what cost files,
`--cost` overrides, partition rank files and command-line amounts (`--memory-limit 16GiB`) share."""

from __future__ import annotations

import math
import re

from pipec.errors import brief, error

# The largest quantity a cost may take (seconds, bytes, bit/s): far beyond any real cost, and small
# enough that sums and products over millions of ops stay finite (1e308 overflowed to inf, then nan).
MAX_QUANTITY = 1e18
MIN_BANDWIDTH = 1e-6  # bit/s; a smaller one makes bytes / bandwidth overflow

TIME = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
RATE = {"bps": 1.0, "Kbps": 1e3, "Mbps": 1e6, "Gbps": 1e9, "Tbps": 1e12}
RATE.update({"B/s": 8.0, "KB/s": 8e3, "MB/s": 8e6, "GB/s": 8e9, "TB/s": 8e12})
SIZE = {"B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30}
KIND_UNITS = {"time": TIME, "bandwidth": RATE, "bytes": SIZE, "number": {}}


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
        units = KIND_UNITS[kind]
        if not m or (m.group(2) and m.group(2) not in units):
            raise error(
                "E801",
                f"{what}: cannot read `{brief(value)}` as a {kind} (a number, or with a unit: {', '.join(units)})",
            )
        x = float(m.group(1)) * (units[m.group(2)] if m.group(2) else 1.0)
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
