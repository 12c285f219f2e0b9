"""Insert, check or remove the one prelude line in verl's worker module.

The line goes at the end of the module: patches on classes defined there can only be
applied once the module body has run.
"""

from __future__ import annotations

from pathlib import Path

from verl_patches.core.upstream import module_file

WORKER_MODULE = "verl.workers.megatron_workers"
LINE = "from verl_patches import prelude_patch  # noqa: E402,F401  (added by: python -m verl_patches hook install)"


def worker_module_path(root: Path | None = None) -> Path:
    path = module_file(WORKER_MODULE, root)
    if path is None:
        raise FileNotFoundError(f"{WORKER_MODULE} not found " + (f"under {root}" if root else "on sys.path"))
    return path


def _has_line(text: str) -> bool:
    return any(line.strip().startswith("from verl_patches import prelude_patch") for line in text.splitlines())


def status(root: Path | None = None) -> tuple[bool, Path]:
    path = worker_module_path(root)
    return _has_line(path.read_text(encoding="utf-8")), path


def install(root: Path | None = None) -> tuple[bool, Path]:
    """Append the line if absent; return (changed, path)."""
    present, path = status(root)
    if present:
        return False, path
    text = path.read_text(encoding="utf-8")
    sep = "" if text.endswith("\n") else "\n"
    path.write_text(f"{text}{sep}\n{LINE}\n", encoding="utf-8")
    return True, path


def remove(root: Path | None = None) -> tuple[bool, Path]:
    present, path = status(root)
    if not present:
        return False, path
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [ln for ln in lines if not ln.strip().startswith("from verl_patches import prelude_patch")]
    # Drop the blank line install() put before it.
    if kept and kept[-1].strip() == "" and lines[-1].strip().startswith("from verl_patches"):
        kept = kept[:-1]
    path.write_text("".join(kept), encoding="utf-8")
    return True, path
