"""The reward is bounded in time on any response (finding 6): extraction is linear however many
boxes, braces or unclosed boxes a response holds, and math-verify's check stops after the
timeout from any thread, even on input that makes sympy compute for ever inside one C call.

Uses the real math-verify in its helper process; no fakes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from verl_patches.reward import deepscaler as D

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, text, expected", [
    ("unclosed boxes", "\\boxed{" * 8000, None),  # 61 s with the old search
    ("unclosed after a good box", "\\boxed{7}" + "\\boxed{" * 40000, "7"),
    ("brace-less boxes without argument", "\\boxed}" * 40000, None),
    ("spaces then another box", "\\boxed     " * 20000, "\\boxed"),
    ("deep nesting", "\\boxed{" + "{" * 100000 + "}" * 100000 + "}", "{" * 100000 + "}" * 100000),
    ("unbalanced closers", "}" * 100000 + "\\boxed{1}", "1"),
    ("escaped braces", "\\boxed{" + "\\{" * 50000 + "}", "\\{" * 50000),
    ("boxedfoo commands", "\\boxedfoo{1}" * 30000, None),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "")
@pytest.mark.timeout(30)
def test_extraction_is_linear_on_adversarial_responses(name, text, expected):
    t0 = time.perf_counter()
    got = D.extract_last_boxed(text)
    took = time.perf_counter() - t0
    assert got == expected
    # 40,000 unclosed boxes took minutes with the quadratic search; linear is milliseconds.
    assert took < 1.0, f"{name}: {took:.2f}s"


def test_scoring_many_unclosed_boxes_is_fast():
    t0 = time.perf_counter()
    assert D.compute_score("deepscaler", "\\boxed{" * 8000, "1") == 0.0
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.timeout(120)
def test_a_check_that_never_ends_is_stopped_off_the_main_thread():
    """A power tower makes sympy compute for ever inside one C call, holding the GIL: only a
    check in another process can be stopped. verl scores off the main thread, so the test does.
    The body runs in a child process so that a regression fails this test instead of freezing
    the test session (a thread holding the GIL would block pytest's own timeout too)."""
    code = textwrap.dedent(r"""
        import json, threading, time
        from verl_patches.reward import deepscaler as D
        warm = D.compute_score("deepscaler", "\\boxed{\\frac{1}{2}}", "0.5")  # starts the helper
        D.CHECK_TIMEOUT_S = 1.0
        out = []
        t0 = time.monotonic()
        worker = threading.Thread(target=lambda: out.append(D.compute_score("deepscaler", "\\boxed{9^{9^{9^{9^{9^{9}}}}}}", "1")), daemon=True)
        worker.start()
        worker.join(60)
        took = time.monotonic() - t0
        after = D.compute_score("deepscaler", "\\boxed{2^{10}}", "1024")  # a fresh helper took over
        print("RESULT" + json.dumps({"warm": warm, "out": out, "took": took, "after": after}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("the reward never returned on a power tower")
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, r.stdout + r.stderr
    res = json.loads(line[len("RESULT"):])
    assert res["warm"] == 1.0 and res["out"] == [0.0] and res["after"] == 1.0, res
    assert res["took"] < 10, res


def test_concurrent_scoring_from_many_threads_agrees():
    cases = [("\\boxed{\\frac{3}{6}}", "0.5", 1.0), ("\\boxed{3}", "4", 0.0), ("\\boxed{2+2}", "4", 1.0)] * 4
    out: dict[int, float] = {}
    threads = [threading.Thread(target=lambda i=i, c=c: out.__setitem__(i, D.compute_score("deepscaler", c[0], c[1])))
               for i, c in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [out[i] for i in range(len(cases))] == [c[2] for c in cases]
