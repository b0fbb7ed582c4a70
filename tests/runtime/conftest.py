"""Fixtures of the runtime tests."""

from __future__ import annotations

import pytest

# The small float64 MLP of examples/mlp.py that profile and collective tests share (exact in float64).
SMALL_MLP = {"MLP_WIDTH": "16", "MLP_DEPTH": "4", "MLP_BATCH": "8", "MLP_DTYPE": "float64"}


@pytest.fixture
def small_mlp(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """examples/mlp.py at the small float64 size, through its environment variables."""
    for k, v in SMALL_MLP.items():
        monkeypatch.setenv(k, v)
    return SMALL_MLP
