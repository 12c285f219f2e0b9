"""Issue 29, item 4: every rank of run_distributed (and so of the local preflight) heartbeats; a rank that
stops answering (SIGSTOP here) is named and the call ends within heartbeat + grace, not at its timeout
(the preflight's is an hour: a stopped rank used to block it with no output). Real gloo processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from verl_patches.launch import procs
from verl_patches.launch.local_ranks import DistributedFailure, run_distributed
from tests.helpers import rank_pids

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import the bodies by name
from launch_ranks import spin  # noqa: E402

pytestmark = pytest.mark.slow


def _threads(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


@pytest.mark.timeout(180)
def test_a_stopped_rank_is_named_and_the_call_ends_within_the_bound(tmp_path):
    stopped: dict[str, float] = {}

    def stop_rank_1():
        f = tmp_path / "rank1"
        while not f.exists() and "give_up" not in stopped:
            time.sleep(0.05)
        if f.exists():
            time.sleep(0.2)
            stopped["pid"] = int(f.read_text())
            os.kill(stopped["pid"], signal.SIGSTOP)
            stopped["at"] = time.monotonic()

    th = threading.Thread(target=stop_rank_1, daemon=True)
    th.start()
    heartbeat, grace = 3.0, 3.0
    try:
        with pytest.raises(DistributedFailure) as e:
            run_distributed(spin, 3, str(tmp_path), 120.0, heartbeat=heartbeat, grace=grace, timeout=150)
    finally:
        stopped["give_up"] = 1.0
    took = time.monotonic() - stopped["at"]
    msg = str(e.value)
    assert f"rank 1 (pid {stopped['pid']}) stopped answering: it is stopped (process state T: SIGSTOP)" in msg, msg
    # The two others were waiting in a collective for it: named as still running after the failure.
    assert "ranks [0, 2] were still running" in msg, msg
    # heartbeat + grace + the 2 s stack dump, and a loaded 2-core host's slack.
    assert took < heartbeat + grace + 2 + 10, took
    assert not procs.alive(stopped["pid"])


@pytest.mark.timeout(300)
def test_the_preflight_names_a_stopped_rank_and_stops(tmp_path):
    """The issue's example: one rank SIGSTOPped blocked `preflight` with no output (still blocked at 150 s)."""
    heartbeat = 8
    p = subprocess.Popen([sys.executable, "-m", "verl_patches", "preflight", "--nproc", "2", "--method", "direct",
                          "--no-plan", "--heartbeat-timeout", str(heartbeat)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = None
    try:
        deadline = time.monotonic() + 120
        while victim is None and time.monotonic() < deadline and p.poll() is None:
            # A rank (spawned, or forked by the forkserver) whose heartbeat thread runs
            # (rank_boot starts it before anything else: a second thread means it beats).
            for pid in rank_pids(p.pid):
                if _threads(pid) >= 2:
                    victim = pid
                    break
            time.sleep(0.1)
        assert victim is not None, "no rank found running"
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            procs.kill_tree([p.pid], grace=0)
    assert p.returncode == 1, out[-2000:] + err[-3000:]
    assert "preflight FAILED" in err and f"(pid {victim}) stopped answering: it is stopped" in err, err[-3000:]
    assert took < heartbeat + min(30, heartbeat) + 2 + 15, took
    assert not procs.alive(victim)


@pytest.mark.timeout(180)
def test_a_rank_stuck_holding_the_gil_is_named_by_its_silent_heartbeat(tmp_path):
    """Not stopped, but its heartbeat thread cannot run (native code that keeps the GIL)."""
    t0 = time.monotonic()
    with pytest.raises(DistributedFailure) as e:
        run_distributed(spin, 2, str(tmp_path), 90.0, 1, heartbeat=3.0, grace=3.0, timeout=150)
    took = time.monotonic() - t0
    msg = str(e.value)
    pid = int((tmp_path / "rank1").read_text())
    assert f"rank 1 (pid {pid}) stopped answering: no heartbeat for" in msg and "holding the GIL" in msg, msg
    assert "rank 0 (pid" not in msg.split("--- rank 1 ---")[0].split("--- rank 0 ---")[-1] or "ranks [0]" in msg, msg
    assert took < 90, took  # the stuck call would have lasted 90 s, the timeout 150 s
    assert not procs.alive(pid)


def test_a_zero_heartbeat_is_refused():
    with pytest.raises(ValueError, match="0 would switch the liveness check off"):
        run_distributed(spin, 1, "/nonexistent", 0.0, heartbeat=0)
    r = subprocess.run([sys.executable, "-m", "verl_patches", "preflight", "--heartbeat-timeout", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "argument --heartbeat-timeout: '0': expected a finite number > 0" in r.stderr
    assert "0 would switch the liveness check off" in r.stderr
