"""Outputs that are either complete or absent: written under a temporary name next to the
target and renamed over it only once fully on disk, so a crash, a kill or a full disk never
leaves a half-written file where a good one was.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

PARTIAL_SUFFIX = ".partial"


def partial_name(path: Path) -> Path:
    """The temporary name for ``path``: same directory (so the rename is atomic), dot-prefixed."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}{PARTIAL_SUFFIX}")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path``, on any error it is removed.

    ``mode``: permission bits for the result (default: those of the file replaced, if any).
    """
    path = Path(path)
    tmp = partial_name(path)
    if mode is None and path.exists():
        mode = path.stat().st_mode & 0o7777
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def write_text(path: Path, text: str, encoding: str = "utf-8") -> None:
    """``path.write_text(text)`` that leaves the old content in place if anything fails."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding=encoding) as f:
            f.write(text)


def write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
