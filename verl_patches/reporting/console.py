"""``python -m verl_patches.reporting.console LOG``: the trainer's whole output into LOG, the report's lines on
the console.

A launcher pipes verl's trainer (its driver and, through Ray, every worker) into it
(scripts/cluster/launch.sh with LAUNCH_CONSOLE=steps, as scripts/train_tiny.sh runs). Every line is
appended to LOG as it came; the lines the run's report prints (verl_patches/reporting/report.py,
``CONSOLE_LINE``: the header, one line per step, the summary) are also written to stdout, without
Ray's ``(TaskRunner pid=...)`` prefix and colours. It reads until the trainer's end of output and
ignores SIGINT, so that it drains what a stopping trainer still writes; the launcher's teardown stops
the trainer, and the end of its output ends this process.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from typing import BinaryIO, TextIO

from verl_patches.reporting.report import CONSOLE_LINE
from verl_patches.base.schema import PathArg

# Ray's colour codes and the prefix it gives a worker's lines: "(TaskRunner pid=123)" or, from another
# node, "(TaskRunner pid=123, ip=10.0.0.2)".
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAY_PREFIX = re.compile(r"^\([A-Za-z_][\w.]* pid=\d+(?:, ip=[^)]*)?\) ")


def console_line(raw: str) -> str | None:
    """The line as the console shows it, if it is one of the report's; else None."""
    text = _RAY_PREFIX.sub("", _ANSI.sub("", raw.rstrip("\r\n")))
    return text if CONSOLE_LINE.match(text) else None


def relay(source: BinaryIO, log: BinaryIO, out: TextIO) -> int:
    """Copy ``source`` into ``log`` line by line and the report's lines to ``out``; return their count."""
    shown = 0
    for raw in iter(source.readline, b""):
        log.write(raw)
        log.flush()
        line = console_line(raw.decode("utf-8", errors="replace"))
        if line is not None:
            print(line, file=out, flush=True)
            shown += 1
    return shown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.reporting.console", description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=PathArg("log file"), help="file the whole output is appended to")
    args = p.parse_args(argv)
    try:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        log = open(args.log, "ab")
    except OSError as e:
        print(f"error: cannot write the log {args.log}: {e.strerror}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with log:
        relay(sys.stdin.buffer, log, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
