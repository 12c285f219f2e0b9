"""Process lifetimes for every multi-process entry point: children die with their parent, and a
parent stopped by SIGTERM, SIGINT or SIGHUP takes its whole process tree down with it.

``python -m verl_patches.launch.procs exec -- CMD ...`` runs CMD so that it is signalled when the
calling shell dies (the launchers start Ray and the trainer this way).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Iterable, Iterator

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Terminated(BaseException):
    """Raised in the main thread when SIGTERM or SIGHUP arrives inside ``stop_on_signals``.

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` cannot swallow it on
    its way to the code that tears the children down.
    """

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when the thread that created it exits.

    Kept across exec (not across setuid). False where prctl is unavailable (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_owner(pid: int, interval: float) -> None:
    while True:
        time.sleep(interval)
        if not alive(pid):
            os._exit(1)


def die_with(owner_pid: int, sig: int = signal.SIGKILL, interval: float = 1.0) -> None:
    """Make this process end when ``owner_pid`` ends, however it ended: its parent, or the process that
    asked a server to start it (a forkserver's child).

    The parent-death signal follows the parent (for a forkserver's child, the server, which ends with its
    owner). A daemon thread polls the owner's pid where the owner is not the parent, or where the signal
    is unavailable (not Linux). The owner may already be gone before either is armed: then exit now.
    """
    armed = set_parent_death_signal(sig)
    direct = os.getppid() == owner_pid
    if not direct and not alive(owner_pid):
        os._exit(1)
    if not (direct and armed):
        threading.Thread(target=_watch_owner, args=(owner_pid, interval), daemon=True,
                         name="verl_patches-owner-watch").start()


def _children_by_scan(pid: int) -> list[int]:
    """Children from every process's parent pid (kernels without /proc/PID/task/TID/children)."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            kids.append(int(entry))
    return kids


def children(pid: int) -> list[int]:
    """The live children of ``pid``, read from /proc; [] elsewhere."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    listed = False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
            listed = True
        except OSError:
            continue
    return kids if listed or not tasks else _children_by_scan(pid)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first-level first), read from /proc; [] elsewhere."""
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = [k for k in children(todo.pop()) if k not in out]
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not os.path.isdir("/proc") or os.path.exists(f"/proc/{pid}")


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(roots: Iterable[int], grace: float = 3.0) -> list[int]:
    """SIGTERM ``roots`` and everything below them, SIGKILL what is left after ``grace`` seconds.

    Descendants are collected before anything is signalled (a killed parent's children are
    re-parented and could not be found afterwards). Returns the pids that were signalled.
    """
    roots = [p for p in roots if p and p != os.getpid()]
    tree: list[int] = []
    for r in roots:
        tree += [r] + [d for d in descendants(r) if d not in tree]
    _signal_all(tree, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in tree):
        time.sleep(0.05)
    _signal_all([p for p in tree if alive(p)], signal.SIGKILL)
    return tree


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into ``Terminated`` in the main thread (SIGINT already raises
    KeyboardInterrupt), so ``finally`` blocks that stop children run however the process is
    asked to stop. Elsewhere than the main thread this does nothing. Only the first signal is
    raised: a second one (a process group's signal and a forwarded one, say) must not cut short the
    ``finally`` that is stopping the children."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[int] = []

    def _raise(signum, _frame):
        if not raised:
            raised.append(signum)
            raise Terminated(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, _raise)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exec(argv: list[str]) -> int:
    """Become ``argv`` with SIGTERM armed for when our parent (the launcher's shell) dies."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: python -m verl_patches.launch.procs exec -- CMD [ARGS...]", file=sys.stderr)
        return 2
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() == 1:  # the shell is already gone
        return 1
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"error: cannot run {argv[0]!r}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "exec":
        print("usage: python -m verl_patches.launch.procs exec -- CMD [ARGS...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(_exec(args[1:]))
