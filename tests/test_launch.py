"""The multi-process runner the distributed tests and the preflight stand on: results by rank, a
failing rank reported without waiting for the timeout, a hang named with its stacks, and ports
that the job's own connections cannot be holding."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from verl_patches import ports
from verl_patches import launch as rd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import the bodies by name
from launch_ranks import echo, one_rank_raises, one_rank_sleeps  # noqa: E402


@pytest.mark.slow
def test_results_come_back_by_rank():
    assert rd.run_distributed(echo, 3, {"x": 1}, timeout=120) == [(r, 3, {"x": 1}) for r in range(3)]


def test_a_failing_rank_is_named_and_its_peers_errors_follow():
    with pytest.raises(rd.DistributedFailure) as e:
        rd.run_distributed(one_rank_raises, 3, "barrier", timeout=300)
    msg = str(e.value)
    assert "--- rank 1 ---" in msg and "ValueError: rank 1 refuses" in msg
    assert "were still running" not in msg  # gloo failed the peers' barrier: nobody hung


@pytest.mark.slow
def test_peers_left_waiting_by_a_failure_are_killed_after_the_grace(capfd):
    t0 = time.monotonic()
    with pytest.raises(rd.DistributedFailure) as e:
        rd.run_distributed(one_rank_raises, 3, "forever", timeout=600, grace=5)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "1 of 3 rank(s) failed" in msg and "ValueError: rank 1 refuses" in msg
    assert "ranks [0, 2] were still running 5s after the first failure" in msg
    assert took < 120, took  # not the 600 s timeout
    assert "one_rank_raises" in capfd.readouterr().err  # faulthandler's stacks of the waiting ranks


@pytest.mark.slow
def test_a_hang_is_a_timeout_naming_the_rank(capfd):
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of 2 did not finish in 25s"):
        rd.run_distributed(one_rank_sleeps, 2, 3600.0, timeout=25)
    assert "one_rank_sleeps" in capfd.readouterr().err


def test_port_blocks_are_free_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    for count in (1, 16):
        base = rd.free_port_block(count)
        assert 10000 <= base and base + count <= low
        for p in range(base, base + count):
            with socket.socket() as s:
                s.bind(("", p))  # raises if taken


def test_a_taken_port_is_skipped(monkeypatch):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        taken = s.getsockname()[1]
        # Only the taken port is offered as a start: every try fails and the error says so.
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 1, 60999))
        monkeypatch.setattr(ports, "_LOWEST_PORT", taken)
        with pytest.raises(RuntimeError, match="no 1 consecutive free ports found in 5 tries"):
            rd.free_port_block(1, tries=5)
