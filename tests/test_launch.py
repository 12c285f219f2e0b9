"""The multi-process runner the distributed tests and the preflight stand on: results by rank, a
failing rank reported without waiting for the timeout, a hang named with its stacks, and ports
that the job's own connections cannot be holding."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from verl_patches.base import ports
from verl_patches.launch import local_ranks as rd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import the bodies by name
from launch_ranks import echo, environment_and_modules, one_rank_raises, one_rank_sleeps  # noqa: E402

from tests.helpers import run_py  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_results_come_back_by_rank(monkeypatch, start):
    monkeypatch.setenv("VERL_PATCHES_RANK_START", start)
    assert rd.run_distributed(echo, 3, {"x": 1}, timeout=120) == [(r, 3, {"x": 1}) for r in range(3)]


@pytest.mark.slow
def test_a_forked_rank_takes_the_callers_environment_of_the_call(monkeypatch):
    """The forkserver's environment is that of its start; a rank must see the caller's at the call, as a
    spawned rank does: a variable set since is there, one removed since is not. The preload is imported."""
    monkeypatch.setenv("VERL_PATCHES_RANK_START", "forkserver")
    monkeypatch.setenv("VERL_PATCHES_RANK_PRELOAD", "torch,megatron.core")
    monkeypatch.setenv("LAUNCH_TEST_GONE", "before")
    rd.run_distributed(echo, 1, None, timeout=120)  # the server is up (if this process had none yet)
    monkeypatch.setenv("LAUNCH_TEST_SET", "after the server started")
    monkeypatch.delenv("LAUNCH_TEST_GONE")
    (env, preloaded, ppid), = rd.run_distributed(environment_and_modules, 1, ["LAUNCH_TEST_SET", "LAUNCH_TEST_GONE"],
                                                 timeout=120)
    assert env == {"LAUNCH_TEST_SET": "after the server started", "LAUNCH_TEST_GONE": None}
    assert ppid != os.getpid()  # the forkserver's child, not this process's
    assert preloaded, "megatron.core was not imported by the forkserver"


@pytest.mark.slow
def test_a_preload_that_fails_is_named():
    """The forkserver drops preload errors silently; a rank forked from it must fail naming the module."""
    code = ("import sys; sys.path.insert(0, 'tests')\n"
            "from launch_ranks import echo\n"
            "from verl_patches.launch.local_ranks import run_distributed, DistributedFailure\n"
            "try:\n"
            "    run_distributed(echo, 1, None, timeout=120)\n"
            "except DistributedFailure as e:\n"
            "    print(e)\n")
    r = run_py(code, env={"VERL_PATCHES_RANK_START": "forkserver",
                          "VERL_PATCHES_RANK_PRELOAD": "torch,no_such_module_for_the_test"})
    assert "could not preload no_such_module_for_the_test: ModuleNotFoundError" in r.stdout, r.stdout + r.stderr


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


def test_device_ranks_always_spawn(monkeypatch):
    """Forking from the server is for gloo ranks only: a device runtime cannot be used in a child forked
    from a process that queried it (checked over NCCL on two GPUs: docs/benchmarks.md)."""
    monkeypatch.setenv("VERL_PATCHES_RANK_START", "forkserver")
    for backend in ("nccl", "hccl"):
        ctx, caller = rd._context(backend)
        assert ctx.get_start_method() == "spawn" and caller is None
    ctx, caller = rd._context("gloo")
    assert ctx.get_start_method() == "forkserver" and set(caller[1]) <= {1, 2}
