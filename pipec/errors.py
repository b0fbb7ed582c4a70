"""Diagnostics: every user error is one of these, never a traceback.

A diagnostic carries a code, a message and a source span; `format()` renders
the compiler convention `path:line:col: error[CODE]: message`, the source line
and a caret under the span.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Source:
    """A schedule text and where it came from (a path or a library name)."""

    path: str
    text: str

    def line(self, lineno: int) -> str:
        # Lines as the parser counts them: "\n" ends a line; "\r", "\f" and the other characters
        # str.splitlines() would also split on do not (a CRLF line loses its "\r").
        lines = self.text.split("\n")
        return lines[lineno - 1].removesuffix("\r") if 1 <= lineno <= len(lines) else ""


@dataclass(frozen=True)
class Span:
    """1-based line and column of the first character, and of the end (exclusive)."""

    line: int
    col: int
    end_line: int
    end_col: int


@dataclass(frozen=True)
class Diagnostic:
    code: str
    message: str
    span: Span | None = None
    source: Source | None = None
    notes: tuple[str, ...] = field(default=())
    severity: str = "error"

    def to_json(self) -> dict:
        """The diagnostic as a document reports it (`--json`, the playground): its code, place and text
        (`text` is what stderr shows)."""
        sp = self.span
        return {
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            "path": self.source.path if self.source else None,
            "line": sp.line if sp else None,
            "col": sp.col if sp else None,
            "end_line": sp.end_line if sp else None,
            "end_col": sp.end_col if sp else None,
            "notes": list(self.notes),
            "text": self.format(),
        }

    def format(self) -> str:
        where = self.source.path if self.source else "pipec"  # no file to point at: the program speaks, as cc does
        if self.span is not None:
            where = f"{where}:{self.span.line}:{self.span.col}"
        out = [f"{where}: {self.severity}[{self.code}]: {self.message}"]
        if self.span is not None and self.source is not None:
            text = self.source.line(self.span.line)
            if text:
                width = (
                    self.span.end_col - self.span.col
                    if self.span.end_line == self.span.line
                    else len(text) - self.span.col + 1
                )
                shown, col, width = snippet(text, self.span.col, max(1, width))
                gutter = f"{self.span.line:>4} | "
                out.append(gutter + shown)
                out.append(" " * (len(gutter) + col - 1) + "^" * width)
        out.extend(f"  = note: {n}" for n in self.notes)
        return "\n".join(out)


SNIPPET_WIDTH = 200  # columns of a source line a diagnostic quotes; a longer line is cut around the caret


def snippet(text: str, col: int, width: int, limit: int = SNIPPET_WIDTH) -> tuple[str, int, int]:
    """The part of a source line a diagnostic quotes, the caret's 1-based column in it and the caret's width:
    the whole line when it fits in `limit` columns, else a window around the span with `...` where the
    line was cut (a 1 MB line is not echoed whole), the caret cut to the window."""
    if len(text) <= limit:
        return text, col, width
    width = max(1, min(width, limit // 2))
    start = max(0, min(col - 1 - (limit - width) // 2, len(text) - limit))
    end = min(len(text), start + limit)
    head = "..." if start > 0 else ""
    tail = "..." if end < len(text) else ""
    return head + text[start:end] + tail, col - start + len(head), width


def brief(value: object, width: int = 40) -> str:
    """A value as a message quotes it: whole up to `width` characters, else its two ends and its length
    (a 300-digit number given with -D is not echoed whole)."""
    text = str(value)
    if len(text) <= width:
        return text
    unit = "digits" if text.lstrip("-").isdigit() else "characters"
    return f"{text[: width // 2]}...{text[-(width // 4) :]} ({len(text)} {unit})"


def brief_path(path: object) -> str:
    """A file path as a message quotes it: whole up to Linux's PATH_MAX (4096), so that a user can find the
    file (`brief`'s 80 characters cut a path in a deep folder, or a test's temporary one, in the middle)."""
    return brief(os.fspath(path) if isinstance(path, os.PathLike) else path, 4096)


class PipecError(Exception):
    """The one exception type user errors raise; holds one or more diagnostics."""

    def __init__(self, *diagnostics: Diagnostic) -> None:
        self.diagnostics = tuple(diagnostics)
        super().__init__("\n".join(d.format() for d in self.diagnostics))

    @property
    def code(self) -> str:
        return self.diagnostics[0].code

    @property
    def span(self) -> Span | None:
        return self.diagnostics[0].span


def error(
    code: str,
    message: str,
    span: Span | None = None,
    source: Source | None = None,
    notes: tuple[str, ...] = (),
) -> PipecError:
    return PipecError(Diagnostic(code, message, span, source, notes))
