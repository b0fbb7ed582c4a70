"""Floor 4: one reader and one writer per file format (Programs, .pipe, torch CSV, traces, partitions)."""
