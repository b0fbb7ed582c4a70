"""pipec/files.py: the one atomic writer, bounded reads, and the memory estimate before allocation."""

from __future__ import annotations

import os
import stat

import pytest

from pipec import files
from pipec.errors import PipecError


class Boom(Exception):
    pass


def _leftovers(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))


def test_a_writer_that_raises_midway_leaves_no_file_and_no_temporary(tmp_path):
    path = tmp_path / "trace.json"
    with pytest.raises(Boom), files.atomic_write(path) as f:
        f.write('{"half": ')
        raise Boom
    assert not path.exists()
    assert os.listdir(tmp_path) == []


def test_an_existing_file_survives_a_failed_write(tmp_path):
    path = tmp_path / "costs.toml"
    path.write_text("F = 1\n")
    with pytest.raises(Boom), files.atomic_write(path) as f:
        f.write("F = 2\n" * 1000)
        raise Boom
    assert path.read_text() == "F = 1\n"
    assert _leftovers(tmp_path) == []


def test_a_keyboard_interrupt_midway_leaves_the_old_file_too(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("old\n")
    with pytest.raises(KeyboardInterrupt), files.atomic_write(path) as f:
        f.write("new")
        raise KeyboardInterrupt
    assert path.read_text() == "old\n" and _leftovers(tmp_path) == []


def test_a_whole_write_replaces_the_file_and_keeps_its_permissions(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("old\n")
    os.chmod(path, 0o640)
    with files.atomic_write(path) as f:  # streamed: written in pieces
        for i in range(3):
            f.write(f"line {i}\n")
    assert path.read_text() == "line 0\nline 1\nline 2\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert _leftovers(tmp_path) == []


def test_a_new_file_gets_the_permissions_open_would_give(tmp_path):
    umask = os.umask(0o022)
    try:
        files.write_text(tmp_path / "new.txt", "x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "new.txt").st_mode) == 0o644


def test_bytes_are_written_atomically_as_well(tmp_path):
    files.write_bytes(tmp_path / "a.png", b"\x89PNG")
    assert (tmp_path / "a.png").read_bytes() == b"\x89PNG"


def test_a_symbolic_link_is_followed_and_stays_a_link(tmp_path):
    real = tmp_path / "real.txt"
    real.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    files.write_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new"


def test_a_device_is_written_in_place_not_replaced():
    files.write_text(os.devnull, "nothing\n")  # renaming over /dev/null would replace the device
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_a_folder_that_cannot_be_written_is_an_oserror_naming_the_target(tmp_path):
    target = tmp_path / "no-such-folder" / "x.txt"
    with pytest.raises(OSError) as info:
        files.write_text(target, "x")
    assert info.value.filename == str(target)


def test_reads_are_bounded(tmp_path):
    path = tmp_path / "big.toml"
    path.write_bytes(b"x" * 101)
    assert files.read_input(path, "cost file", limit=101) == b"x" * 101
    with pytest.raises(PipecError) as info:
        files.read_input(path, "cost file", limit=100)
    assert info.value.code == "E901" and "above the limit of 100 B" in str(info.value)


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(PipecError) as info:  # no writer: open() would block forever
        files.read_input(fifo, "schedule file")
    assert info.value.code == "E901" and "is a FIFO, not a regular file" in str(info.value)


def test_a_character_device_is_refused():
    with pytest.raises(PipecError) as info:
        files.read_input("/dev/zero", "cost file")
    assert info.value.code == "E901" and "a character device" in str(info.value)


def test_a_missing_file_or_folder_is_the_callers_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.read_input(tmp_path / "missing")
    with pytest.raises(IsADirectoryError):
        files.read_input(tmp_path)


def test_work_beyond_the_available_memory_is_refused_with_both_sizes(monkeypatch):
    monkeypatch.setattr(files, "available_memory", lambda: 2**30)
    files.require_memory(2**29, "small")  # fits
    with pytest.raises(PipecError) as info:
        files.require_ops_fit(20_000_000, "`1f1b`")
    assert info.value.code == "E902"
    assert "`1f1b` (20,000,000 ops) needs about 18.6 GiB of memory" in str(info.value)
    assert "1 GiB available" in str(info.value)


def test_available_memory_is_a_positive_figure_or_unknown():
    avail = files.available_memory()
    assert avail is None or avail > 0
