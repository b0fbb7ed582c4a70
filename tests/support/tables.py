"""A random layer table (what `pipec partition` reads per layer), for the partition and room tests."""

from __future__ import annotations

import numpy as np

from pipec.formats.partition_files import make_table


def random_layer_table(rng: np.random.Generator, layers: int):
    """`layers` rows of random times and bytes, one small weight each (names l0, l1, ...)."""
    rows = [
        {
            "name": f"l{i}",
            "F": float(rng.uniform(0.1, 3)),
            "B": float(rng.uniform(0.1, 3)),
            "W": float(rng.uniform(0.1, 2)),
            "full_backward": float(rng.uniform(0.2, 5)),
            "act_bytes": int(rng.integers(10, 100)),
            "out_bytes": int(rng.integers(1, 10)),
            "param_bytes": int(rng.integers(1, 60)),
            "params": [["weight", [i + 1, 2]]],
        }
        for i in range(layers)
    ]
    return make_table(rows)
