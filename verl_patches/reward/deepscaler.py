"""Deepscaler rule reward: the last \\boxed{} answer, checked for equivalence with math-verify.

Entry point for verl: ``verl_patches.reward.deepscaler.compute_score`` (custom_reward_function.path / name).
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from verl_patches.base import env as overlay_env

# Responses are up to 3072 tokens (~12k characters); the cap only guards the checker
# against pathological inputs (sympy can take minutes on a huge expression).
MAX_ANSWER_CHARS = 1000
# Seconds one equivalence check may take. The check runs in a helper process: math-verify's own
# timeout is a SIGALRM (main thread only; verl's reward managers call from other threads), and
# sympy evaluating e.g. a power tower holds the GIL inside one C call, so no thread of this
# process could interrupt it. A check that overruns scores 0 and the helper is replaced.
# VERL_PATCHES_REWARD_TIMEOUT_S (verl_patches/base/env.py) sets it: a finite number of seconds in (0, 3600];
# 0 would score every answer that needs math-verify 0.0 and is refused where it is read.
CHECK_TIMEOUT_S = overlay_env.get("VERL_PATCHES_REWARD_TIMEOUT_S")

# A box command not followed by a letter (\boxedfoo is another command).
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![^\W\d_])")
_TOKEN_RE = re.compile(r"[^\s$]+")


def _brace_pairs(text: str) -> dict[int, int]:
    """Each ``{`` position mapped to its matching ``}``, in one pass (escaped braces do not nest)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    k, n = 0, len(text)
    while k < n:
        c = text[k]
        if c == "\\" and k + 1 < n and text[k + 1] in "{}":
            k += 2
            continue
        if c == "{":
            stack.append(k)
        elif c == "}" and stack:
            pairs[stack.pop()] = k
        k += 1
    return pairs


def extract_last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None if there is none.

    ``\\boxed 5`` (no braces, one token) is accepted as well; an unclosed box is no answer and
    the one before it counts (a truncated response). Linear in the length of ``text`` whatever
    it holds: every brace is matched once, every box looked at once.
    """
    if not isinstance(text, str):
        raise TypeError(f"response must be a str, got {type(text).__name__}")
    boxes = [m.end() for m in _BOX_RE.finditer(text)]
    if not boxes:
        return None
    pairs: dict[int, int] | None = None
    n = len(text)
    for after in reversed(boxes):
        j = after
        while j < n and text[j] == " ":
            j += 1
        if j >= n:
            continue
        if text[j] == "{":
            if pairs is None:
                pairs = _brace_pairs(text)
            close = pairs.get(j)
            if close is not None:
                return text[j + 1 : close]
            continue
        if j > after:  # "\boxed 5": the argument is the next whitespace-delimited token
            m = _TOKEN_RE.match(text, j)
            if m:
                return m.group(0)
    return None


_STRIP_RE = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\s+")


def normalize(ans: str) -> str:
    """Cheap canonical form for the exact-match fast path (spacing, \\dfrac, trailing dot)."""
    s = _STRIP_RE.sub("", ans)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.rstrip(".")
    if s.startswith("$") and s.endswith("$") and len(s) >= 2:
        s = s.strip("$")
    return s


def _ground_truth_answer(ground_truth: Any) -> str:
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)):
        raise TypeError(f"ground_truth must be str, int or float, got {type(ground_truth).__name__}")
    gt = str(ground_truth).strip()
    boxed = extract_last_boxed(gt)
    return boxed if boxed is not None else gt


def is_equivalent(pred: str, gold: str) -> bool:
    """True if ``pred`` equals ``gold`` after normalisation or math-verify finds them equal
    within CHECK_TIMEOUT_S (from any thread)."""
    if normalize(pred) == normalize(gold):
        return True
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    return _checker().check(gold, pred, CHECK_TIMEOUT_S) is True


_WORKER = Path(__file__).with_name("_verify_worker.py")


class _Checker:
    """One math-verify helper process per scoring process, started on first use, asked one
    pair at a time over pipes (microseconds on top of the check itself), replaced after a
    timeout or a crash."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.buf = b""
        self.timeouts = 0

    def _start(self) -> subprocess.Popen:
        self.buf = b""
        self.proc = _spawn([sys.executable, str(_WORKER), str(os.getpid())], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, close_fds=True, env=_worker_env())
        # It imports math-verify and sympy first (about a second, more on a busy host); that
        # time is not any check's.
        if self._line(STARTUP_TIMEOUT_S) != b"ready":
            self.stop()
            raise RuntimeError(f"the reward's math-verify helper ({_WORKER}) did not start within "
                               f"{STARTUP_TIMEOUT_S:.0f} s; see its error above")
        return self.proc

    def _line(self, timeout: float) -> bytes | None:
        """The helper's next line, or None if none came within ``timeout`` (or it died)."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.strip()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def check(self, gold: str, pred: str, timeout: float) -> bool | None:
        """True / False, or None when the check overran ``timeout`` (the helper is then replaced)."""
        request = (json.dumps([gold, pred]) + "\n").encode()
        with self.lock:
            proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
            try:
                os.write(proc.stdin.fileno(), request)
            except OSError:  # it died since the last check: once more with a fresh one
                self.stop()
                os.write(self._start().stdin.fileno(), request)
            answer = self._line(timeout)
            if answer is None:
                self.timeouts += 1
                self.stop()
                return None
            return answer == b"1"


STARTUP_TIMEOUT_S = 120.0

# The helper asks the kernel to kill it when its parent dies (a check may be stuck in sympy and
# never read its input again). The kernel means the parent *thread*: scoring threads come and
# go, so helpers are started from one thread that lives as long as the process.
_spawner: tuple[int, threading.Thread, queue.Queue] | None = None  # (pid, thread, requests)


def _spawner_loop(requests: queue.Queue) -> None:
    while True:
        args, kwargs, box, done = requests.get()
        try:
            box.append(subprocess.Popen(args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append(e)
        done.set()


def _spawn(args: list[str], **kwargs: Any) -> subprocess.Popen:
    global _spawner
    with _checkers_lock:
        # Per process: a forked child has neither its parent's thread nor a usable copy of its queue.
        if _spawner is None or _spawner[0] != os.getpid() or not _spawner[1].is_alive():
            requests: queue.Queue = queue.Queue()
            thread = threading.Thread(target=_spawner_loop, args=(requests,), name="verl_patches-reward-spawner",
                                      daemon=True)
            thread.start()
            _spawner = (os.getpid(), thread, requests)
        requests = _spawner[2]
    box: list = []
    done = threading.Event()
    requests.put((args, kwargs, box, done))
    done.wait()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


_checkers: dict[int, _Checker] = {}
_checkers_lock = threading.Lock()


def _checker() -> _Checker:
    # Per process: a forked child must not share its parent's helper or pipes.
    pid = os.getpid()
    with _checkers_lock:
        c = _checkers.get(pid)
        if c is None:
            c = _checkers[pid] = _Checker()
        return c


def _worker_env() -> dict[str, str]:
    spec = importlib.util.find_spec("math_verify")
    if spec is None or not spec.origin:
        raise ImportError("math-verify is not installed: the deepscaler reward needs it (requirements.txt)")
    env = dict(os.environ)
    # The helper imports math_verify from wherever this process finds it.
    site = str(Path(spec.origin).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([site, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl custom reward: 1.0 if the last boxed answer matches ``ground_truth``, else 0.0."""
    pred = extract_last_boxed(solution_str)
    if pred is None or not pred.strip():
        return 0.0
    return 1.0 if is_equivalent(pred.strip(), _ground_truth_answer(ground_truth)) else 0.0
