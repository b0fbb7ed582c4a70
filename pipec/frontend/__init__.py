"""The front end: text to an evaluated Schedule (parse, AST, code generation, evaluation, the library)."""
