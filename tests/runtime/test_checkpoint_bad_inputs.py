"""Checkpoint folders that used to be refused, left wrong or hung (issue 41): a read-only folder for a run
that writes nothing there, a disk that fills part-way through a later save, and a folder holding FIFOs or
links to devices. One process holds every stage (what `save` and `prepare` read of a Runner), so each case
costs a fraction of a second; the job-level twins are test_checkpoint_trust's."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from pipec.runtime.errors import PipelineError  # noqa: E402
from pipec.runtime.job import checkpoint as ck  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

RUN = "run-a"


def runner(seed: int = 0) -> SimpleNamespace:
    """Two stages, each an Adam-trained Linear(4, 4) in float64, held by one process."""
    torch.manual_seed(seed)
    held = {}
    for s in range(2):
        m = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.float64))
        held[s] = SimpleNamespace(module=m, optimizer=torch.optim.Adam(m.parameters(), lr=0.1))
    return SimpleNamespace(program=SimpleNamespace(num_stages=2, name="1f1b"), stages=held, rank=0, steps_done=0)


def train(r: SimpleNamespace) -> None:
    for st in r.stages.values():
        st.optimizer.zero_grad()
        st.module(torch.ones(1, 4, dtype=torch.float64)).sum().backward()
        st.optimizer.step()


def weights(r: SimpleNamespace) -> dict[str, torch.Tensor]:
    return {f"{s}.{n}": p.detach().clone() for s, st in r.stages.items() for n, p in st.module.named_parameters()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """A folder with the checkpoints of steps 1 and 2, and the weights at each."""
    folder = tmp_path_factory.mktemp("saved") / "ck"
    r, at = runner(), {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (1, 2):
            train(r)
            ck.save(str(folder), r, step, RUN)
            at[step] = weights(r)
    return folder, at


@pytest.fixture
def folder(saved, tmp_path) -> Path:
    copy = tmp_path / "ck"
    shutil.copytree(saved[0], copy, symlinks=True)
    return copy


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under `root` with its mode and modification time: equal before and after means nothing
    was written, made or removed."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_mode, st.st_mtime_ns)
    return out


# ---------------------------------------------------------------------------------------------------------
# a. a read-only folder: refused only when a save is to come, and then before any step, naming the folder

WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@pytest.fixture
def read_only(folder, monkeypatch) -> SimpleNamespace:
    """`folder` made read-only. Root writes anywhere, so the file system's refusal (EROFS) is simulated
    too: every call that would write under it fails, and is recorded."""
    tried: list[str] = []
    inside = str(folder)

    def under(path) -> bool:
        return isinstance(path, str | os.PathLike) and os.fsdecode(path).startswith(inside)

    def deny(path) -> None:
        tried.append(os.fsdecode(path))
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    real_open = os.open

    def opener(path, flags, *a, **kw):
        if under(path) and flags & WRITES:
            deny(path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", opener)
    for name in ("mkdir", "unlink", "rmdir", "replace", "rename"):
        real = getattr(os, name)

        def refuse(path, *a, _real=real, **kw):
            if under(path):
                deny(path)
            return _real(path, *a, **kw)

        monkeypatch.setattr(os, name, refuse)
    folder.chmod(0o555)
    yield SimpleNamespace(path=folder, tried=tried)
    folder.chmod(0o755)


def test_a_read_only_folder_serves_a_resume_with_no_step_left_and_nothing_is_written(saved, read_only):
    folder = read_only.path
    before = snapshot(folder)
    r = runner(seed=1)
    start = ck.prepare(str(folder), r, resume=True, until=2)
    assert start.restored == ck.Restored(2, str(folder / "step-000002"), ())
    assert start.run == RUN and r.steps_done == 2
    assert weights(r).keys() == saved[1][2].keys()
    assert all(torch.equal(saved[1][2][k], v) for k, v in weights(r).items())
    assert snapshot(folder) == before and read_only.tried == []
    # a resume past the end (--steps below the checkpoint's step) saves nothing either
    assert ck.prepare(str(folder), runner(seed=1), resume=True, until=1).restored.step == 2
    assert read_only.tried == []


def test_a_read_only_folder_keeps_an_unfinished_saves_leftovers_when_nothing_is_saved(saved, tmp_path, monkeypatch):
    """Partial folders are removed only by a run that writes: a run that saves nothing leaves them."""
    copy = tmp_path / "ck"
    shutil.copytree(saved[0], copy, symlinks=True)
    (copy / "step-000003.partial").mkdir()
    (copy / "step-000003.partial" / "__0_0.distcp").write_text("half")
    assert ck.prepare(str(copy), runner(seed=1), resume=True, until=2).restored.step == 2
    assert (copy / "step-000003.partial" / "__0_0.distcp").read_text() == "half"
    assert ck.prepare(str(copy), runner(seed=1), resume=True, until=3).restored.step == 2
    assert not (copy / "step-000003.partial").exists()  # a save is to come: the leftovers go


@pytest.mark.parametrize(
    "resume, until",
    [(True, 3), (True, None), (False, 1)],
    ids=["a resume with steps left", "a resume, until not given", "a run from step 0"],
)
def test_a_read_only_folder_is_refused_up_front_when_a_save_is_to_come(read_only, resume, until):
    with pytest.raises(PipelineError) as e:
        ck.prepare(str(read_only.path), runner(seed=1), resume=resume, until=until)
    assert str(e.value).startswith(
        f"--checkpoint {read_only.path}: checkpoints cannot be written there (Read-only file system"
    ), str(e.value)


def test_a_resume_with_nothing_to_write_from_a_missing_folder_makes_no_folder(tmp_path):
    start = ck.prepare(str(tmp_path / "none"), runner(), resume=True, until=0)
    assert start.restored is None and not (tmp_path / "none").exists()
    assert ck.prepare(str(tmp_path / "none"), runner(), resume=True, until=3).restored is None
    assert (tmp_path / "none").is_dir()  # a save is to come: the folder is made before any step


# ---------------------------------------------------------------------------------------------------------
# b. a disk that fills part-way through a later save: `latest` stays on the last good checkpoint


def enospc(path: str = "") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([path] if path else []))


def fill_in_dcp_shards(monkeypatch, folder: Path) -> None:
    """DCP's fsync of its shard fails (the first fsync of a save)."""

    def fsync(fd):
        raise enospc()

    monkeypatch.setattr(os, "fsync", fsync)


def fill_in_dcp_metadata(monkeypatch, folder: Path) -> None:
    """DCP's writer has written the shards and half of `.metadata.tmp` when the disk is full."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def finish(self, metadata, results):
        with open(os.path.join(str(self.path), ".metadata.tmp"), "wb") as f:
            f.write(b"\x80\x04half")
        raise enospc()

    monkeypatch.setattr(FileSystemWriter, "finish", finish)


def fill_in_the_manifest(monkeypatch, folder: Path) -> None:
    """The manifest's temporary file is half written when the disk is full."""
    real = ck._atomic_text

    def atomic(path: str, text: str) -> None:
        if path.endswith(ck.MANIFEST):
            with open(path + ".tmp0", "w") as f:
                f.write(text[: len(text) // 2])
            raise enospc(path)
        real(path, text)

    monkeypatch.setattr(ck, "_atomic_text", atomic)


def lose_a_shards_tail(monkeypatch, folder: Path) -> None:
    """The manifest is written, then a shard reads back shorter than it was digested (a disk that dropped
    its tail): the check before `latest` moves catches it."""
    real = ck.write_manifest

    def write(path: str, *a) -> None:
        real(path, *a)
        shard = sorted(Path(path).glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:10])

    monkeypatch.setattr(ck, "write_manifest", write)


def fill_at_the_folders_sync(monkeypatch, folder: Path) -> None:
    """The new checkpoint is renamed into place, but the folder's sync (making that durable) fails."""
    real = os.fsync

    def fsync(fd):
        if os.path.samefile(f"/proc/self/fd/{fd}", folder):
            raise enospc()
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def fill_in_latest(monkeypatch, folder: Path) -> None:
    """`latest`'s temporary file cannot be synced."""
    real = os.fsync

    def fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("latest.tmp"):
            raise enospc()
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


FULL = {
    "writing DCP's shards": (fill_in_dcp_shards, "No space left on device"),
    "writing DCP's .metadata": (fill_in_dcp_metadata, "No space left on device"),
    "writing the manifest": (fill_in_the_manifest, "No space left on device"),
    "a shard that reads back short": (
        lose_a_shards_tail,
        "it does not read back as written (__0_0.distcp: 10 bytes, the manifest says",
    ),
    "syncing the folder": (fill_at_the_folders_sync, "No space left on device"),
    "writing latest": (fill_in_latest, "No space left on device"),
}


@pytest.mark.parametrize("when", FULL)
def test_a_disk_full_part_way_through_a_later_save_leaves_latest_on_the_last_good_step(folder, monkeypatch, when):
    fill, why = FULL[when]
    shutil.rmtree(folder / "step-000002")
    ck._atomic_text(str(folder / "latest"), f"step-000001\nrun {RUN}\n")
    r = runner()
    train(r)
    train(r)
    fill(monkeypatch, folder)
    with pytest.raises(PipelineError) as e:
        ck.save(str(folder), r, 2, RUN)
    monkeypatch.undo()
    text = str(e.value)
    assert text.startswith(f"cannot save the checkpoint of step 2 in {folder}: {why}"), text
    assert text.endswith(f"; the previous checkpoint {folder / 'step-000001'} is intact"), text
    assert sorted(os.listdir(folder)) == ["latest", "step-000001"]  # no newer folder, no partial one
    assert ck.read_latest(str(folder)) == ("step-000001", RUN)
    assert ck.prepare(str(folder), runner(seed=1), resume=True).restored == ck.Restored(
        1, str(folder / "step-000001"), ()
    )


def test_a_failed_save_over_an_earlier_runs_checkpoint_of_the_same_step_puts_it_back(folder, monkeypatch):
    before = {p.name: p.read_bytes() for p in (folder / "step-000002").iterdir()}
    ck._atomic_text(str(folder / "latest"), f"step-000001\nrun {RUN}\n")
    r = runner(seed=3)
    train(r)
    fill_in_latest(monkeypatch, folder)
    with pytest.raises(PipelineError, match="No space left on device"):
        ck.save(str(folder), r, 2, "run-b")
    monkeypatch.undo()
    assert sorted(os.listdir(folder)) == ["latest", "step-000001", "step-000002"]
    assert {p.name: p.read_bytes() for p in (folder / "step-000002").iterdir()} == before


def unseal_metadata(step: Path) -> None:
    """A checkpoint whose manifest, sealed, lists no `.metadata` (and the file is gone): DCP's metadata was
    never written, the rest is."""
    import hashlib
    import json

    body = json.loads((step / ck.MANIFEST).read_text())
    del body["sha256"], body["files"][ck.METADATA]
    body["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (step / ck.MANIFEST).write_text(json.dumps(body))
    (step / ck.METADATA).unlink()


INCOMPLETE = {
    "no .metadata, none listed": (unseal_metadata, ".metadata: not in the manifest (DCP's metadata was never written"),
    "no .metadata, listed": (lambda s: (s / ck.METADATA).unlink(), ".metadata: missing (the manifest lists it)"),
    "no manifest": (lambda s: (s / ck.MANIFEST).unlink(), f"no {ck.MANIFEST}: its save did not finish"),
}


@pytest.mark.parametrize("case", INCOMPLETE)
def test_latest_naming_an_incomplete_step_falls_back_to_the_newest_complete_one_saying_why(saved, folder, case):
    damage, why = INCOMPLETE[case]
    damage(folder / "step-000002")
    r = runner(seed=1)
    restored = ck.prepare(str(folder), r, resume=True).restored
    assert restored.step == 1 and restored.path == str(folder / "step-000001")
    (line,) = restored.skipped
    assert line.startswith(f"skipped {folder / 'step-000002'}: {why}"), line
    assert all(torch.equal(saved[1][1][k], v) for k, v in weights(r).items())


def test_latest_naming_an_incomplete_step_and_no_complete_one_says_exactly_what_is_wrong(folder):
    unseal_metadata(folder / "step-000002")
    (folder / "step-000001" / ck.MANIFEST).unlink()
    with pytest.raises(PipelineError) as e:
        ck.prepare(str(folder), runner(seed=1), resume=True)
    assert str(e.value) == (
        f"no checkpoint in {folder} verifies, so --resume cannot continue:\n"
        f"  skipped {folder / 'step-000002'}: {INCOMPLETE['no .metadata, none listed'][1]}: a save that did not "
        "finish)\n"
        f"  skipped {folder / 'step-000001'}: no {ck.MANIFEST}: its save did not finish, or it is not a pipec "
        "checkpoint\n"
        "move them away to start from step 0"
    )


# ---------------------------------------------------------------------------------------------------------
# c. FIFOs and links to devices: never opened, a message at once


def promptly(fn):
    """fn() in a thread, its result or exception; fails (never hangs the suite) when it blocks, as opening
    a FIFO without a writer does."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "blocked on a file that is not a regular one"
    if "error" in out:
        raise out["error"]
    return out["value"]


def fifo(p: Path) -> None:
    p.unlink(missing_ok=True)
    os.mkfifo(p)


def link(target: str):
    def make(p: Path) -> None:
        p.unlink(missing_ok=True)
        p.symlink_to(target)

    return make


NOT_REGULAR = {
    "a FIFO": (fifo, "a FIFO (named pipe), not a regular file: never opened"),
    "a link to /dev/zero": (link("/dev/zero"), "a link to /dev/zero, a character device, not a regular file"),
    "a link to /dev/null": (link("/dev/null"), "a link to /dev/null, a character device, not a regular file"),
}


@pytest.mark.parametrize("kind", NOT_REGULAR)
def test_latest_that_is_not_a_regular_file_is_a_message_at_once(folder, kind):
    make, what = NOT_REGULAR[kind]
    make(folder / "latest")
    with pytest.raises(PipelineError) as e:
        promptly(lambda: ck.prepare(str(folder), runner(seed=1), resume=True))
    assert str(e.value).startswith(f"{folder / 'latest'}: cannot be read ({what}"), str(e.value)
    assert "remove" in str(e.value)


@pytest.mark.parametrize("kind", NOT_REGULAR)
@pytest.mark.parametrize("name", [ck.MANIFEST, ck.METADATA, "__0_0.distcp"])
def test_a_checkpoint_file_that_is_not_a_regular_one_is_skipped_at_once_saying_what_it_is(saved, folder, name, kind):
    make, what = NOT_REGULAR[kind]
    target = folder / "step-000002" / name
    assert target.is_file()
    make(target)
    r = runner(seed=1)
    restored = promptly(lambda: ck.prepare(str(folder), r, resume=True)).restored
    assert restored.step == 1, restored
    (line,) = restored.skipped
    assert line.startswith(f"skipped {folder / 'step-000002'}: "), line
    assert what in line and name in line, line
    assert all(torch.equal(saved[1][1][k], v) for k, v in weights(r).items())


def test_every_checkpoint_holding_a_device_is_a_message_at_once(folder):
    for step in ("step-000001", "step-000002"):
        link("/dev/zero")(folder / step / ck.MANIFEST)
    with pytest.raises(PipelineError) as e:
        promptly(lambda: ck.prepare(str(folder), runner(seed=1), resume=True))
    assert str(e.value).startswith(f"no checkpoint in {folder} verifies"), str(e.value)
    assert str(e.value).count("a link to /dev/zero, a character device") == 2


def test_leftover_fifos_never_block_a_save(folder):
    """A FIFO where a save writes its temporary `latest`, or named like a partial folder, is removed."""
    fifo(folder / f"latest.tmp{os.getpid()}")
    fifo(folder / "step-000009.partial")
    r = runner()
    train(r)
    assert promptly(lambda: ck.save(str(folder), r, 3, RUN)) == str(folder / "step-000003")
    assert sorted(os.listdir(folder)) == ["latest", "step-000001", "step-000002", "step-000003"]
    assert ck.read_latest(str(folder)) == ("step-000003", RUN)
    assert promptly(lambda: ck.prepare(str(folder), runner(seed=1), resume=True)).restored.step == 3
