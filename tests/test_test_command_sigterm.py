"""Issue 29, item 4: SIGTERM to the test command (scripts/test.sh, which execs pytest) stops the whole run
with a non-zero exit. It used to fail the one test that was inside procs.stop_on_signals (every
run_distributed call) and run on; elsewhere it killed pytest before any teardown. The plugin is
verl_patches/rigs/testing/stop_on_sigterm.py, loaded by pyproject.toml's addopts."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from verl_patches.launch import procs

REPO = Path(__file__).resolve().parents[1]

TESTS = '''
import os, time
from pathlib import Path
from verl_patches.launch import procs

OUT = Path(os.environ["SIGTERM_TEST_DIR"])

def test_first():
    OUT.joinpath("first-ran").write_text("")

def test_waits():
    try:
        if os.environ["SIGTERM_TEST_WHERE"] == "stop_on_signals":
            with procs.stop_on_signals():  # as in run_distributed
                OUT.joinpath("ready").write_text("")
                time.sleep(120)
        else:
            OUT.joinpath("ready").write_text("")
            time.sleep(120)
    finally:
        OUT.joinpath("teardown-ran").write_text("")  # what stops a test's children runs

def test_after():
    OUT.joinpath("after-ran").write_text("")
'''


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("where", ["stop_on_signals", "plain"])
def test_sigterm_stops_the_whole_test_run(tmp_path, where):
    (tmp_path / "test_sig.py").write_text(TESTS)
    env = {**os.environ, "SIGTERM_TEST_DIR": str(tmp_path), "SIGTERM_TEST_WHERE": where}
    # The repository's configuration (-c), as scripts/test.sh runs pytest for it; the test file is outside
    # tests/, so the suite's conftest (the upstream stack) is not loaded: a cheap pytest.
    p = subprocess.Popen(["bash", str(REPO / "scripts" / "test.sh"), "-c", str(REPO / "pyproject.toml"),
                          "-p", "no:cacheprovider", str(tmp_path / "test_sig.py")],
                         cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300  # test.sh checks the environment first
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
        assert (tmp_path / "ready").exists(), p.communicate()[0][-3000:] if p.poll() is not None else "not ready"
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)  # test.sh's pid is pytest's (exec)
        out, _ = p.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            procs.kill_tree([p.pid], grace=0)
    assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert (tmp_path / "first-ran").exists() and (tmp_path / "teardown-ran").exists()
    assert not (tmp_path / "after-ran").exists(), out[-3000:]
    assert "stopped by SIGTERM: the test run stops here" in out, out[-3000:]
    assert took < 10, took
