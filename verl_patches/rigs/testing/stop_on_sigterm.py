"""pytest plugin (pyproject.toml's addopts load it for every run, scripts/test.sh's included): SIGTERM
or SIGHUP stops the whole test run, with exit status 128 + the signal.

Without it, a SIGTERM that arrives while a test is inside ``procs.stop_on_signals`` (every
``run_distributed`` call) became ``procs.Terminated`` in that test, which pytest recorded as one
failed test and then ran on; one that arrived elsewhere killed pytest at once, before any test's
``finally`` could stop the processes it had started. Here the signal is ``procs.Terminated``
everywhere in the main thread (so ``finally`` blocks and fixtures' teardown stop children), and the
first test (or setup, or teardown) it ends stops the session. A repeated signal while the run is
already stopping is not raised again: it would cut the teardown that stops the children short.

With pytest-xdist (scripts/test.sh runs the suite on workers) the signal reaches the controller,
which runs no test: it passes the signal to its workers (its own children, nothing below them) and
stops scheduling; each worker stops its running test as above. The run exits 128 + the signal.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from verl_patches.launch import procs

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_STOPPED: list[procs.Terminated] = []


def _raise(signum, _frame):
    if _STOPPED:
        return  # already stopping: let the teardown finish
    _STOPPED.append(procs.Terminated(signum))
    raise _STOPPED[0]


def _controller_handler(dsession):
    def forward(signum, _frame):
        if not _STOPPED:
            _STOPPED.append(procs.Terminated(signum))
        dsession.shouldstop = f"{_STOPPED[0]}: the test run stops here"
        for pid in procs.children(os.getpid()):  # the xdist workers
            try:
                os.kill(pid, signum)
            except OSError:
                pass
    return forward


def pytest_sessionstart(session) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    dsession = session.config.pluginmanager.get_plugin("dsession")  # the xdist controller, else None
    handler = _raise if dsession is None else _controller_handler(dsession)
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    if call.excinfo is not None and isinstance(call.excinfo.value, procs.Terminated):
        if not _STOPPED:  # raised by procs.stop_on_signals' own handler
            _STOPPED.append(call.excinfo.value)
        item.session.shouldstop = f"{call.excinfo.value}: the test run stops here"


def pytest_sessionfinish(session, exitstatus) -> None:
    if _STOPPED:
        session.exitstatus = _STOPPED[0].exit_code
