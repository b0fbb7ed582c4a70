"""Finding schedule files: a path on disk, or a name in the standard library (`schedules/`)."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from pipec.errors import Source, error


def names() -> list[str]:
    """Names of the library schedules, sorted."""
    files = resources.files("pipec.schedules").iterdir()
    return sorted(f.name[: -len(".pipe")] for f in files if f.name.endswith(".pipe"))


def summary(name: str) -> str:
    """The first sentence of a library file's header comment."""
    words: list[str] = []
    for line in read(name).text.splitlines():
        m = re.match(r"#\s*(.*)", line)
        if not m or not m.group(1).strip():
            break
        words.append(m.group(1).strip())
    text = " ".join(words)
    end = re.search(r"\.(\s|$)", text)
    return text[: end.start() + 1] if end else text


def read(name_or_path: str) -> Source:
    """Read a schedule by path (anything with a `/` or ending in `.pipe`, or a torch schedule `.csv`) or
    by library name."""
    path = Path(name_or_path)
    if path.suffix in (".pipe", ".csv") or "/" in name_or_path or path.is_file():
        try:
            return Source(str(path), path.read_text())
        except OSError as e:
            raise error("E000", f"cannot read `{name_or_path}`: {e.strerror}") from None
        except UnicodeDecodeError:
            raise error("E000", f"`{name_or_path}` is not a UTF-8 text file") from None
    res = resources.files("pipec.schedules").joinpath(f"{name_or_path}.pipe")
    if not res.is_file():
        raise error(
            "E000",
            f"no schedule file or library schedule named `{name_or_path}`",
            notes=(f"library: {', '.join(names())}",),
        )
    return Source(f"<library>/{name_or_path}.pipe", res.read_text())
