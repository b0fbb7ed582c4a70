"""The per-user cache: files an earlier process computed that a fresh one may load instead.

Two things are cached, each under a name that digests everything it depends on, so a stale entry is
never read: lark's parser tables when the package's own do not serve (`pipec.frontend.tables`: a grammar
edited without rebuilding them) and each schedule text's generated code
(`pipec.frontend.load.compile_source`). The folder is `$PIPEC_CACHE_DIR`, else `$XDG_CACHE_HOME/pipec`, else
`~/.cache/pipec`, created private to this user; it is not used (everything is computed in-process) when
it cannot be created, or when someone else owns it or may write to it, because loading an entry
unpickles it. Entries are written to a temporary name and renamed, so a concurrent reader sees a whole
entry or none; a missing, unreadable or damaged entry only costs the time to compute it again.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def cache_dir() -> Path | None:
    """The cache folder, or None when there is no safe one (see the module docstring)."""
    try:
        env = os.environ.get("PIPEC_CACHE_DIR")
        base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipec"
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = base.stat()
    except (OSError, RuntimeError):  # RuntimeError: no home directory to be found
        return None
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return None
    return base


def load(name: str) -> bytes | None:
    """An entry's bytes, or None."""
    where = cache_dir()
    if where is None:
        return None
    try:
        return (where / name).read_bytes()
    except OSError:
        return None


def store(name: str, data: bytes) -> None:
    """Write an entry atomically; any failure (read-only or full disk) only costs speed."""
    where = cache_dir()
    if where is None:
        return
    import tempfile  # only when writing, which is rare

    tmp = None
    try:
        with tempfile.NamedTemporaryFile("wb", dir=where, prefix=name + ".", delete=False) as f:
            tmp = f.name
            f.write(data)
        os.replace(tmp, where / name)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
