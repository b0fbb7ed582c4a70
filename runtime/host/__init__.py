"""This host's processes: CPU binding of local ranks (affinity) and local worker processes (spawned), shared by
the job and the profiler."""
