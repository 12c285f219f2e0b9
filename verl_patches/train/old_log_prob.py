"""Old log-prob reuse, the update's context: whether the running update reuses its own log-prob as the
old one (``reusing_old_log_prob``), and the UpdateProbe (verl_patches/train/mismatch.py) it feeds. The
worker's update wrapper enters it (patch verl.megatron_actor.*), the policy loss reads it (patch
verl.core_algos.policy_loss), and so does the model's forward function (patch verl.mcore_registry.*);
it lives here, below all three.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

_REUSE: contextvars.ContextVar[bool] = contextvars.ContextVar("verl_patches_reuse_old_log_prob", default=False)
_PROBE: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("verl_patches_update_probe", default=None)


@contextlib.contextmanager
def reusing_old_log_prob(probe: Optional[Any] = None) -> Iterator[None]:
    """While active, compute_policy_loss ignores the old_log_prob it is given (the rollout's
    log-prob, or a NaN placeholder: the update wrapper checks that every micro-batch's loss went
    through the substitution before the optimizer steps). With ``probe`` (an UpdateProbe), each
    call also adds the rollout-vs-actor comparison and the entropy to it."""
    token, probe_token = _REUSE.set(True), _PROBE.set(probe)
    try:
        yield
    finally:
        _PROBE.reset(probe_token)
        _REUSE.reset(token)


def reuse_active() -> bool:
    return _REUSE.get()


def active_probe() -> Optional[Any]:
    """The UpdateProbe of the running update under reuse, else None."""
    return _PROBE.get() if _REUSE.get() else None
