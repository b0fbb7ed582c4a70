"""Package data: the standard schedule library, `*.pipe` (installed as `pipec.schedules`)."""
