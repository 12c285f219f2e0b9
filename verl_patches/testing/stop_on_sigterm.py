"""pytest plugin (pyproject.toml's addopts load it for every run, scripts/test.sh's included): SIGTERM
or SIGHUP stops the whole test run, with exit status 128 + the signal.

Without it, a SIGTERM that arrives while a test is inside ``procs.stop_on_signals`` (every
``run_distributed`` call) became ``procs.Terminated`` in that test, which pytest recorded as one
failed test and then ran on; one that arrived elsewhere killed pytest at once, before any test's
``finally`` could stop the processes it had started. Here the signal is ``procs.Terminated``
everywhere in the main thread (so ``finally`` blocks and fixtures' teardown stop children), and the
first test (or setup, or teardown) it ends stops the session.
"""

from __future__ import annotations

import signal
import threading

import pytest

from verl_patches import procs

_STOPPED: list[procs.Terminated] = []


def _raise(signum, _frame):
    raise procs.Terminated(signum)


def pytest_sessionstart(session) -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    if call.excinfo is not None and isinstance(call.excinfo.value, procs.Terminated):
        _STOPPED.append(call.excinfo.value)
        item.session.shouldstop = f"{call.excinfo.value}: the test run stops here"


def pytest_sessionfinish(session, exitstatus) -> None:
    if _STOPPED:
        session.exitstatus = _STOPPED[0].exit_code
