"""The reward's math-verify helper: reads [gold, pred] JSON lines, answers 1 or 0 per line.

Run by verl_patches.reward.deepscaler as a separate process, so that a check can be stopped
from any thread of the scoring process; it exits when its input closes or its parent dies.
"""

import ctypes
import json
import logging
import os
import signal
import sys


def main() -> None:
    parent = int(sys.argv[1])
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        return
    # Lazy: math-verify after the parent check (a worker whose parent is gone exits without importing it).
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # The caller bounds each check; math-verify would warn on every call that its own is off.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        try:
            gold, pred = json.loads(line)
            g = parse(f"${gold}$", extraction_config=configs, parsing_timeout=None)
            p = parse(f"${pred}$", extraction_config=configs, parsing_timeout=None)
            ok = bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=None))
        except Exception:  # noqa: BLE001 - a checker failure on a model output means "not correct"
            ok = False
        out.write(b"1\n" if ok else b"0\n")
        out.flush()


if __name__ == "__main__":
    main()
