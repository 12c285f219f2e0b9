"""Checkpoints that are whole or absent: the order in which a step's checkpoint is committed, and what a
resume accepts (patch verl.ray_trainer.checkpoint_*, verl_patches/patches/verl/
patch_trainer_ppo_ray_trainer_checkpoint.py).

verl 0.4.1 writes ``ROOT/global_step_N/`` (every rank's shards, then the driver's ``data.pt``) and then
``ROOT/latest_checkpointed_iteration.txt`` with a plain open and write. A node lost during the save
leaves ``global_step_N`` with some ranks' files only; a lost driver during the tracker's write leaves it
empty or cut short; and with ``max_actor_ckpt_to_keep`` every rank deletes the oldest checkpoint *before*
it writes the new one. Here a step is committed in this order, each part after the one before has
returned:

1. the step directory is emptied if something is there already (a partial save of a run that was lost,
   or a checkpoint of another branch of the run that the tracker does not name);
2. every rank writes its shards (the driver's call on the worker group returns only once every rank's
   call returned, and raises if one failed or its node was lost), then the driver writes ``data.pt``;
3. ``COMMIT_MARKER`` in the step directory: the step and every file of the directory with its size,
   written under a temporary name, fsynced and renamed (``base/atomic.py``);
4. the tracker, the same way: a reader sees the old step or the new one, never a cut one;
5. only then the checkpoints beyond ``max_to_keep`` are removed, oldest first (the marker first, so a
   directory half removed is never taken for whole).

On resume (:func:`resume_dir`) the tracker's step directory must be whole: its marker names the step and
every file it lists is there with its size. If it is not, the newest whole step below the tracker's is
taken, and the reason is said; directories above the tracker (a save that did not reach its tracker)
are never taken. The shard files themselves are synced by their writers (torch's distributed checkpoint
writer fsyncs each file before it returns).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from verl_patches.base.atomic import PARTIAL_SUFFIX, fsync_dir, write_text

TRACKER = "latest_checkpointed_iteration.txt"  # verl's name (verl/utils/checkpoint/checkpoint_manager.py)
STEP_DIR = "global_step_{}"
STEP_RE = re.compile(r"global_step_(\d+)")
COMMIT_MARKER = "checkpoint_complete.json"
MARKER_FORMAT = 1


RESUME_MODES = ("auto", "resume_path", "disable")  # verl 0.4.1's trainer.resume_mode
ASYNC_SAVE_WHY = ("an asynchronous save returns before the shards are written, so a checkpoint could be marked "
                  "whole while it is not; set it to False (the recipe's checkpoints are written synchronously)")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be resumed from, or cannot be committed; the message names the directory and why."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / STEP_DIR.format(step)


def listing(directory: Path) -> dict[str, int]:
    """Every regular file under ``directory`` (relative POSIX path -> size), the marker and temporaries
    (dot-prefixed, base/atomic.py's) left out."""
    directory = Path(directory)
    out = {}
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if any(part.startswith(".") for part in rel.parts) or rel.as_posix() == COMMIT_MARKER:
            continue
        if path.is_file():
            out[rel.as_posix()] = path.stat().st_size
    return out


def write_marker(directory: Path, step: int) -> dict[str, int]:
    """Mark ``directory`` whole: called once every rank's save returned. Returns the files it lists."""
    directory = Path(directory)
    files = listing(directory)
    if not files:
        raise CheckpointError(f"{directory}: no file was written; the checkpoint is not marked whole")
    write_text(directory / COMMIT_MARKER,
               json.dumps({"format": MARKER_FORMAT, "step": int(step), "files": files}, indent=0) + "\n")
    return files


def why_not_whole(directory: Path, step: int | None = None) -> str | None:
    """None when ``directory`` is a whole checkpoint (of ``step``, when given); else the reason."""
    directory = Path(directory)
    if not directory.is_dir():
        return f"{directory} does not exist"
    marker = directory / COMMIT_MARKER
    if not marker.is_file():
        return (f"{directory} has no {COMMIT_MARKER}: its save did not finish (a rank or node lost during it), or "
                "it was written without the overlay")
    try:
        record = json.loads(marker.read_text())
        files, marked = dict(record["files"]), int(record["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{marker} is unreadable ({e})"
    if step is not None and marked != step:
        return f"{marker} marks step {marked}, not {step}"
    missing = [name for name in files if not (directory / name).is_file()]
    if missing:
        return f"{directory} lacks {len(missing)} of the {len(files)} files its marker lists (e.g. {missing[0]})"
    changed = [name for name, size in files.items() if (directory / name).stat().st_size != size]
    if changed:
        return (f"{directory}: {len(changed)} file(s) differ in size from the marker's record "
                f"(e.g. {changed[0]})")
    return None


def read_tracker(root: Path) -> int | None:
    """The step the tracker names; None without a tracker. A tracker that is not a step number is an error."""
    path = Path(root) / TRACKER
    if not path.is_file():
        return None
    text = path.read_text(errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text[:40]!r}, not a step number (a tracker written without the "
                              "overlay and cut short?); remove it to resume from the newest whole checkpoint, or "
                              "name one with trainer.resume_mode=resume_path trainer.resume_from_path=DIR")
    return int(text)


def write_tracker(root: Path, step: int) -> None:
    write_text(Path(root) / TRACKER, str(int(step)))


def steps_on_disk(root: Path) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := STEP_RE.fullmatch(p.name)))


@dataclass(frozen=True)
class ResumePoint:
    step: int  # 0: nothing to resume, train from scratch
    directory: Path | None
    notes: tuple[str, ...] = ()  # what was passed over, and why


def resume_dir(root: Path) -> ResumePoint:
    """Where ``trainer.resume_mode=auto`` resumes: the tracker's step if whole, else the newest whole step
    below it; from scratch when there is no tracker and no whole step. A tracker naming a step of which no
    whole checkpoint exists at or below it is an error (resuming from scratch would silently repeat the run)."""
    root = Path(root)
    tracked = read_tracker(root)
    notes = []
    candidates = [s for s in steps_on_disk(root) if tracked is None or s <= tracked]
    if tracked is not None and tracked not in candidates:
        notes.append(f"the tracker names step {tracked}, but {step_dir(root, tracked)} does not exist")
    for step in sorted(candidates, reverse=True):
        reason = why_not_whole(step_dir(root, step), step)
        if reason is None:
            return ResumePoint(step, step_dir(root, step), tuple(notes))
        notes.append(f"passed over: {reason}")
    if tracked is not None:
        raise CheckpointError(f"{root / TRACKER} names step {tracked}, and no whole checkpoint exists at or below "
                              "it:\n  - " + "\n  - ".join(notes) + "\nRemove the tracker to train from scratch, or "
                              "name a whole checkpoint with trainer.resume_mode=resume_path")
    return ResumePoint(0, None, tuple(notes))


def resume_path_problem(named: object) -> str | None:
    """``trainer.resume_mode=resume_path`` without a directory named: what is wrong, or None."""
    if isinstance(named, str) and named:
        return None
    return ("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N directory), got "
            f"{named!r}")


def check_named(directory: Path) -> int:
    """``trainer.resume_mode=resume_path``: the named directory must be a whole checkpoint; returns its step."""
    directory = Path(directory)
    m = STEP_RE.fullmatch(directory.name)
    if m is None:
        raise CheckpointError(f"trainer.resume_from_path={directory}: not a global_step_N directory")
    step = int(m.group(1))
    reason = why_not_whole(directory, step)
    if reason is not None:
        raise CheckpointError(f"trainer.resume_from_path={directory} is not a whole checkpoint: {reason}")
    return step


def remove_step(root: Path, step: int) -> None:
    """Remove a step's directory: its marker first (a directory half removed is never taken for whole)."""
    directory = step_dir(root, step)
    if not directory.exists():
        return
    try:
        (directory / COMMIT_MARKER).unlink()
    except FileNotFoundError:
        pass
    fsync_dir(directory)
    shutil.rmtree(directory)


def prepare(root: Path, step: int) -> Path:
    """Before a step's save: an empty step directory (whatever was there is not this run's whole save), and no
    temporary of a tracker write that a lost driver left (one driver writes a root at a time)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".{TRACKER}.*{PARTIAL_SUFFIX}"):
        stale.unlink(missing_ok=True)
    remove_step(root, step)
    directory = step_dir(root, step)
    directory.mkdir()
    return directory


def commit(root: Path, step: int, max_to_keep: int | None) -> list[int]:
    """After every rank's save and the driver's files returned: the marker, then the tracker, then the
    oldest whole checkpoints beyond ``max_to_keep`` (None or <= 0: all kept). Returns the steps removed."""
    root = Path(root)
    write_marker(step_dir(root, step), step)
    write_tracker(root, step)
    removed = []
    if max_to_keep is not None and max_to_keep > 0:
        whole = [s for s in steps_on_disk(root) if s < step and why_not_whole(step_dir(root, s), s) is None]
        for old in whole[: max(0, len(whole) - (max_to_keep - 1))]:
            remove_step(root, old)
            removed.append(old)
    return removed

