"""Who wrote an output directory, from which input and with which options: the converters
refuse to mix two inputs' data in one directory and resume only their own partial output.

Each converter claims its output directory with a manifest holding a fingerprint of its input
(sizes plus sampled bytes of every input file, so it is cheap on a 1.3 TB checkpoint yet
tells two checkpoints of the same shapes apart) and its options, and marks it complete last.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

from verl_patches import atomic

MANIFEST = ".verl_patches_output.json"
SAMPLE_BYTES = 1 << 16


class OutputDirError(RuntimeError):
    """The output directory holds something this run must not mix with or delete."""


def fingerprint_files(files: Iterable[Path]) -> str:
    """Hash of each file's name, size, first and last SAMPLE_BYTES bytes (whole file if smaller)."""
    h = hashlib.sha256()
    for f in sorted(Path(x) for x in files):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(SAMPLE_BYTES))
            if size > 2 * SAMPLE_BYTES:
                fh.seek(size - SAMPLE_BYTES)
            h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()[:32]


def read(out: Path) -> dict[str, Any] | None:
    path = Path(out) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"tool": "?", "unreadable": True}
    return data if isinstance(data, dict) else {"tool": "?", "unreadable": True}


def _write(out: Path, data: dict[str, Any]) -> None:
    atomic.write_text(Path(out) / MANIFEST, json.dumps(data, indent=2, sort_keys=True) + "\n")


def claim(out: Path, tool: str, source: Path, input_fingerprint: str, options: dict[str, Any],
          overwrite: bool, owned: Callable[[Path], bool]) -> bool:
    """Make ``out`` this run's output directory; True when it resumes a partial output of the
    same input and options.

    A missing or empty directory is claimed. A directory with this tool's manifest for the same
    input and options is resumed. One written for another input or options is refused unless
    ``overwrite``, which first deletes exactly the files ``owned`` says the tool writes. A
    non-empty directory without a manifest was not written by these tools and is refused.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{out} exists and is not a directory")
    fresh = {"tool": tool, "input": str(source), "input_fingerprint": input_fingerprint,
             "options": options, "complete": False}
    prev = read(out) if out.is_dir() else None
    if prev is None:
        if out.is_dir() and any(out.iterdir()):
            raise OutputDirError(f"{out} is not empty and holds no {MANIFEST}: it was not written by this tool "
                                 f"(or by a version that kept no manifest); choose an empty or new directory")
        out.mkdir(parents=True, exist_ok=True)
        _write(out, fresh)
        return False
    same = (prev.get("tool") == tool and prev.get("input_fingerprint") == input_fingerprint
            and prev.get("options") == options)
    if same:
        if prev.get("input") != str(source):
            _write(out, {**prev, "input": str(source)})  # the same data, moved
        return True
    why = _difference(prev, fresh)
    if not overwrite:
        raise OutputDirError(f"{out} holds the output of {prev.get('tool')} from {prev.get('input')!r}, which {why}; "
                             f"pass --overwrite to replace it, or choose another output directory")
    for entry in list(out.iterdir()):
        if entry.name == MANIFEST or owned(entry):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    _write(out, fresh)
    return False


def _difference(prev: dict[str, Any], new: dict[str, Any]) -> str:
    if prev.get("unreadable"):
        return "left an unreadable manifest"
    if prev.get("tool") != new["tool"]:
        return f"is another tool's output (this is {new['tool']})"
    if prev.get("input_fingerprint") != new["input_fingerprint"]:
        return f"is a different input than {new['input']!r} (input fingerprints differ)"
    changed = sorted(k for k in set(prev.get("options", {})) | set(new["options"])
                     if prev.get("options", {}).get(k) != new["options"].get(k))
    return "used other options: " + ", ".join(f"{k}={prev.get('options', {}).get(k)!r} (now {new['options'].get(k)!r})"
                                              for k in changed)


def complete(out: Path) -> None:
    """Mark the output finished (call after the last file is in place)."""
    data = read(out) or {}
    _write(out, {**data, "complete": True})


def is_complete(out: Path) -> bool | None:
    """True / False from the manifest; None when there is none (not written by these tools)."""
    data = read(out)
    return None if data is None else bool(data.get("complete"))
