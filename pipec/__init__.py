"""pipec: a compiler for pipeline-parallel training schedules. Imports no torch."""

__version__ = "0.1.0"
