"""Passes over a Schedule: checks, memory, deadlock, expectations, policies, lowering, the dry run."""
