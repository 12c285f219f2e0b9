"""Outputs that are either complete or absent: written under a temporary name next to the
target and renamed over it only once fully on disk, so a crash, a kill or a full disk never
leaves a half-written file where a good one was.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

PARTIAL_SUFFIX = ".partial"


def partial_name(path: Path) -> Path:
    """The temporary name for ``path``: same directory (so the rename is atomic), dot-prefixed."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}{PARTIAL_SUFFIX}")


def fsync_dir(directory: Path) -> None:
    """fsync a directory (its entries: a rename or an unlink in it); an OS that refuses is let be."""
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
    fsync_dir(path.parent)


def write_text(path: Path, text: str, encoding: str = "utf-8") -> None:
    """``path.write_text(text)`` that leaves the old content in place if anything fails."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding=encoding) as f:
            f.write(text)


def write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


@contextlib.contextmanager
def replace_dir(path: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory next to ``path`` to fill; on success it takes ``path``'s place
    whole (an earlier directory there is removed, with whatever it held), on any error it is removed
    and ``path`` is left as it was. A reader never sees old and new files mixed.
    The caller decides whether an earlier ``path`` may be replaced (it must be its own output)."""
    path = Path(path)
    tmp = partial_name(path)
    old = path.with_name(f".{path.name}.{os.getpid()}.old")
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.is_dir() and not path.is_symlink():
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(path.parent)


def writable_dir(folder: Path) -> str | None:
    """None when a file can be created in ``folder`` (created if missing), else why not (the OS's words)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-"):
            pass
    except OSError as e:
        return f"cannot write in {folder}: {e.strerror or e}"
    return None


class DirLockedError(RuntimeError):
    """Another run is writing the same output directory (and this one was not to wait)."""


@contextlib.contextmanager
def dir_lock(path: Path, wait: bool = True) -> Iterator[None]:
    """Hold the lock of the output directory ``path`` (an advisory ``flock`` on ``.NAME.lock`` beside
    it, released when the holder exits, however it ends): a second writer of the same directory waits
    for the first (``wait``) or is refused with ``DirLockedError`` naming the holder's process."""
    path = Path(path)
    lock = path.with_name(f".{path.name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            if not wait:
                raise DirLockedError(f"{path} is being written by another run (process {holder}, lock {lock}): wait "
                                     "for it to finish, or choose another directory") from None
            print(f"waiting for process {holder}, which is writing {path} (lock {lock})", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
