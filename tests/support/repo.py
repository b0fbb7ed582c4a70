"""Where the repository is, for tests at any depth of tests/ (this folder is on pytest's pythonpath)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
