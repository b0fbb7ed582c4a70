"""Shared fixtures of the whole suite.

The tests mirror the package: `unit/<floor>/` (one floor of pipec each: base, ir, frontend, sim, options,
passes, formats, driver, tools = synth/partition/slicing, testing, cli), `features/` (acceptance across
floors: cross-datacenter, memory ops, V schedules, TeraPipe, hostile input, the library), `runtime/` (the
torch runtime, multi-process cases included). Helpers live in `support/` (on pytest's pythonpath, so
`from cli_helpers import run_cli`, `from repo import ROOT`); model files for the runtime in `models/`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from repo import ROOT


@pytest.fixture(scope="session")
def root() -> Path:
    """The repository's root folder."""
    return ROOT
