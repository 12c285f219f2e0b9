"""A copy of the installed verl with the prelude line, for a run that must not edit the installed one.

The cluster's two ways to put the one line into verl's worker module are ``hook install`` on the
installed verl, or copying the upstream packages next to the overlay (README). The tiny run takes
the second: the test environment's verl stays as installed (the test suite imports it), and the
copy under ``DIR/verl`` goes first on PYTHONPATH. Re-running refreshes the copy when the installed
verl changed (its version or its worker module).

``python -m verl_patches.rigs.tiny.upstream DIR``
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import shutil
import sys
from pathlib import Path

from verl_patches.core import hook
from verl_patches.base.schema import PathArg

STAMP = ".verl_patches_copy"


def _installed_verl() -> Path:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("verl is not installed in this Python (scripts/setup_test_env.sh installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


def _fingerprint(src: Path) -> str:
    worker = src / "workers" / "megatron_workers.py"
    version = (src / "version" / "version").read_text() if (src / "version" / "version").is_file() else ""
    return hashlib.sha256(version.encode() + worker.read_bytes()).hexdigest()[:16]


def prepare(root: Path, source: Path | None = None) -> Path:
    """``root/verl``: a copy of the installed verl whose worker module ends with the prelude line."""
    src = Path(source) if source else _installed_verl()
    if src.resolve().is_relative_to(Path(root).resolve()):
        raise ValueError(f"{root} already holds the verl on sys.path ({src}): give another directory")
    dst = Path(root) / "verl"
    stamp = Path(root) / STAMP
    want = _fingerprint(src)
    if not (dst.is_dir() and stamp.is_file() and stamp.read_text().strip() == want):
        # Built aside and moved in whole: an interrupted copy never passes for a good one.
        partial = Path(root) / ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(src, partial / "verl", ignore=shutil.ignore_patterns("__pycache__"))
        hook.install(partial)
        if dst.exists():
            shutil.rmtree(dst)
        (partial / "verl").rename(dst)
        partial.rmdir()
        stamp.write_text(want + "\n")
    present, path = hook.status(Path(root))
    if not present:
        raise RuntimeError(f"{path} lacks the prelude line after copying")
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.rigs.tiny.upstream", description=__doc__.split("\n")[0])
    p.add_argument("root", type=PathArg("directory"))
    args = p.parse_args(argv)
    try:
        dst = prepare(args.root)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"verl with the prelude line: {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
