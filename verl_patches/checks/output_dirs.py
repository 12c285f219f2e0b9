"""What the run will write, checked before anything starts: each output directory (the checkpoints, the launcher's
logs, the profiler's traces, tensorboard's events, the metrics record's folder) exists or can be created, can be
written, and has room on its file system. The launchers run the config check on every node (scripts/cluster/
launch.sh: launch_validate), so each node judges the directories as it mounts them.

Nothing the user owns is created or removed: a directory that does not exist yet is judged by its nearest
existing parent (where the run's own mkdir would create it), and the write test is one empty temporary file of
this check's own, removed again whatever happens.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
# Logs, traces and tensorboard events of a run: a floor that catches a full disk, not their size.
FLOOR_BYTES = 1 * GIB


@dataclass(frozen=True)
class OutputDir:
    """A directory the run writes: what it is for (the key or variable that names it), where, and the free
    space it needs at least."""

    what: str
    path: str
    need_bytes: float = FLOOR_BYTES


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def dir_problem(out: OutputDir) -> str | None:
    """What stops the run writing ``out``, naming it: a part of the path that is a file, a directory that cannot
    be written (tried, not inferred from permission bits: root passes those, a read-only mount does not), or
    less free space than it needs. None when it can be written."""
    where = Path(os.path.expanduser(out.path)).absolute()
    here = f"{out.what}={out.path}"
    existing = _nearest_existing(where)
    if not existing.is_dir():
        return f"{here}: {existing} is not a directory, so the run cannot create {where}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".verl_patches_write_check.", dir=existing)
    except OSError as e:
        made = "" if existing == where else f" (the nearest existing parent of {where}, where the run creates it)"
        return f"{here}: {existing}{made} cannot be written: {e.strerror or e}"
    try:
        os.close(fd)
    finally:
        os.unlink(probe)
    free = shutil.disk_usage(existing).free
    if free < out.need_bytes:
        return (f"{here}: {free / GIB:.1f} GiB free on the file system of {existing}, the run needs at least "
                f"{out.need_bytes / GIB:.1f} GiB there")
    return None
