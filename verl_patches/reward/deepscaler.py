"""Deepscaler rule reward: the last \\boxed{} answer, checked for equivalence with math-verify.

Entry point for verl: ``verl_patches.reward.deepscaler.compute_score`` (custom_reward_function.path / name).
"""

from __future__ import annotations

import re
import threading
from typing import Any

# Responses are up to 3072 tokens (~12k characters); the cap only guards the checker
# against pathological inputs (sympy can take minutes on a huge expression).
MAX_ANSWER_CHARS = 1000
# math-verify's timeout is a SIGALRM, which only the main thread may install.
CHECK_TIMEOUT_S = 5

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _last_box_start(text: str) -> tuple[int, int] | None:
    """Position of the last box command and the index just after its name."""
    best = None
    for cmd in _BOX_COMMANDS:
        i = text.rfind(cmd)
        # \boxed must not be the prefix of a longer command name (e.g. \boxedfoo).
        while i != -1:
            after = i + len(cmd)
            if after >= len(text) or not text[after].isalpha():
                break
            i = text.rfind(cmd, 0, i)
        if i != -1 and (best is None or i > best[0]):
            best = (i, i + len(cmd))
    return best


def extract_last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None if there is none.

    ``\\boxed 5`` (no braces, one token) is accepted as well; an unclosed box is no answer.
    """
    if not isinstance(text, str):
        raise TypeError(f"response must be a str, got {type(text).__name__}")
    found = _last_box_start(text)
    while found is not None:
        start, after = found
        content = _box_content(text, after)
        if content is not None:
            return content
        # An unclosed last box (truncated response): fall back to the previous one.
        found = _last_box_start(text[:start])
    return None


def _box_content(text: str, after: int) -> str | None:
    j = after
    while j < len(text) and text[j] == " ":
        j += 1
    if j >= len(text):
        return None
    if text[j] != "{":
        # "\boxed 5": the argument is the next whitespace-delimited token.
        m = re.match(r"[^\s$]+", text[j:])
        return m.group(0) if (m and j > after) else None
    depth = 0
    k = j
    while k < len(text):
        c = text[k]
        if c == "\\" and k + 1 < len(text) and text[k + 1] in "{}":
            k += 2  # escaped braces (\{ \}) do not nest
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1 : k]
        k += 1
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
    """True if ``pred`` equals ``gold`` after normalisation or math-verify finds them equal."""
    if normalize(pred) == normalize(gold):
        return True
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    # Imported lazily: math-verify pulls in sympy (about 1 s), only the reward needs it.
    from math_verify import LatexExtractionConfig, ExprExtractionConfig, parse, verify

    timeout = CHECK_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    try:
        gold_parsed = parse(f"${gold}$", extraction_config=configs, parsing_timeout=timeout)
        pred_parsed = parse(f"${pred}$", extraction_config=configs, parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - a checker failure on a model output means "not correct"
        return False


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl custom reward: 1.0 if the last boxed answer matches ``ground_truth``, else 0.0."""
    pred = extract_last_boxed(solution_str)
    if pred is None or not pred.strip():
        return 0.0
    return 1.0 if is_equivalent(pred.strip(), _ground_truth_answer(ground_truth)) else 0.0
