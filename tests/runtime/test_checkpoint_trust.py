"""Checkpoints you can trust (issue 32, item 1): hostile checkpoint folders give a message, never a
traceback, a hang or a silently different run.

Most cases run in this one process: a tiny two-stage model is saved three times with
pipec.runtime.job.checkpoint.save (DCP in a single process), the folder is copied and damaged, and
`prepare` (what every rank runs before its first step) must resume from the newest checkpoint that
verifies, saying why it skipped the others, or refuse with a PipelineError naming the file. Two
multi-process jobs (tests/support/runtime_harness.py's fork server) check what only a job shows: a flipped byte
and a stale shard fall back to the last good checkpoint with losses bitwise equal to the uninterrupted
run, and a checkpoint of another model is refused on every rank."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as hs

torch = pytest.importorskip("torch")

from pipec.runtime.errors import PipelineError  # noqa: E402
from pipec.runtime.job import checkpoint as ck  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


RUN = "run-a"  # the run id of the saved folder's checkpoints


def runner(width: int = 4, depth: int = 2, stages: int = 2, seed: int = 0) -> SimpleNamespace:
    """What `save` and `prepare` read of a Runner: one process holding every stage, each an Adam-trained
    stack of `depth` Linear(width, width) layers."""
    torch.manual_seed(seed)
    held = {}
    for s in range(stages):
        m = torch.nn.Sequential(*[torch.nn.Linear(width, width, dtype=torch.float64) for _ in range(depth)])
        held[s] = SimpleNamespace(module=m, optimizer=torch.optim.Adam(m.parameters(), lr=0.1))
    return SimpleNamespace(program=SimpleNamespace(num_stages=stages, name="1f1b"), stages=held, rank=0, steps_done=0)


def train(r: SimpleNamespace) -> None:
    for st in r.stages.values():
        st.optimizer.zero_grad()
        st.module(torch.ones(1, st.module[0].in_features, dtype=torch.float64)).sum().backward()
        st.optimizer.step()


def params(r: SimpleNamespace) -> dict:
    return {f"{s}.{n}": p.detach().clone() for s, st in r.stages.items() for n, p in st.module.named_parameters()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A folder with checkpoints after steps 1, 2 and 3, and the parameters at each."""
    folder = tmp_path_factory.mktemp("saved") / "ck"
    r, at = runner(), {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (1, 2, 3):
            train(r)
            assert ck.save(str(folder), r, step, RUN) == str(folder / f"step-{step:06d}")
            at[step] = params(r)
    return folder, at


@pytest.fixture
def folder(saved, tmp_path) -> Path:
    copy = tmp_path / "ck"
    shutil.copytree(saved[0], copy, symlinks=True)
    return copy


def resume(folder: Path, **kw) -> tuple[ck.Restored | None, SimpleNamespace]:
    r = runner(seed=1, **kw)
    start = ck.prepare(str(folder), r, resume=True)
    if start.restored is not None:
        assert start.run == RUN  # a resumed job continues its checkpoint's run
    return start.restored, r


def refused(folder: Path, resume_: bool = True, **kw) -> str:
    with pytest.raises(PipelineError) as e:
        ck.prepare(str(folder), runner(seed=1, **kw), resume=resume_)
    return str(e.value)


def shard(path: Path) -> Path:
    return sorted(path.glob("*.distcp"))[0]


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_an_intact_folder_resumes_its_newest_checkpoint_exactly(saved, folder):
    restored, r = resume(folder)
    assert restored == ck.Restored(3, str(folder / "step-000003"), ())
    assert r.steps_done == 3
    want = saved[1][3]
    assert all(torch.equal(want[k], v) for k, v in params(r).items()) and want.keys() == params(r).keys()
    manifest = json.loads((folder / "step-000003" / ck.MANIFEST).read_text())
    assert set(manifest["files"]) == {".metadata", shard(folder / "step-000003").name}
    assert manifest["stages"]["1"]["1.weight"] == [4, 4] and manifest["step"] == 3


def test_no_folder_or_an_empty_one_starts_from_step_0_and_the_folder_is_made(tmp_path):
    first = ck.prepare(str(tmp_path / "new" / "ck"), runner(), resume=True)
    assert first.restored is None and (tmp_path / "new" / "ck").is_dir()
    again = ck.prepare(str(tmp_path / "new" / "ck"), runner(), resume=False)
    assert again.restored is None and again.run != first.run  # each job started afresh is a run of its own


def stale_from_older_save(f: Path) -> None:
    shutil.copy(shard(f.parent / "step-000001"), shard(f))


def stale_extra_shard(f: Path) -> None:
    shutil.copy(shard(f), f / "__7_0.distcp")


def truncate(f: Path) -> None:
    p = shard(f)
    p.write_bytes(p.read_bytes()[:100])


def edit_manifest(f: Path) -> None:
    (f / ck.MANIFEST).write_text((f / ck.MANIFEST).read_text().replace('"step": 3', '"step": 4'))


def reseal_other_step(f: Path) -> None:
    body = json.loads((f / ck.MANIFEST).read_text())
    body.pop("sha256")
    body["step"] = 2
    body["sha256"] = ck._sealed(body)
    (f / ck.MANIFEST).write_text(json.dumps(body))


DAMAGE = {
    "flipped byte": (lambda f: flip(shard(f)), r"__0_0\.distcp: its sha256 differs from the manifest's"),
    "stale shard from an older save": (stale_from_older_save, r"__0_0\.distcp: .*(bytes|sha256)"),
    "stale extra shard": (stale_extra_shard, r"__7_0\.distcp: not written by this checkpoint's save"),
    "shard deleted": (lambda f: shard(f).unlink(), r"__0_0\.distcp: missing"),
    "metadata deleted": (lambda f: (f / ".metadata").unlink(), r"\.metadata: missing"),
    "shard truncated": (truncate, r"__0_0\.distcp: 100 bytes, the manifest says \d+"),
    "shard empty": (lambda f: shard(f).write_bytes(b""), r"__0_0\.distcp: 0 bytes"),
    "metadata empty": (lambda f: (f / ".metadata").write_bytes(b""), r"\.metadata: 0 bytes"),
    "manifest deleted": (lambda f: (f / ck.MANIFEST).unlink(), r"no pipec-manifest\.json: its save did not finish"),
    "manifest empty": (lambda f: (f / ck.MANIFEST).write_bytes(b""), r"pipec-manifest\.json: not JSON"),
    "manifest not UTF-8": (lambda f: (f / ck.MANIFEST).write_bytes(b"\xff\xfe"), r"pipec-manifest\.json: not JSON"),
    "manifest edited": (edit_manifest, r"differs from its own digest"),
    "manifest of another step": (reseal_other_step, r"records step 2, but the folder is step-000003"),
    "manifest a folder": (
        lambda f: ((f / ck.MANIFEST).unlink(), (f / ck.MANIFEST).mkdir()),
        r"pipec-manifest\.json: cannot be read",
    ),
    "checkpoint a file": (lambda f: (shutil.rmtree(f), f.write_text("x")), r"step-000003: not a folder"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_skipped_with_its_reason_and_the_previous_one_resumes(saved, folder, damage):
    how, reason = DAMAGE[damage]
    how(folder / "step-000003")
    restored, r = resume(folder)
    assert restored is not None and restored.step == 2 and restored.path == str(folder / "step-000002")
    (line,) = restored.skipped
    assert line.startswith(f"skipped {folder / 'step-000003'}") and re.search(reason, line), line
    assert all(torch.equal(saved[1][2][k], v) for k, v in params(r).items())


def test_every_damaged_checkpoint_is_skipped_and_none_left_is_a_message(folder):
    flip(shard(folder / "step-000003"))
    stale_extra_shard(folder / "step-000002")
    restored, _ = resume(folder)
    assert restored.step == 1 and len(restored.skipped) == 2, restored
    (folder / "step-000001" / ".metadata").unlink()
    text = refused(folder)
    assert text.startswith(f"no checkpoint in {folder} verifies, so --resume cannot continue:")
    assert "step-000003: __0_0.distcp: its sha256" in text and "step-000001: .metadata: missing" in text


def test_a_checkpoint_of_an_older_pipec_without_a_manifest_is_skipped(folder):
    (folder / "step-000003" / ck.MANIFEST).unlink()
    restored, _ = resume(folder)
    assert restored.step == 2 and "no pipec-manifest.json" in restored.skipped[0]


@pytest.mark.parametrize(
    "other, want",
    [
        (dict(width=8), r"stage 0's parameter `0.bias` is \[4\] there, \[8\] here \(and 3 more\)"),
        (dict(depth=3), r"stage 0's parameter `2.bias` \[4\] is not in the checkpoint \(and 1 more\)"),
        (dict(depth=1), r"stage 0's parameter `1.bias` \[4\] of the checkpoint is not in this model"),
        (dict(stages=3), r"holds 2 stages \(schedule `1f1b`\), but this program has 3"),
    ],
)
def test_a_checkpoint_of_another_model_width_depth_or_stages_is_refused(folder, other, want):
    text = refused(folder, **other)
    assert re.search(want, text), text
    if "stages" not in other:
        assert text.startswith(f"{folder / 'step-000003'} was written for another model:")


def test_latest_bounds_the_choice_and_a_newest_checkpoint_deleted_outright_is_said(folder):
    (folder / "latest").write_text("step-000002\n")  # an earlier run's step 3, or a save that ended before latest
    restored, _ = resume(folder)
    assert restored.step == 2 and restored.skipped[0].startswith(
        f"skipped {folder / 'step-000003'}: newer than step-000002, which latest names"
    )
    (folder / "latest").write_text("step-000009\n")
    restored, _ = resume(folder)
    assert restored.step == 3 and restored.skipped == (f"skipped {folder / 'step-000009'} (named by latest): missing",)
    (folder / "latest").unlink()  # no latest: the newest that verifies
    assert resume(folder)[0] == ck.Restored(3, str(folder / "step-000003"), ())


def test_a_run_started_afresh_in_the_folder_never_resumes_the_earlier_runs_checkpoints(folder):
    """Run B starts from step 0 (no --resume) in run A's folder and saves step 2 only: a resume takes B's
    step 2, never A's later step 3, and when B's step 2 is damaged it does not fall back to A's step 1."""
    r = runner(seed=5)
    start = ck.prepare(str(folder), r, resume=False)
    assert start.restored is None and start.run != RUN
    train(r)
    train(r)
    ck.save(str(folder), r, 2, start.run)
    restored, again = resume_as(folder, start.run)
    assert restored.step == 2 and "step-000003: newer than step-000002" in restored.skipped[0]
    assert all(torch.equal(p, q) for p, q in zip(params(again).values(), params(r).values(), strict=True))
    flip(shard(folder / "step-000002"))
    text = refused(folder)
    assert f"skipped {folder / 'step-000001'}: written by another run than step-000002 (one started afresh" in text
    (folder / "step-000002" / ck.MANIFEST).write_bytes(b"")  # B's lineage now only in latest
    assert (folder / "latest").read_text() == f"step-000002\nrun {start.run}\n"
    text = refused(folder)
    assert f"skipped {folder / 'step-000001'}: written by another run than step-000002 (one started afresh" in text


def resume_as(folder: Path, run: str) -> tuple[ck.Restored | None, SimpleNamespace]:
    r = runner(seed=1)
    start = ck.prepare(str(folder), r, resume=True)
    assert start.run == run
    return start.restored, r


LATEST = {
    "a folder": (lambda p: p.mkdir(), "is a folder: a save could not record its checkpoint there"),
    "not UTF-8": (lambda p: p.write_bytes(b"step-\xff\n"), "not UTF-8 text, so it names no checkpoint"),
    "..": (lambda p: p.write_text("..\n"), "names '..', not a checkpoint of this folder"),
    "a path": (lambda p: p.write_text("/etc\n"), "names '/etc', not a checkpoint of this folder"),
    "a symlink loop": (lambda p: p.symlink_to(p.name), "cannot be read (Too many levels of symbolic links"),
    "three lines": (lambda p: p.write_text("step-000003\nrun a\nrun b\n"), "not what a save writes"),
    "a second line that is no run": (lambda p: p.write_text("step-000003\nstep-000002\n"), "not what a save writes"),
}


@pytest.mark.parametrize("case", LATEST)
def test_a_damaged_latest_is_a_message_naming_it(folder, case):
    make, want = LATEST[case]
    (folder / "latest").unlink()
    make(folder / "latest")
    text = refused(folder)
    assert text.startswith(str(folder / "latest")) and want in text, text
    if case == "a folder":  # without --resume too: the first save could not replace it
        assert want in refused(folder, resume_=False)


def test_a_folder_that_cannot_take_checkpoints_is_a_message_before_any_step(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    assert (
        refused(tmp_path / "file")
        == f"--checkpoint {tmp_path / 'file'}: not a folder (a file of that name exists); name a folder"
    )
    text = refused(tmp_path / "file" / "ck", resume_=False)
    assert text == f"--checkpoint {tmp_path / 'file' / 'ck'}: a part of its path is a file, not a folder"
    text = refused(tmp_path / "file" / "a" / "ck")
    assert text == f"--checkpoint {tmp_path / 'file' / 'a' / 'ck'}: a part of its path is a file, not a folder"
    (tmp_path / "loop").symlink_to("loop")
    text = refused(tmp_path / "loop")
    assert "--checkpoint" in text and "cannot be used as a folder (Too many levels of symbolic links" in text
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: the file system's refusal is simulated
        real = os.open

        def deny(path, *a, **kw):
            if str(path).startswith(str(ro)):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return real(path, *a, **kw)

        monkeypatch.setattr(os, "open", deny)
    text = refused(ro, resume_=False)
    assert text.startswith(f"--checkpoint {ro}: checkpoints cannot be written there (Permission denied"), text


def test_a_name_that_is_not_utf8_is_saved_resumed_and_printed(tmp_path):
    folder = os.path.join(os.fsdecode(bytes(tmp_path)), os.fsdecode(b"ck\xff"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = ck.save(folder, runner(), 1, RUN)
    assert path == f"{tmp_path}/ck\\xff/step-000001"
    path.encode("utf-8")  # printable
    restored, _ = resume(Path(folder))
    assert restored.step == 1 and restored.path == path


def full_disk_at(monkeypatch, call: int) -> None:
    """os.fsync (DCP's and the manifest's) fails with ENOSPC from its `call`-th use on."""
    real, calls = os.fsync, [0]

    def fsync(fd):
        calls[0] += 1
        if calls[0] >= call:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_full_disk_at_the_first_save_stops_with_a_message_and_leaves_nothing(tmp_path, monkeypatch):
    full_disk_at(monkeypatch, 1)
    with pytest.raises(PipelineError) as e:
        ck.save(str(tmp_path), runner(), 1, RUN)
    assert str(e.value) == (
        f"cannot save the checkpoint of step 1 in {tmp_path}: No space left on device; "
        "no earlier checkpoint was touched"
    )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("when", ["writing the shards", "writing the manifest"])
def test_a_full_disk_at_the_third_save_leaves_the_previous_checkpoint_intact(folder, monkeypatch, when):
    shutil.rmtree(folder / "step-000003")
    (folder / "latest").write_text("step-000002\n")
    r = runner()
    train(r)
    full_disk_at(monkeypatch, 1 if when == "writing the shards" else 2)  # DCP fsyncs its one shard first
    with pytest.raises(PipelineError) as e:
        ck.save(str(folder), r, 3, RUN)
    assert str(e.value) == (
        f"cannot save the checkpoint of step 3 in {folder}: No space left on device; "
        f"the previous checkpoint {folder / 'step-000002'} is intact"
    )
    monkeypatch.undo()
    assert sorted(os.listdir(folder)) == ["latest", "step-000001", "step-000002"]
    assert (folder / "latest").read_text() == "step-000002\n"
    assert resume(folder)[0] == ck.Restored(2, str(folder / "step-000002"), ())


def test_a_save_over_a_damaged_checkpoint_of_the_same_step_replaces_it(saved, folder):
    flip(shard(folder / "step-000003"))
    restored, r = resume(folder)
    assert restored.step == 2
    train(r)
    ck.save(str(folder), r, 3, RUN)
    assert not list(folder.glob("*.partial"))
    assert ck.verify(str(folder / "step-000003")).step == 3


def test_partial_folders_are_removed_before_any_step(folder):
    (folder / "step-000004.partial").mkdir()
    (folder / "step-000004.partial" / "__0_0.distcp").write_text("half")
    assert resume(folder)[0].step == 3
    assert not list(folder.glob("*.partial"))


# ---------------------------------------------------------------------------------------------------------
# Fuzzing: a checkpoint folder damaged at random, as a crash, a full disk, a hand edit or a merge of two
# folders would leave it. Whatever was done, --resume either refuses with a PipelineError or resumes the
# newest checkpoint whose files are all as saved, with the parameters of exactly that step.


def _entries(root: Path) -> list[str]:
    """Every file, folder and link under `root` (links not followed), relative, `root` itself as ''."""
    out = [""]
    for here, dirs, files in os.walk(root):
        rel = os.path.relpath(here, root)
        out += [os.path.normpath(os.path.join(rel, n)) for n in dirs + files]
    return sorted(set(out))


def _snapshot(folder: Path) -> dict[int, dict[str, bytes]]:
    """step -> {file name: content} of every step folder as saved."""
    return {
        int(d.name.removeprefix("step-")): {f.name: f.read_bytes() for f in d.iterdir()}
        for d in folder.iterdir()
        if d.name.startswith("step-")
    }


def _as_saved(folder: Path, step: int, files: dict[str, bytes]) -> bool:
    """Whether step's folder holds exactly its saved files, each with its saved content (links followed)."""
    d = folder / f"step-{step:06d}"
    try:
        return d.is_dir() and {f.name: f.read_bytes() for f in d.iterdir()} == files
    except OSError:
        return False


def _damage(root: Path, data, times: int) -> bool:
    """Apply `times` random damages under `root`; whether `latest` was touched (other than deleted)."""
    touched_latest = False
    for _ in range(times):
        if not os.path.lexists(root):
            break
        entries = _entries(root)
        files = [e for e in entries if e.startswith("step-") and os.path.isfile(root / e)]
        rel = data.draw(hs.sampled_from(files) if files and data.draw(hs.booleans()) else hs.sampled_from(entries))
        p = root / rel if rel else root
        how = data.draw(
            hs.sampled_from(
                [
                    "flip",
                    "flip",
                    "truncate",
                    "delete",
                    "truncate",
                    "flip",
                    "append",
                    "random",
                    "folder",
                    "loop",
                    "dangling",
                    "copy",
                    "rename",
                    "partial",
                    "stray",
                ]
            ),
        )
        is_file = p.is_file() and not p.is_symlink()
        if how in ("truncate", "flip", "append") and not is_file:
            how = "random"
        if rel == "latest" and how != "delete":
            touched_latest = True
        if how == "delete":
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            continue
        if how == "truncate":
            n = len(p.read_bytes())
            p.write_bytes(p.read_bytes()[: data.draw(hs.integers(0, max(n - 1, 0)), label="length")])
        elif how == "flip":
            raw = bytearray(p.read_bytes())
            if raw:
                raw[data.draw(hs.integers(0, len(raw) - 1), label="at")] ^= 1 << data.draw(hs.integers(0, 7))
            p.write_bytes(bytes(raw))
        elif how == "append":
            with open(p, "ab") as f:
                f.write(data.draw(hs.binary(min_size=1, max_size=16), label="tail"))
        elif how in ("partial", "stray"):
            parent = p if p.is_dir() and not p.is_symlink() else p.parent
            name = (
                "step-000009.partial"
                if how == "partial"
                else data.draw(
                    hs.sampled_from(["step-000004", "step-1", "x", "__0_0.distcp", "latest.tmp"]), label="name"
                )
            )
            if not os.path.lexists(parent / name):
                (parent / name).write_bytes(data.draw(hs.binary(max_size=32), label="stray"))
        else:
            copy_of = data.draw(hs.sampled_from(_entries(root)), label="source") if how == "copy" else None
            src = root / copy_of if copy_of else None
            if how == "rename" and p != root and p.name.startswith("step-"):
                target = p.parent / f"step-{data.draw(hs.integers(1, 5), label='step'):06d}"
                if not os.path.lexists(target):
                    p.rename(target)
                continue
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            if how == "random":
                p.write_bytes(data.draw(hs.binary(max_size=64), label="bytes"))
            elif how == "folder":
                p.mkdir()
            elif how == "loop":
                p.symlink_to(p.name)
            elif how == "dangling":
                p.symlink_to("no-such-file")
            elif src is not None and src.is_file() and src != p:
                shutil.copy(src, p)  # a stale file from another place of the folder
            else:
                p.write_bytes(b"")
    return touched_latest


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(hs.data(), hs.integers(1, 3))
def test_a_randomly_damaged_folder_resumes_its_newest_checkpoint_as_saved_or_is_refused(saved, data, times):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ck"
        shutil.copytree(saved[0], folder, symlinks=True)
        as_saved = _snapshot(folder)
        touched_latest = _damage(folder, data, times)
        intact = [s for s, files in as_saved.items() if _as_saved(folder, s, files)]
        r = runner(seed=1)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                start = ck.prepare(str(folder), r, resume=True)
        except PipelineError as e:
            event("refused")
            assert str(e).strip(), "an empty message"
            if not touched_latest and folder.is_dir() and not folder.is_symlink():
                assert not intact, f"refused ({e}) although step {max(intact)} is as saved"
            return
        restored = start.restored
        if restored is None:  # nothing to resume: only when no checkpoint is left
            assert not any(n.startswith("step-") and not n.endswith(".partial") for n in os.listdir(folder))
            return
        event(f"resumed step {restored.step}" + (" past a damaged newer one" if restored.skipped else ""))
        assert _as_saved(folder, restored.step, as_saved[restored.step]), "resumed a checkpoint not as saved"
        want = saved[1][restored.step]
        got = params(r)
        assert got.keys() == want.keys() and all(torch.equal(want[k], got[k]) for k in want)
        if not touched_latest:
            assert restored.step == max(intact), (restored, intact)


# ---------------------------------------------------------------------------------------------------------
# Jobs: two ranks through pipec.runtime.job.launch, as `pipec run --nproc 2` starts them

MLP = {"MLP_DEPTH": "4", "MLP_WIDTH": "16", "MLP_BATCH": "8"}
MODEL = ["-D", "p=2", "-D", "m=2", "--model", "examples/mlp.py"]


def job(*args: str, env: dict[str, str] = MLP):
    from runtime_harness import launch

    results, _, _ = launch(2, "launch", ["1f1b", *MODEL, *args], env=env, timeout=120.0)
    return results


def losses(records: Path) -> dict[int, float]:
    """Each step's loss as rank 0 recorded it (JSON: the float64 itself, not the 6 digits printed)."""
    from pipec.runtime.job.report import read_records

    return {s["step"]: s["loss"] for s in read_records(str(records))["steps"]}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    folder, records = tmp / "ck", tmp / "records.jsonl"
    r = job("--steps", "3", "--checkpoint", str(folder), "--checkpoint-every", "1", "--records", str(records))
    assert all(x.returncode == 0 for x in r), [x.stderr for x in r]
    return folder, losses(records)


def test_job_a_flipped_byte_and_a_stale_shard_fall_back_to_the_last_good_checkpoint_bitwise(straight, tmp_path):
    folder, want = straight
    assert sorted(want) == [1, 2, 3]
    copy = tmp_path / "ck"
    shutil.copytree(folder, copy)
    flip(sorted((copy / "step-000003").glob("__1_*.distcp"))[0])  # rank 1's weights
    shutil.copy(shard(copy / "step-000001"), shard(copy / "step-000002"))  # a stale shard from the older save
    r = job("--steps", "3", "--checkpoint", str(copy), "--resume", "--records", str(tmp_path / "records.jsonl"))
    assert all(x.returncode == 0 for x in r), [x.stderr for x in r]
    out = r[0].stdout
    assert re.search(rf"^skipped {copy}/step-000003: __1_0\.distcp: its sha256 differs", out, re.M), out
    assert re.search(rf"^skipped {copy}/step-000002: __0_0\.distcp: ", out, re.M), out
    assert f"resumed from {copy}/step-000001: steps 2 to 3" in out
    assert losses(tmp_path / "records.jsonl") == {2: want[2], 3: want[3]}  # float64s, equal bit for bit
    assert ck.verify(str(copy / "step-000003")).step == 3  # the damaged ones were replaced by good saves


def test_job_a_checkpoint_of_another_model_is_refused_on_every_rank_before_any_step(straight):
    folder, _ = straight
    r = job("--steps", "4", "--checkpoint", str(folder), "--resume", env=dict(MLP, MLP_WIDTH="32"))
    want = f"{folder}/step-000003 was written for another model: stage "
    assert all(x.returncode != 0 for x in r)
    assert all(want in x.stderr and "Traceback" not in x.stderr for x in r), [x.stderr for x in r]
    assert all("step 1/" not in x.stdout for x in r)


FAULTY = ["-D", "p=2", "-D", "m=2", "--model", "tests/models/faulty.py"]


def test_job_a_full_disk_on_every_rank_at_the_second_save_stops_all_and_keeps_the_first(tmp_path):
    """Both ranks' writes fail (ENOSPC) at the save after step 2: every rank stops with the message, the
    checkpoint of step 1 stays the newest and intact, and a resume from it trains steps 2 and 3 to the
    losses of a run that never stopped, bit for bit."""
    from runtime_harness import launch

    def run(folder: Path, records: Path, *args: str, env: dict[str, str] | None = None):
        argv = ["1f1b", *FAULTY, "--steps", "3", "--checkpoint", str(folder), "--records", str(records), *args]
        return launch(2, "launch", argv, env=env, timeout=120.0)[0]

    straight = run(tmp_path / "straight", tmp_path / "straight.jsonl", "--checkpoint-every", "3")
    assert all(x.returncode == 0 for x in straight), [x.stderr for x in straight]
    folder = tmp_path / "ck"
    full = run(
        folder,
        tmp_path / "full.jsonl",
        "--checkpoint-every",
        "1",
        env={"PIPEC_FAULT": "enospc-at-save", "PIPEC_FAULT_CALL": "1"},
    )
    want = (
        f"cannot save the checkpoint of step 2 in {folder}: No space left on device; "
        f"the previous checkpoint {folder / 'step-000001'} is intact"
    )
    assert all(x.returncode != 0 and want in x.stderr and "Traceback" not in x.stderr for x in full), [
        x.stderr for x in full
    ]
    assert sorted(os.listdir(folder)) == ["latest", "step-000001"]
    assert ck.verify(str(folder / "step-000001")).step == 1
    resumed = run(folder, tmp_path / "resumed.jsonl", "--resume")
    assert all(x.returncode == 0 for x in resumed), [x.stderr for x in resumed]
    assert f"resumed from {folder}/step-000001: steps 2 to 3" in resumed[0].stdout
    want_losses = losses(tmp_path / "straight.jsonl")
    assert losses(tmp_path / "resumed.jsonl") == {2: want_losses[2], 3: want_losses[3]}
