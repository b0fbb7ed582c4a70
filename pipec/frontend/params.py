"""Parameter values as a schedule takes them: text from `-D` read as the language's own literals, typed values checked.

Apart from evaluation because more than evaluation needs it: the testing kit (pipec.testing.space) reads
the `-D` values of a parameter space with `parse_value`, and every value given to a schedule, from the
command line or the Python API, passes `bind_params` before the generated code runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pipec.errors import Source, brief, error
from pipec.frontend.codegen import GeneratedCode

# A parameter's value given as text (`-D p=4`): the language's own literals, ASCII digits with an optional
# sign (Python's int() and float() would also take `1_0` as 10 and Arabic-Indic `٤` as 4).
_INT = re.compile(r"[-+]?[0-9]+")
_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def parse_value(text: str, typ: str) -> int | float | bool | str:
    """A `-D` value as the parameter's type; ValueError (E206) for text that is no literal of it."""
    if typ == "int":
        if not _INT.fullmatch(text.strip()):
            raise ValueError(text)
        return int(text)
    if typ == "float":
        if not (_FLOAT.fullmatch(text.strip()) or text.strip() in ("inf", "-inf", "nan")):
            raise ValueError(text)
        return float(text)
    if typ == "bool":
        if text not in ("true", "false"):
            raise ValueError(text)
        return text == "true"
    return text


def _check_value(value, typ: str) -> bool:
    if typ == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return type(value) is {"int": int, "bool": bool, "str": str}[typ]


def bind_params(compiled: GeneratedCode, source: Source, given: Iterable[tuple[str, object]]) -> dict[str, object]:
    """The values given for a compiled schedule's parameters, by name, each of its declared type (`-D`
    text parsed, a typed value checked; a float parameter's int made a float): E204 to E206 otherwise.
    Defaults are not filled in here: they are expressions of the generated code (evaluate runs them)."""
    header = compiled.header
    declared = {p.name: (p, t) for p, t in zip(compiled.params, compiled.param_types)}
    values: dict[str, object] = {}
    for name, raw in given:
        if name not in declared:
            known = ", ".join(declared) or "none"
            raise error("E205", f"unknown parameter `{name}` (this schedule takes: {known})", header, source)
        prm, typ = declared[name]
        if name in values:
            raise error("E204", f"parameter `{name}` given twice", prm.span, source)
        try:
            value = parse_value(raw, typ) if isinstance(raw, str) else raw
            if not _check_value(value, typ):
                raise ValueError(raw)
        except ValueError:
            raise error("E206", f"parameter `{name}` must be {typ}, got `{brief(raw)}`", prm.span, source) from None
        values[name] = float(value) if typ == "float" else value
    return values
