"""Package data: `pipe.lark`, the grammar of the schedule language (installed as `pipec.grammar`)."""
