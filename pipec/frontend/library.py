"""Finding schedule files: a path on disk, or a name in the standard library (`schedules/`)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from pipec.errors import Source, error


def package_files(package: str):
    """A package's directory: a Path when it is a directory on disk (an ordinary or editable install),
    which saves a fresh process importing `importlib.resources` and its readers (more time than reading
    the file); else `importlib.resources.files` (a zip, say). Both offer joinpath, is_file, read_text."""
    spec = importlib.util.find_spec(package)
    for where in (spec.submodule_search_locations or ()) if spec else ():
        if Path(where).is_dir():
            return Path(where)
    from importlib import resources

    return resources.files(package)


def names() -> list[str]:
    """Names of the library schedules, sorted."""
    files = package_files("pipec.schedules").iterdir()
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
        from pipec.files import read_text  # its tempfile import is for writers: `pipec list` reads none

        try:  # bounded: a FIFO, /dev/zero or a file above 64 MiB is E901, never a hang
            text = read_text(path, "schedule file")
            return Source(str(path), text.replace("\r\n", "\n").replace("\r", "\n"))  # as open() reads it
        except OSError as e:
            raise error("E000", f"cannot read `{name_or_path}`: {e.strerror}") from None
        except UnicodeDecodeError:
            raise error("E000", f"`{name_or_path}` is not a UTF-8 text file") from None
    res = package_files("pipec.schedules").joinpath(f"{name_or_path}.pipe")
    if not res.is_file():
        raise error(
            "E000",
            f"no schedule file or library schedule named `{name_or_path}`",
            notes=(f"library: {', '.join(names())}",),
        )
    return Source(f"<library>/{name_or_path}.pipe", res.read_text())
