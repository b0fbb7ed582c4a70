"""The files of a checkpoint folder, read and written so that nothing blocks and nothing is half there: a
FIFO or a device is never opened (`open_regular`), `latest` is replaced atomically and never written through
a link (`atomic_text`), renames are made durable (`fsync_dir`). pipec.runtime.job.checkpoint reads and writes
through these.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat


class NotRegular(OSError):
    """A file of a checkpoint folder that is a FIFO, a device, a socket or a folder, or a link to one: never
    opened, since opening or reading a FIFO blocks until a writer comes and a device (/dev/zero) never ends.
    An OSError, so it reads as every other file that cannot be read ("cannot be read (a FIFO, ...)")."""


def shown(path: str) -> str:
    """A path as it can be printed: a name that is not UTF-8 (kept by Python as surrogates) with escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def kind_of(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def open_regular(path: str):
    """`path` opened for reading in binary, only when it is a regular file or a link to one: checked with
    lstat (and stat through a link) before it is opened, so a FIFO or a device is never opened at all, and
    with fstat once open (opened non-blocking, so one swapped in meanwhile cannot block either). NotRegular
    naming what it is otherwise; FileNotFoundError and the other OSErrors as open's."""
    st = os.lstat(path)
    what = None
    if stat.S_ISLNK(st.st_mode):
        target = os.stat(path)  # a dangling link: FileNotFoundError
        if not stat.S_ISREG(target.st_mode):
            what = f"a link to {shown(os.path.realpath(path))}, {kind_of(target.st_mode)}"
    elif not stat.S_ISREG(st.st_mode):
        what = kind_of(st.st_mode)
    if what is None:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        os.close(fd)
        what = kind_of(mode)
    raise NotRegular(errno.EINVAL, f"{what}, not a regular file: never opened", path)


def digest(path: str) -> tuple[int, str]:
    with open_regular(path) as f:
        h = hashlib.file_digest(f, "sha256")
        return f.tell(), h.hexdigest()


def fsync_dir(path: str, strict: bool = False) -> None:
    """Make the renames in folder `path` durable. `strict`: a failure (other than a file system that cannot
    sync a folder) is raised, as before `latest` moves to a checkpoint whose rename might not survive."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if strict and e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def atomic_text(path: str, text: str) -> None:
    """Replace `path` (the folder's `latest`) with `text` atomically. Not `pipec.files.atomic_write`: that
    one follows a symbolic link to its target, and a `latest` that is a link must be replaced, never let a
    save write through it to a file outside the checkpoint folder. The temporary file is created afresh
    (O_EXCL): a stale one of that name, whatever it is (a FIFO would block the open), is removed first."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
