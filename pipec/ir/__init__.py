"""Floor 1: the nouns (Schedule, Program, the instruction table) and their rules; imports only the base floor."""
