"""Who wrote an output directory, from which input and with which options, and what it wrote:
the converters recognise their own work by content, never by names, sizes or sampled bytes.

Each converter claims its output directory with a manifest (``MANIFEST``) that records

* the input's identity by content: the SHA-256 of every byte of every input file (streamed,
  ``CHUNK`` bytes at a time, the files hashed in parallel threads), per file and combined;
* the options the output depends on;
* every file the tool has written into the directory, with its size and SHA-256, recorded
  after the file is in place;
* ``complete``, set last.

Before anything is reused, it is checked against this record. A directory claimed for other
content or other options is refused with ``InputMismatchError`` / ``OptionsMismatchError``,
which name both inputs (path and content hash) and the files that differ; ``--overwrite``
deletes exactly the files the tool writes and starts again. A file that is reused must hash to
what was recorded when it was written: one that does not (a truncated ``.metadata``, a replaced
shard), in a partial output or a finished one, is written again from the input, and the
manifest lists it under ``changed_on_resume``.

Cost, measured on the development machine (a 2-core Xeon with SHA extensions, files in the page
cache): ``hash_file`` ran at 1.2 to 1.6 GB/s on an idle core and 0.45 to 0.75 GB/s while the two
cores were shared with other jobs; plain reads of the same file ran at 3 to 4 GB/s, so hashing is
CPU-bound. Identifying the 1.3 TB BF16 checkpoint therefore reads it once at the lower of the
storage's speed and about 1.2 GB/s per hashing thread (``HASH_THREADS``, up to 8, one per file):
about 18 minutes on one idle core. Recording an output re-reads the file just written (normally
from the page cache); reusing one re-reads it once. ``tests/tools/test_identity.py`` prints the
rate of ``hash_file`` on the machine that runs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

from verl_patches.base import atomic

MANIFEST = ".verl_patches_output.json"
FORMAT = 2  # 1 identified inputs by 64 KiB sampled at each end of each file: not trusted any more
CHUNK = 1 << 20  # per read; one buffer per hashing thread (bounded memory)
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))


class OutputDirError(RuntimeError):
    """The output directory holds something this run must not mix with or delete."""


class InputMismatchError(OutputDirError):
    """The directory was written from an input of other content than this run's."""


class OptionsMismatchError(OutputDirError):
    """The directory was written from the same input with other options."""


def hash_file(path: Path) -> str:
    """SHA-256 of every byte of ``path``, streamed in ``CHUNK``-byte reads (bounded memory)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    path = Path(path)
    return {"size": path.stat().st_size, "sha256": hash_file(path)}


def identify(files: Mapping[str, Path], threads: int | None = None) -> dict[str, Any]:
    """The content identity of an input made of ``files`` (label -> path): every file's size and
    SHA-256 and one SHA-256 over all of them (labels included, so a renamed shard is another input)."""
    labels = sorted(files)
    with ThreadPoolExecutor(max_workers=threads or HASH_THREADS) as pool:
        records = list(pool.map(lambda k: file_record(files[k]), labels))
    per_file = dict(zip(labels, records))
    combined = hashlib.sha256(json.dumps(per_file, sort_keys=True).encode()).hexdigest()
    return {"sha256": combined, "bytes": sum(r["size"] for r in records), "files": per_file}


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


def _short(identity: Any) -> str:
    return str(identity.get("sha256", "?"))[:16] if isinstance(identity, dict) else "?"


def _differing_files(prev: Any, new: dict[str, Any]) -> list[str]:
    old = prev.get("files", {}) if isinstance(prev, dict) else {}
    new_files = new.get("files", {})
    return sorted(k for k in set(old) | set(new_files) if old.get(k) != new_files.get(k))


def claim(out: Path, tool: str, source: Path, identity: dict[str, Any], options: dict[str, Any],
          overwrite: bool, owned: Callable[[Path], bool]) -> bool:
    """Make ``out`` this run's output directory; True when it continues an output of the same
    input content and options (partial, or finished and unchanged since).

    A missing or empty directory is claimed. A directory with this tool's manifest for the same
    input content and options is resumed; if that output is marked complete, every file it
    recorded is hashed again first, and one that changed makes it partial again (its record is
    dropped, so the tool writes it again; ``changed_on_resume`` says which). One written
    for other content or options raises ``InputMismatchError`` / ``OptionsMismatchError`` unless
    ``overwrite``, which first deletes exactly the files ``owned`` says the tool writes. A
    non-empty directory without a manifest was not written by these tools and is refused.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{out} exists and is not a directory")
    hold(out)
    fresh = {"tool": tool, "format": FORMAT, "input": str(source), "input_identity": identity,
             "options": options, "outputs": {}, "complete": False}
    prev = read(out) if out.is_dir() else None
    if prev is None:
        if out.is_dir() and any(out.iterdir()):
            raise OutputDirError(f"{out} is not empty and holds no {MANIFEST}: it was not written by this tool "
                                 f"(or by a version that kept no manifest); choose an empty or new directory")
        out.mkdir(parents=True, exist_ok=True)
        _write(out, fresh)
        return False
    error = _mismatch(out, prev, fresh) or _damaged(out, prev, owned)
    if error is None:
        data = {**prev, "input": str(source), "changed_on_resume": []}  # the same content, perhaps moved
        if prev.get("complete"):
            # Every recorded file is hashed again: one that changed since is written again.
            changed = changed_outputs(out, prev)
            if changed:
                bad = {c.split(" ", 1)[0] for c in changed}
                data = {**data, "complete": False, "changed_on_resume": changed,
                        "outputs": {k: v for k, v in prev.get("outputs", {}).items() if k not in bad}}
        _write(out, data)
        return True
    elif not overwrite:
        raise error
    for entry in list(out.iterdir()):
        if entry.name == MANIFEST or owned(entry):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    _write(out, fresh)
    return False


_HELD: dict[str, contextlib.ExitStack] = {}


def hold(out: Path) -> None:
    """Take the output directory's lock for this process (kept until ``complete`` or the process ends):
    a second run converting into the same directory at the same time is refused, naming this one."""
    key = str(Path(out).resolve())
    if key in _HELD:
        return
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(atomic.dir_lock(Path(out), wait=False))
    except atomic.DirLockedError as e:
        raise OutputDirError(str(e)) from None
    _HELD[key] = stack


def release(out: Path) -> None:
    stack = _HELD.pop(str(Path(out).resolve()), None)
    if stack is not None:
        stack.close()


def _mismatch(out: Path, prev: dict[str, Any], new: dict[str, Any]) -> OutputDirError | None:
    hint = "pass --overwrite to replace it, or choose another output directory"
    if prev.get("unreadable"):
        return OutputDirError(f"{out} holds an unreadable {MANIFEST}; {hint}")
    if prev.get("tool") != new["tool"]:
        return OutputDirError(f"{out} holds the output of {prev.get('tool')} from {prev.get('input')!r}, "
                              f"another tool's output (this is {new['tool']}); {hint}")
    if prev.get("format") != FORMAT:
        return OutputDirError(f"{out} holds the output of {prev.get('tool')} from {prev.get('input')!r} written by an "
                              "older version that identified its input by sampled bytes only, so this run cannot "
                              f"tell whether it is the same input; {hint}")
    old_id, new_id = prev.get("input_identity"), new["input_identity"]
    if not isinstance(old_id, dict) or old_id.get("sha256") != new_id["sha256"]:
        diff = _differing_files(old_id, new_id)
        return InputMismatchError(
            f"{out} holds the output of {prev.get('tool')} from {prev.get('input')!r} (content sha256 "
            f"{_short(old_id)}...), which is a different input than {new['input']!r} (content sha256 "
            f"{_short(new_id)}...); files that differ: {', '.join(diff[:5]) or 'none by name'}"
            f"{' ...' if len(diff) > 5 else ''}; {hint}")
    prev_opts = prev.get("options") if isinstance(prev.get("options"), dict) else {}
    if prev_opts != new["options"]:
        changed = sorted(k for k in set(prev_opts) | set(new["options"]) if prev_opts.get(k) != new["options"].get(k))
        return OptionsMismatchError(
            f"{out} holds the output of {prev.get('tool')} from {prev.get('input')!r} (the same content as "
            f"{new['input']!r}) but used other options: "
            + ", ".join(f"{k}={prev_opts.get(k)!r} (now {new['options'].get(k)!r})" for k in changed) + f"; {hint}")
    return None


def _record_ok(rec: Any) -> bool:
    return (isinstance(rec, dict) and isinstance(rec.get("size"), int) and not isinstance(rec.get("size"), bool)
            and rec["size"] >= 0 and isinstance(rec.get("sha256"), str) and len(rec["sha256"]) == 64)


def _damaged(out: Path, prev: dict[str, Any], owned: Callable[[Path], bool]) -> OutputDirError | None:
    """The manifest is the index of what the tool wrote: resume trusts it only when it is whole. Every
    record must be a size and a SHA-256; ``complete`` a boolean; and a finished output must record every
    file of the tool's kind that the directory holds (one it does not record was never verified)."""
    outputs, why = prev.get("outputs"), None
    if not isinstance(outputs, dict):
        why = f"'outputs' is {type(outputs).__name__}, not the table of written files"
    elif not all(isinstance(k, str) and _record_ok(v) for k, v in outputs.items()):
        bad = sorted(str(k) for k, v in outputs.items() if not _record_ok(v))
        why = f"the record(s) of {', '.join(bad[:5])} hold no size and SHA-256"
    elif not isinstance(prev.get("complete"), bool):
        why = f"'complete' is {prev.get('complete')!r}, not true or false"
    elif prev["complete"]:
        unrecorded = sorted(e.name for e in out.iterdir() if e.name != MANIFEST and owned(e) and e.is_file()
                            and e.name not in outputs and not e.name.endswith(".partial"))
        if unrecorded or not outputs:
            why = (f"it says complete but records {'no file' if not outputs else 'not ' + ', '.join(unrecorded[:5])}"
                   f"{' ...' if len(unrecorded) > 5 else ''}, so nothing proves those files whole")
    if why is None:
        return None
    return OutputDirError(f"{out}: its {MANIFEST}, the index of what {prev.get('tool')} wrote there, is damaged "
                          f"({why}); this run cannot tell which files are whole: delete {out}, or pass --overwrite "
                          "to write it again")


def changed_outputs(out: Path, data: dict[str, Any] | None = None) -> list[str]:
    """One sentence per recorded output file that is missing or no longer has its recorded content."""
    data = read(out) if data is None else data
    found = []
    for rel, want in sorted((data or {}).get("outputs", {}).items()):
        why = _check(Path(out) / rel, want)
        if why:
            found.append(f"{rel} {why}")
    return found


def _check(path: Path, want: Any) -> str | None:
    if not path.is_file():
        return "is missing"
    if not isinstance(want, dict):
        return "has no readable record"
    size = path.stat().st_size
    if size != want.get("size"):
        return f"has {size} bytes, {want.get('size')} were written (truncated or replaced)"
    if hash_file(path) != want.get("sha256"):
        return "no longer has the content that was written (sha256 differs)"
    return None


def record(out: Path, *rels: str) -> None:
    """Record the content of files just written into ``out`` (paths relative to it)."""
    out = Path(out)
    data = read(out) or {}
    outputs = dict(data.get("outputs", {}))
    for rel in rels:
        outputs[rel] = file_record(out / rel)
    _write(out, {**data, "outputs": outputs})


def reusable(out: Path, rel: str, data: dict[str, Any] | None = None) -> bool:
    """Whether ``out/rel`` is a file this tool recorded, with exactly the recorded content."""
    data = read(out) if data is None else data
    want = (data or {}).get("outputs", {}).get(rel)
    return want is not None and _check(Path(out) / rel, want) is None


def forget(out: Path, *rels: str) -> None:
    """Drop records of files about to be rewritten or deleted."""
    data = read(out) or {}
    outputs = {k: v for k, v in data.get("outputs", {}).items() if k not in rels}
    _write(out, {**data, "outputs": outputs})


def complete(out: Path) -> None:
    """Mark the output finished (call after the last file is in place and recorded)."""
    data = read(out) or {}
    _write(out, {**data, "complete": True})
    release(out)


def is_complete(out: Path) -> bool | None:
    """True / False from the manifest; None when there is none (not written by these tools)."""
    data = read(out)
    return None if data is None else bool(data.get("complete"))
