"""The command line: the only code that prints (one module per command, from one registry)."""
