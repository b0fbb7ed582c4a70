"""Checkpoints of a pipeline job with torch.distributed.checkpoint (DCP): complete and verified, or not used.

Layout of a checkpoint folder DIR:

    DIR/step-000010/                  one checkpoint, after 10 steps:
        .metadata, __0_0.distcp, ...  DCP's files: every rank's stages (parameters and optimizer state,
                                      keyed by stage and parameter name), each rank's RNG state, the step
        pipec-manifest.json           written last: the size and sha256 of each of those files, the model's
                                      structure (each stage's parameter names and shapes), the schedule,
                                      the step, the run id, and a sha256 of its own
    DIR/latest                        the name of the newest complete checkpoint ("step-000010") and, on
                                      a second line, its run id ("run 3f2a..."): the lineage stays known
                                      even when that checkpoint's manifest is damaged

A save writes `step-N.partial` (all ranks, collectively), waits for every rank, then rank 0 digests every
file in it, writes the manifest, checks that it reads back (DCP's `.metadata` among its files, each file
there at its size), renames the folder to `step-N`, syncs the folder and only then replaces `latest`: a
checkpoint is visible only once complete, and it is complete only with its manifest. A job killed during
a save leaves the previous checkpoint as it was; a save that fails anywhere (a full disk) stops the run
with a message, removes what it wrote and leaves `latest` on the last good checkpoint. Partial folders are
removed by the next save, or by a resume that is going to save.

The folder is checked writable before any step only when the run is going to save (`prepare`'s `until`): a
resume with no step left reads a read-only folder. Nothing in it is opened that is not a regular file or a
link to one (`_open_regular`): a FIFO or a link to a device is said at once, never read.

`--resume` trusts content, not names: rank 0 verifies the checkpoints newest first (the manifest's own
digest, exactly its files, each file's size and sha256) and resumes from the newest that verifies, saying
why it skipped each newer one (a flipped byte, a stale or missing shard, a save that never finished).
`latest` bounds the choice, and the manifests' run ids keep it within one training run (a job started
afresh in the folder is a new run; a resumed one continues its checkpoint's).
Every rank then checks its own stages' parameter names and shapes against the manifest: a checkpoint of
another model, width or depth is refused on every rank, naming the difference, before any step. Ranks
agree on every verdict (rank 0 decides and broadcasts; per-rank checks are gathered), so none hangs.

Keys name stages, not ranks, so a checkpoint taken under one schedule resumes under any schedule with the
same stages. Training is deterministic given the step (the model file's `batch(step)` gives the data of
each step), so the step is the data position. DIR must be one folder that every rank can read and write
(a shared file system across nodes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipec.runtime.errors import PipelineError
from pipec.runtime.job.durable import atomic_text as _atomic_text
from pipec.runtime.job.durable import digest as _digest
from pipec.runtime.job.durable import fsync_dir as _fsync_dir
from pipec.runtime.job.durable import open_regular as _open_regular
from pipec.runtime.job.durable import shown

LATEST = "latest"
MANIFEST = "pipec-manifest.json"
FORMAT = "pipec-checkpoint 2"
PARTIAL = ".partial"
STEP = re.compile(r"step-(\d{6,})")
METADATA = ".metadata"  # DCP's own metadata file: what its load reads first
MAX_MANIFEST = 64 << 20  # bytes: a manifest lists files and parameter shapes; more is not one


@dataclass(frozen=True)
class Restored:
    step: int  # steps done when the checkpoint was taken: training resumes at this step
    path: str  # as printed (a name that is not UTF-8 shown with escapes)
    skipped: tuple[str, ...] = ()  # one line per newer checkpoint not used, saying why


@dataclass(frozen=True)
class Start:
    """What a job with --checkpoint starts from: its lineage and, with --resume, the checkpoint loaded."""

    run: str  # the id every save of this job records: a new one, or that of the checkpoint resumed
    restored: Restored | None


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest, as read and checked against its own digest."""

    step: int
    run: str  # the lineage: a job started afresh gets a new id, a resumed one keeps its checkpoint's
    schedule: str
    num_stages: int
    stages: dict[int, dict[str, tuple[int, ...] | None]]  # stage -> parameter name -> shape (None: not a tensor)
    keys: tuple[str, ...]  # the top-level keys of the saved state ("stage0", "rng1", ...)
    files: dict[str, tuple[int, str]]  # file name -> (bytes, sha256)


class Damaged(Exception):
    """A checkpoint that does not verify; the message names the file and what is wrong with it."""


def _name(step: int) -> str:
    return f"step-{step:06d}"


def _why(e: BaseException) -> str:
    """What went wrong, in one line: the OS's words for a file-system error (DCP wraps them per rank)."""
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> (exception, trace)
    if failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    if isinstance(e, OSError) and e.strerror:
        named = isinstance(e.filename, str | bytes) and e.filename
        return e.strerror + (f": {shown(os.fsdecode(e.filename))}" if named else "")
    text = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# ---------------------------------------------------------------------------------------------------------
# Agreement: every rank reaches the same verdict, so that none is left waiting for another


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _job_rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def _on_first(fn: Callable[[], Any], doing: str) -> Any:
    """Run `fn` on job rank 0 only (with data parallelism every replica has a Program rank 0); every rank
    returns its value, or raises the same PipelineError when it failed. Also a barrier."""
    dist = _dist()
    outcome: tuple[str, Any] = ("ok", None)
    if dist is None or dist.get_rank() == 0:
        try:
            outcome = ("ok", fn())
        except PipelineError as e:
            outcome = ("error", str(e))
        except Exception as e:  # noqa: BLE001 - any failure here must reach every rank as one message
            outcome = ("error", f"{doing}: {_why(e)}")
    if dist is not None:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if outcome[0] == "error":
        raise PipelineError(outcome[1])
    return outcome[1]


def _all_agree(problem: str | None) -> None:
    """Raise on every rank the first rank's problem, if any rank has one."""
    dist = _dist()
    problems = [problem]
    if dist is not None:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise PipelineError(first)


# ---------------------------------------------------------------------------------------------------------
# Files


def _clean_partials(folder: str) -> None:
    """Remove what an unfinished save left (`*.partial`): folders, and anything else of such a name (a
    link is removed, never followed)."""
    for entry in os.listdir(folder):
        if entry.endswith(PARTIAL):
            path = os.path.join(folder, entry)
            try:
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
            except OSError:
                pass


def check_folder(folder: str, write: bool = True) -> None:
    """That `folder` is (or can be made) a folder this job can write its checkpoints in: before any step,
    not at the first save. PipelineError naming the path and what is wrong otherwise. `write=False` (a run
    that saves nothing, such as a resume with no step left): only that it is a folder or absent; it is then
    neither made nor probed, since a read-only folder serves such a run."""
    where = f"--checkpoint {shown(folder)}"
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        if not write:
            return
        try:
            os.makedirs(folder)
        except OSError as e:
            raise PipelineError(f"{where}: cannot create the folder ({_why(e)})") from None
    except NotADirectoryError:
        raise PipelineError(f"{where}: a part of its path is a file, not a folder") from None
    except OSError as e:  # a symbolic-link loop, no permission
        raise PipelineError(f"{where}: cannot be used as a folder ({_why(e)})") from None
    else:
        if not stat.S_ISDIR(st.st_mode):
            raise PipelineError(f"{where}: not a folder (a file of that name exists); name a folder")
    latest = os.path.join(folder, LATEST)
    if os.path.isdir(latest) and not os.path.islink(latest):
        raise PipelineError(
            f"{shown(latest)} is a folder: a save could not record its checkpoint there; remove or rename it"
        )
    if not write:
        return
    try:
        fd, probe = tempfile.mkstemp(prefix=".pipec-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PipelineError(f"{where}: checkpoints cannot be written there ({_why(e)})") from None


RUN_LINE = re.compile(r"run (\S{1,64})")


def read_latest(folder: str) -> tuple[str, str | None] | None:
    """The checkpoint name `latest` records and the run id beside it (None for a `latest` of one line, as
    pipec wrote before it recorded runs); None without the file. PipelineError when it is unreadable, not
    UTF-8, or names anything but a checkpoint of this folder (`..`, a path, another name)."""
    path = os.path.join(folder, LATEST)
    if not os.path.lexists(path):
        return None
    fix = f"remove {shown(path)}, and --resume takes the newest checkpoint that verifies"
    try:
        with _open_regular(path) as f:
            raw = f.read(256)
    except OSError as e:
        raise PipelineError(f"{shown(path)}: cannot be read ({_why(e)}); {fix}") from None
    try:
        lines = raw.decode("utf-8").strip().split("\n")
    except UnicodeDecodeError:
        raise PipelineError(f"{shown(path)}: not UTF-8 text, so it names no checkpoint; {fix}") from None
    name = lines[0].strip()
    if not STEP.fullmatch(name):
        raise PipelineError(f"{shown(path)} names {name[:80]!r}, not a checkpoint of this folder (step-NNNNNN); {fix}")
    run = RUN_LINE.fullmatch(lines[1].strip()) if len(lines) == 2 else None
    if len(lines) > 2 or (len(lines) == 2 and run is None):
        raise PipelineError(f"{shown(path)}: not what a save writes (a checkpoint name and its run id); {fix}")
    return name, run.group(1) if run else None


# ---------------------------------------------------------------------------------------------------------
# The manifest


def _sealed(body: dict) -> str:
    """The manifest's own digest: of its canonical JSON without the digest itself."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(path: str, step: int, run: str, schedule: str, num_stages: int) -> None:
    """Digest every file DCP wrote in `path` and record them with the model's structure (read back from
    DCP's own metadata, so it is what the files hold), last of all, atomically."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    names = sorted(os.listdir(path))
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    stages: dict[str, dict[str, list[int] | None]] = {}
    keys = set()
    for key, m in meta.items():
        top, _, rest = key.partition(".")
        keys.add(top)
        kind, _, param = rest.partition(".")
        if top.startswith("stage") and kind == "model":
            shape = list(m.size) if isinstance(m, TensorStorageMetadata) else None
            stages.setdefault(top.removeprefix("stage"), {})[param] = shape
    files = {}
    for n in names:
        size, sha = _digest(os.path.join(path, n))
        files[n] = {"bytes": size, "sha256": sha}
    body = {
        "format": FORMAT,
        "step": step,
        "run": run,
        "schedule": schedule,
        "num_stages": num_stages,
        "stages": stages,
        "keys": sorted(keys),
        "files": files,
    }
    body["sha256"] = _sealed(body)
    _atomic_text(os.path.join(path, MANIFEST), json.dumps(body, indent=1, sort_keys=True) + "\n")


def _manifest(path: str) -> Manifest:
    """The manifest of checkpoint `path`, checked against its own digest; Damaged otherwise."""
    file = os.path.join(path, MANIFEST)
    try:
        with _open_regular(file) as f:
            if os.fstat(f.fileno()).st_size > MAX_MANIFEST:
                raise Damaged(f"{MANIFEST}: larger than {MAX_MANIFEST >> 20} MiB, not a manifest")
            body = json.loads(f.read(MAX_MANIFEST + 1).decode("utf-8"))
    except FileNotFoundError:
        raise Damaged(f"no {MANIFEST}: its save did not finish, or it is not a pipec checkpoint") from None
    except OSError as e:
        raise Damaged(f"{MANIFEST}: cannot be read ({_why(e)})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Damaged(f"{MANIFEST}: not JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(body, dict) or not isinstance(body.get("sha256"), str):
        raise Damaged(f"{MANIFEST}: not a pipec manifest (no digest of its own)")
    sealed = body.pop("sha256")
    if _sealed(body) != sealed:
        raise Damaged(f"{MANIFEST}: its content differs from its own digest (changed after the save)")
    if body.get("format") != FORMAT:
        raise Damaged(f"{MANIFEST}: format {body.get('format')!r}, not {FORMAT!r}")
    try:
        return Manifest(
            step=int(body["step"]),
            run=str(body["run"]),
            schedule=str(body["schedule"]),
            num_stages=int(body["num_stages"]),
            stages={
                int(s): {n: None if v is None else tuple(int(x) for x in v) for n, v in params.items()}
                for s, params in body["stages"].items()
            },
            keys=tuple(str(k) for k in body["keys"]),
            files={str(n): (int(f["bytes"]), str(f["sha256"])) for n, f in body["files"].items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise Damaged(f"{MANIFEST}: malformed ({type(e).__name__}: {e})") from None


def verify(path: str, digests: bool = True) -> Manifest:
    """Check checkpoint folder `path` by content: its manifest, DCP's metadata among the files it lists
    (without it nothing can be loaded: a save that never finished), exactly the files the manifest lists
    (an extra file is a stale or foreign shard, a missing one a loss), and each file's size and sha256
    (`digests=False`: sizes only, as a save checks what it has just digested before `latest` moves).
    Returns the manifest; Damaged naming the first file that is wrong."""
    man = _manifest(path)
    if METADATA not in man.files:
        raise Damaged(f"{METADATA}: not in the manifest (DCP's metadata was never written: a save that did not finish)")
    expected = STEP.fullmatch(os.path.basename(path))
    if expected and int(expected.group(1)) != man.step:
        raise Damaged(f"{MANIFEST}: records step {man.step}, but the folder is {os.path.basename(path)}")
    try:
        present = set(os.listdir(path)) - {MANIFEST}
    except OSError as e:
        raise Damaged(f"cannot be listed ({_why(e)})") from None
    extra = sorted(present - man.files.keys())
    if extra:
        raise Damaged(f"{shown(extra[0])}: not written by this checkpoint's save (a stale or foreign file)")
    missing = sorted(man.files.keys() - present)
    if missing:
        raise Damaged(f"{shown(missing[0])}: missing (the manifest lists it)")
    for name, (size, sha) in sorted(man.files.items()):
        try:
            got_size, got_sha = _digest(os.path.join(path, name)) if digests else (_size(path, name), None)
        except OSError as e:
            raise Damaged(f"{shown(name)}: cannot be read ({_why(e)})") from None
        if got_size != size:
            raise Damaged(f"{shown(name)}: {got_size} bytes, the manifest says {size} (truncated or overwritten)")
        if got_sha is not None and got_sha != sha:
            raise Damaged(f"{shown(name)}: its sha256 differs from the manifest's (changed after the save)")
    return man


def _size(path: str, name: str) -> int:
    """The size of file `name` of checkpoint `path`, a regular file (NotRegular otherwise)."""
    with _open_regular(os.path.join(path, name)) as f:
        return os.fstat(f.fileno()).st_size


def choose(folder: str) -> tuple[str, Manifest, tuple[str, ...]] | None:
    """The checkpoint of `folder` to resume: the newest that verifies, no newer than the one `latest` names
    and of the same run (lineage), with one line for each newer one skipped and why. None when `folder`
    holds no checkpoint; PipelineError when it holds some and none fits, or when `latest` is damaged.

    `latest` bounds the choice because a run started afresh in a folder (without --resume) leaves the
    earlier run's checkpoints there: one of a later step, or one that a fallback would reach, belongs to
    another training run, and resuming it would be a silently different run. Its run id says which."""
    recorded, lineage = read_latest(folder) or (None, None)
    found = []
    for entry in os.listdir(folder):
        m = STEP.fullmatch(entry)
        if m:
            found.append((int(m.group(1)), entry))
    found.sort(reverse=True)
    skipped: list[str] = []
    bound = None
    if recorded is not None:
        bound = int(recorded.removeprefix("step-"))
        if recorded not in {e for _, e in found}:
            skipped.append(f"skipped {shown(os.path.join(folder, recorded))} (named by {LATEST}): missing")
        elif lineage is None:  # a `latest` written before runs were recorded there: its manifest says
            try:
                lineage = _manifest(os.path.join(folder, recorded)).run
            except Damaged:
                pass  # said when it is verified below; then any run's older checkpoint is taken
    for step, entry in found:
        path = os.path.join(folder, entry)
        if bound is not None and step > bound:
            skipped.append(
                f"skipped {shown(path)}: newer than {recorded}, which {LATEST} names (an earlier run's, "
                f"or its save ended before {LATEST} was updated)"
            )
            continue
        try:
            if not os.path.isdir(path):
                raise Damaged("not a folder")
            man = verify(path)
        except Damaged as e:
            skipped.append(f"skipped {shown(path)}: {e}")
            continue
        if lineage is not None and man.run != lineage:
            skipped.append(f"skipped {shown(path)}: written by another run than {recorded} (one started afresh here)")
            continue
        return path, man, tuple(skipped)
    if skipped:
        raise PipelineError(
            f"no checkpoint in {shown(folder)} verifies, so --resume cannot continue:\n  "
            + "\n  ".join(skipped)
            + "\nmove them away to start from step 0"
        )
    return None


def structure_problem(path: str, man: Manifest, runner, state: dict) -> str | None:
    """Why this rank's stages cannot take checkpoint `path` (None when they can): other stages, or a
    parameter missing, added, or of another shape (another model, width or depth)."""
    num_stages = runner.program.num_stages
    if man.num_stages != num_stages:
        return (
            f"{shown(path)} holds {man.num_stages} stages (schedule `{man.schedule}`), but this program has "
            f"{num_stages}: a checkpoint resumes only under a schedule with the same stages"
        )
    for s in sorted(runner.stages):
        theirs = man.stages.get(s, {})
        ours = {
            n: tuple(v.shape) if isinstance(v, torch.Tensor) else None for n, v in state[f"stage{s}"]["model"].items()
        }
        differ = []
        for n in sorted(ours.keys() | theirs.keys()):
            if n not in theirs:
                differ.append(f"`{n}` {list(ours[n] or [])} is not in the checkpoint")
            elif n not in ours:
                differ.append(f"`{n}` {list(theirs[n] or [])} of the checkpoint is not in this model")
            elif ours[n] != theirs[n]:
                differ.append(f"`{n}` is {list(theirs[n] or [])} there, {list(ours[n] or [])} here")
        if differ:
            more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
            return (
                f"{shown(path)} was written for another model: stage {s}'s parameter {differ[0]}{more}; "
                "resume with the model, width and depth it was saved with, or another --checkpoint folder"
            )
    return None


# ---------------------------------------------------------------------------------------------------------
# Save and resume


def _state(runner, steps_done: int) -> dict:
    """What this rank contributes: its stages' model and optimizer state, its RNG, the job's metadata."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict = {
        "meta": {
            "format": FORMAT,
            "step": steps_done,
            "num_stages": runner.program.num_stages,
            "schedule": runner.program.name,
        }
    }
    for s, st in runner.stages.items():
        entry = {"model": get_model_state_dict(st.module)}
        if st.optimizer is not None:
            entry["optim"] = get_optimizer_state_dict(st.module, st.optimizer)
        state[f"stage{s}"] = entry
    state[_rng_key(runner)] = {"cpu": torch.get_rng_state()}
    return state


def _rng_key(runner) -> str:
    """Each process's RNG state: by Program rank, and replica under data parallelism (the model and
    optimizer keys name stages and parameters; FSDP2's DTensors save each shard once)."""
    replicas = getattr(runner, "replicas", None)
    return f"rng{runner.rank}" + (f"dp{replicas.dp_rank}" if replicas is not None else "")


def _previous(folder: str) -> str:
    try:
        name = (read_latest(folder) or (None, None))[0]
    except PipelineError:
        name = None
    if name and os.path.isdir(os.path.join(folder, name)):
        return f"the previous checkpoint {shown(os.path.join(folder, name))} is intact"
    return "no earlier checkpoint was touched"


def save(folder: str, runner, steps_done: int, run: str) -> str:
    """Collectively save every rank's stages after `steps_done` steps, as part of run `run` (`Start.run`);
    returns the checkpoint's path (as printed). A failure (a full disk, a folder made read-only) is a
    PipelineError on every rank, and leaves the previous checkpoint as it was."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    final = os.path.join(folder, _name(steps_done))
    partial = final + PARTIAL

    def failed(why: str) -> str:
        return f"cannot save the checkpoint of step {steps_done} in {shown(folder)}: {why}; {_previous(folder)}"

    def begin() -> None:
        try:
            os.makedirs(folder, exist_ok=True)
            _clean_partials(folder)
        except OSError as e:
            raise PipelineError(failed(_why(e))) from None

    doing = f"cannot save the checkpoint of step {steps_done} in {shown(folder)}"
    _on_first(begin, doing)
    problem = None
    try:
        dcp.save(_state(runner, steps_done), checkpoint_id=partial)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's exception is a BaseException
        problem = failed(_why(e))
    try:
        _all_agree(problem)  # every rank's part is written, or every rank stops
    except PipelineError:
        if _job_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise

    def finish() -> None:
        try:
            write_manifest(partial, steps_done, run, runner.program.name, runner.program.num_stages)
            verify(partial, digests=False)  # complete as recorded, before anything names it
            _publish(folder, partial, final, f"{_name(steps_done)}\nrun {run}\n")
        except Damaged as e:
            shutil.rmtree(partial, ignore_errors=True)
            raise PipelineError(failed(f"it does not read back as written ({e})")) from None
        except Exception as e:  # noqa: BLE001 - the partial folder goes, whatever stopped it
            shutil.rmtree(partial, ignore_errors=True)
            raise PipelineError(failed(_why(e))) from None

    _on_first(finish, doing)
    return shown(final)


def _publish(folder: str, partial: str, final: str, latest: str) -> None:
    """Make the verified `partial` the checkpoint `final`, then (its rename made durable) point `latest` at
    it, atomically. A failure anywhere undoes it all: the new folder goes, an earlier run's checkpoint of
    the same step that it replaced comes back, and `latest` still names the last good checkpoint, so a
    failed save never leaves a checkpoint newer than `latest` nor a `latest` naming an unfinished one."""
    old = final + ".replaced" + PARTIAL
    moved = os.path.lexists(final)  # an earlier run's checkpoint of the same step (perhaps damaged)
    if moved:
        os.replace(final, old)
    try:
        os.replace(partial, final)
    except OSError:
        if moved:
            os.replace(old, final)
        raise
    try:
        _fsync_dir(folder, strict=True)
        _atomic_text(os.path.join(folder, LATEST), latest)
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)
        if moved:
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(folder)


def prepare(folder: str, runner, resume: bool, until: int | None = None) -> Start:
    """Before any step of a run with --checkpoint: check that `folder` can take checkpoints, and with
    `resume`, load the newest checkpoint that verifies and fits this rank's stages (collectively); no
    checkpoint is restored when there is none. PipelineError on every rank otherwise, naming the file.

    `until`: the step the run ends at (--steps); None: a save is assumed to come. The folder must be
    writable only when a save is to come, that is when the run starts before `until`: a resume with no
    step left reads a read-only folder and writes nothing (not even the removal of partial folders)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    def look() -> tuple[str, tuple[str, Manifest, tuple[str, ...]] | None]:
        check_folder(folder, write=False)
        chosen = choose(folder) if resume and os.path.isdir(folder) else None
        if until is None or (chosen[1].step if chosen else 0) < until:  # a save is to come
            check_folder(folder)
            _clean_partials(folder)
        return uuid.uuid4().hex, chosen

    fresh, chosen = _on_first(look, f"--checkpoint {shown(folder)}")
    if chosen is None:
        return Start(fresh, None)
    path, man, skipped = chosen
    state = _state(runner, man.step)
    _all_agree(structure_problem(path, man, runner, state))
    if man.schedule != runner.program.name or _rng_key(runner) not in man.keys:
        # ranks differ under another schedule (or data parallelism): their RNG streams do not carry
        state.pop(_rng_key(runner))
    problem = None
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        problem = f"{shown(path)}: cannot load this rank's stages ({_why(e)})"
    _all_agree(problem)
    for s, st in runner.stages.items():
        entry = state[f"stage{s}"]
        set_model_state_dict(st.module, entry["model"])
        if st.optimizer is not None:
            set_optimizer_state_dict(st.module, st.optimizer, entry["optim"])
    if _rng_key(runner) in state:
        torch.set_rng_state(state[_rng_key(runner)]["cpu"])
    runner.steps_done = man.step
    return Start(man.run, Restored(man.step, shown(path), skipped))
