"""torch.compile for the rollout only: keep the real torch.compile (saved by the prelude, before
MindSpeed replaces it for training) and put it back for a block, restoring exactly what was there.

MindSpeed's adaptor (features_manager/megatron_basic/requirements_basic.py) sets ``torch.compile``
to ``torch.jit.script`` so training never compiles with it. vLLM compiles its model while the engine is built and
vLLM-Ascend compiles TorchAir graphs lazily per batch size while generating, so both need the real
function. ``real_torch_compile()`` swaps it in and, on exit (also on exception), puts back the very
object that was there, so training keeps MindSpeed's choice.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

ATTR = "compile"  # torch.compile
_SAVED: dict[str, Callable[..., Any]] = {}
_LOCK = threading.Lock()


class CompileContextError(RuntimeError):
    """torch.compile has been replaced and the real one was not saved before."""


def is_torch_own(fn: Any) -> bool:
    """Whether ``fn`` is the function torch defines as torch.compile (not a replacement)."""
    return callable(fn) and getattr(fn, "__module__", None) == "torch" and getattr(fn, "__qualname__", None) == ATTR


def save_real_compile() -> bool:
    """Remember torch.compile if it is still torch's own; True once one is saved. Idempotent:
    the first real one saved is kept. Called by the prelude, which runs before MindSpeed's
    adaptor is imported in a worker."""
    with _LOCK:
        if ATTR not in _SAVED:
            current = getattr(torch, ATTR)
            if is_torch_own(current):
                _SAVED[ATTR] = current
        return ATTR in _SAVED


def saved_real_compile() -> Callable[..., Any] | None:
    return _SAVED.get(ATTR)


@contextlib.contextmanager
def real_torch_compile(enabled: bool = True) -> Iterator[Callable[..., Any]]:
    """Inside the block torch.compile is the real one; afterwards it is whatever it was before.

    When nothing replaced it (no MindSpeed), nothing changes. When something did and the real one
    was never saved, raise CompileContextError rather than compile with a no-op silently.
    Yields the function in effect inside the block.
    """
    current = getattr(torch, ATTR)
    if not enabled or is_torch_own(current):
        yield current
        return
    real = _SAVED.get(ATTR)
    if real is None:
        raise CompileContextError(
            f"torch.compile is {getattr(current, '__module__', '?')}.{getattr(current, '__qualname__', current)!r}, "
            "not torch's own, and the real one was not saved: the overlay's prelude must run before MindSpeed's "
            "adaptor is imported (verl_patches.prelude_patch in verl's worker module), or turn off "
            "actor_rollout_ref.rollout.recipe.rollout_torch_compile")
    setattr(torch, ATTR, real)
    try:
        yield real
    finally:
        setattr(torch, ATTR, current)
