"""The last lines of a checking command (``main``): what it found, on the streams the launchers read,
and its exit code. One implementation for the config validator, the data check, the checkpoint check
and the launchers' checks."""

from __future__ import annotations

import sys
from typing import Iterable


def finish(errors: Iterable[str], ok: str | None = None, *, code: int = 1, lines: Iterable[str] = (),
           warnings: Iterable[str] = (), failed: str | None = None) -> int:
    """``lines`` on stdout; each warning and error on stderr (``warning: ``, ``error: ``); then, with an
    error, ``failed`` on stderr and ``code``; without one, ``ok`` on stdout and 0."""
    errors = list(errors)
    for line in lines:
        print(line)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    for msg in errors:
        print(f"error: {msg}", file=sys.stderr)
    if errors:
        if failed:
            print(failed, file=sys.stderr)
        return code
    if ok:
        print(ok)
    return 0
