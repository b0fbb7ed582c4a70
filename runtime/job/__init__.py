"""The job: `pipec run` and torchrun's entry point, monitoring, checkpoints, measurements, the printed records."""
