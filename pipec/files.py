"""Files in and out: one atomic writer for every file pipec writes, bounded reads of every file it reads,
and the memory a schedule's arrays will take, checked before they are allocated.

Writing. A trace, plot, cost file, Program, CSV or `.pipe` file is written through `atomic_write`: into a
temporary file in the same folder, flushed and fsynced, then renamed over the target with `os.replace`
(atomic on POSIX within one file system). A writer that raises, a full disk or a kill at any moment
leaves the old file (or none) and never a partial one; at worst a hidden `.NAME.*.tmp` survives a
SIGKILL. Streamed writers keep streaming: the helper hands out the open file. A target that exists and
is not a regular file (`/dev/null`, `/dev/stdout`, a FIFO) is written in place, since renaming over it
would replace the device; a symbolic link is followed, so the file it names is replaced, not the link.

Reading. `read_input` stats the path before it opens it and refuses anything but a regular file
(`/dev/zero`, a FIFO with no writer, a socket: each would read forever or block) and any file above
`MAX_INPUT_BYTES`, with E901; then it reads at most that many bytes, so a file that grows while read is
refused too. Schedules, cost files, Programs, topologies, CSVs and traces are read this way.

Memory. `require_memory` refuses (E902) a size estimate above what the machine can give this process
(MemAvailable, and the address-space limit when one is set), naming both figures, so a schedule too
large for the machine is a diagnostic in a second instead of numpy's MemoryError after a minute.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
import tempfile
from collections.abc import Iterator
from typing import IO

from pipec.errors import brief_path, error

MAX_INPUT_BYTES = 64 * 2**20  # any one input file: schedule, cost file, Program, topology, CSV, trace
# Peak bytes per op of `pipec check`, `compile` and `simulate` (measured: about 780 at 1M and 2M ops of
# 1F1B, evaluation, checks, lowering, deadlock proof and simulation together), with a margin.
BYTES_PER_OP = 1000


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """An open file whose contents replace `path` only when the block ends without an exception.

    mode is "w" (text, `encoding`) or "wb". On any exception (KeyboardInterrupt included) the temporary
    file is removed and `path` keeps what it held before. OSError from creating or renaming the file
    propagates with `filename` set to `path`, for the caller's message."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes with mode 'w' or 'wb', not {mode!r}")
    target = os.path.realpath(os.fspath(path))
    try:
        in_place = not stat.S_ISREG(os.stat(target).st_mode)  # a device or FIFO (a folder fails below)
    except OSError:
        in_place = False
    if in_place and not os.path.isdir(target):
        with open(target, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
        return
    folder, name = os.path.split(target)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    except OSError as e:
        raise OSError(e.errno, e.strerror, os.fspath(path)) from None
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename in (None, tmp):
            raise OSError(e.errno, e.strerror, os.fspath(path)) from None
        raise
    _sync_folder(folder)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """`text` as the whole new contents of `path`, atomically (see `atomic_write`)."""
    with atomic_write(path) as f:
        f.write(text)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """`data` as the whole new contents of `path`, atomically (see `atomic_write`)."""
    with atomic_write(path, "wb") as f:
        f.write(data)


def _mode_for(target: str) -> int:
    """The permissions the file gets: those of the file it replaces, else what open() would give (0666
    less the umask; mkstemp's own 0600 would surprise whoever reads the file next)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _sync_folder(folder: str) -> None:
    """fsync the folder so that the rename itself survives a power loss; best effort (not every file
    system or platform lets a directory be opened)."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(folder or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---- reading ------------------------------------------------------------------


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_input(path: str | os.PathLike[str], what: str = "input", limit: int = MAX_INPUT_BYTES) -> None:
    """Refuse (E901) a path that exists and is not a regular file or is larger than `limit`, without
    opening it (opening a FIFO blocks until a writer comes). A missing path or a directory passes, for
    the caller's own message; OSError from stat is left to the caller's open()."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return
    _refuse(st, path, what, limit)


def _refuse(st: os.stat_result, path: str | os.PathLike[str], what: str, limit: int) -> None:
    if stat.S_ISDIR(st.st_mode):
        return
    if not stat.S_ISREG(st.st_mode):
        raise error("E901", f"{what} `{brief_path(path)}` is {_kind(st.st_mode)}, not a regular file")
    if st.st_size > limit:
        raise error(
            "E901",
            f"{what} `{brief_path(path)}` is {fmt_bytes(st.st_size)}, above the limit of {fmt_bytes(limit)}",
        )


def read_input(path: str | os.PathLike[str], what: str = "input", limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; E901 for anything else (see the module's
    docstring). A missing or unreadable file raises OSError as open() would (IsADirectoryError for a
    folder), so each reader keeps its own message for that."""
    check_input(path, what, limit)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)  # O_NONBLOCK: a FIFO put in its place since the stat does not block us
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        _refuse(st, path, what, limit)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:  # it grew while we read
            raise error("E901", f"{what} `{brief_path(path)}` is above the limit of {fmt_bytes(limit)}")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike[str], what: str = "input", limit: int = MAX_INPUT_BYTES) -> str:
    """`read_input`, decoded as UTF-8 (UnicodeDecodeError as `Path.read_text` raises it)."""
    return read_input(path, what, limit).decode("utf-8")


# The binary units amounts of bytes are written in for people, largest first (here, below every floor, so
# that the file limits' messages and everything above them write bytes one way).
BINARY = (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10))


def fmt_bytes(x: float) -> str:
    """An amount of bytes for people: `1.5 GiB`, `512 KiB`, `100 B` (three significant digits; whole units
    from 1000 of the largest up); `no limit` for NaN."""
    if math.isnan(x):
        return "no limit"
    for name, size in BINARY:
        if abs(x) >= size:
            return f"{x / size:.3g} {name}" if abs(x) < 1000 * size else f"{x / size:.0f} {name}"
    return f"{x:g} B"


# ---- memory ---------------------------------------------------------------------


def available_memory() -> int | None:
    """Bytes this process can still allocate: the machine's MemAvailable, lowered to the address-space
    limit (`ulimit -v`) when one is set; None where neither can be found (then nothing is refused)."""
    avail = None
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            avail = soft if avail is None else min(avail, soft)
    return avail


def require_memory(nbytes: float, what: str) -> None:
    """Refuse (E902) work whose arrays are estimated at `nbytes`, when the machine cannot give that much."""
    avail = available_memory()
    if avail is not None and nbytes > avail:
        raise error(
            "E902",
            f"{what} needs about {fmt_bytes(nbytes)} of memory, and this machine has {fmt_bytes(avail)} available",
            notes=("make it smaller (fewer micro-batches, ranks or stages), or run it on a larger machine",),
        )


def require_ops_fit(num_ops: int, what: str) -> None:
    """`require_memory` for a schedule of `num_ops` ops through check, lowering and simulation."""
    require_memory(float(num_ops) * BYTES_PER_OP, f"{what} ({num_ops:,} ops)")
