"""Execution: one rank's instruction stream on torch (executor, stage, communication, saved tensors, replicas)."""
