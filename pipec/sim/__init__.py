"""Simulation: costs, topology, the simulator, timelines, reports, traces and pictures."""
