"""Insert, check or remove the one prelude line in verl's worker module.

The line goes at the end of the module: patches on classes defined there can only be
applied once the module body has run.
"""

from __future__ import annotations

from pathlib import Path

from verl_patches.base import atomic
from verl_patches.core.upstream import module_file

WORKER_MODULE = "verl.workers.megatron_workers"
LINE = "from verl_patches import prelude_patch  # noqa: E402,F401  (added by: python -m verl_patches hook install)"
_PREFIX = "from verl_patches import prelude_patch"
REINSTALL = "reinstall verl (pip install --force-reinstall --no-deps verl==0.4.1) and run `hook install` again"


class HookError(RuntimeError):
    """verl's worker module cannot be checked or changed; the message names the file and the fix."""


def worker_module_path(root: Path | None = None) -> Path:
    path = module_file(WORKER_MODULE, root)
    if path is None:
        raise FileNotFoundError(f"{WORKER_MODULE} not found " + (f"under {root}" if root else "on sys.path"))
    return path


def _has_line(text: str) -> bool:
    return any(line.strip().startswith(_PREFIX) for line in text.splitlines())


def _cut_short(text: str) -> bool:
    """Whether the file ends in a prelude line an interrupted write left incomplete.

    Writes are atomic now; older versions wrote in place, and a full disk could stop them
    part-way through the line.
    """
    last = text.rpartition("\n")[2]
    return bool(last.strip()) and last != LINE and LINE.startswith(last) and _valid(text) is not None


def _valid(text: str) -> tuple[int, str] | None:
    """None if ``text`` compiles, else (line, message) of the first syntax error."""
    try:
        compile(text, WORKER_MODULE, "exec", dont_inherit=True)
    except SyntaxError as e:
        return e.lineno or 0, e.msg
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise HookError(f"cannot read {path}: {e}") from None


def _checked_text(path: Path) -> tuple[str, bool]:
    """(text, whether it ends in a cut-short prelude line); HookError if it is broken otherwise."""
    text = _read(path)
    err = _valid(text)
    if err is None:
        return text, False
    if _cut_short(text):
        return text, True
    raise HookError(f"{path} is not valid Python (line {err[0]}: {err[1]}); the prelude line cannot be checked "
                    f"or changed safely: {REINSTALL}")


def _write(path: Path, text: str) -> None:
    try:
        atomic.write_text(path, text)
    except OSError as e:
        raise HookError(f"could not write {path}: {e.strerror or e}; the file is unchanged") from None


def status(root: Path | None = None) -> tuple[bool, Path]:
    """(whether the prelude line is present, path); HookError if the module is damaged."""
    path = worker_module_path(root)
    text, cut = _checked_text(path)
    if cut:
        raise HookError(f"{path} ends in a prelude line cut short by an interrupted write (syntax error); "
                        f"`python -m verl_patches hook install` repairs it")
    return _has_line(text), path


def _without_cut_line(text: str) -> str:
    body = text.rpartition("\n")[0] + "\n"
    # Drop the blank line install() put before it.
    return body[:-1] if body.endswith("\n\n") else body


def install(root: Path | None = None) -> tuple[bool, Path]:
    """Append the line if absent (repairing one cut short); return (changed, path)."""
    path = worker_module_path(root)
    text, cut = _checked_text(path)
    if cut:
        text = _without_cut_line(text)
    elif _has_line(text):
        return False, path
    sep = "" if text.endswith("\n") else "\n"
    _write(path, f"{text}{sep}\n{LINE}\n")
    return True, path


def remove(root: Path | None = None) -> tuple[bool, Path]:
    path = worker_module_path(root)
    text, cut = _checked_text(path)
    if cut:
        _write(path, _without_cut_line(text))
        return True, path
    if not _has_line(text):
        return False, path
    lines = text.splitlines(keepends=True)
    kept = [ln for ln in lines if not ln.strip().startswith(_PREFIX)]
    # Drop the blank line install() put before it.
    if kept and kept[-1].strip() == "" and lines[-1].strip().startswith("from verl_patches"):
        kept = kept[:-1]
    _write(path, "".join(kept))
    return True, path
