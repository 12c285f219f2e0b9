"""The actor's recipe DDP overlap handed to verl's get_model while the actor's model is built.

Upstream: verl/workers/megatron_workers.py:ActorRolloutRefWorker._build_model_optimizer builds the actor
with verl.utils.megatron_utils.get_model, which receives no config. We wrap it: while it runs for
the actor, ``recipe.overlap_grad_reduce`` / ``recipe.overlap_param_gather`` (read from the worker's
config by verl_patches/config/settings.py) are held in a context variable that patch verl.ddp_overlap.get_model
(patch_utils_megatron_utils_ddp_overlap.py) reads. Both off, or another role: nothing is held and
get_model runs as upstream has it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.train.ddp_overlap import FLAG, OVERLAP, REMOVE_WHEN, DdpOverlap

_W = "verl.workers.megatron_workers:ActorRolloutRefWorker."



def wrap_build_model_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _build_model_optimizer(self, *args, **kwargs):
        overlap = DdpOverlap.from_worker(self.config) if self._is_actor else None
        token = OVERLAP.set(overlap if overlap is not None and overlap.on else None)
        try:
            return original(self, *args, **kwargs)
        finally:
            OVERLAP.reset(token)

    return _build_model_optimizer


PATCHES = [
    Patch(
        id="verl.ddp_overlap.build_model_optimizer",
        target=_W + "_build_model_optimizer",
        kind="wrap", phases=("worker",), upstream="verl", versions="==0.4.1", feature="model_layout", flag=FLAG,
        fingerprint=Fingerprint(
            signature="def _build_model_optimizer(self, model_path, optim_config, override_model_config, "
                      "override_transformer_config)",
            source_sha="34f278b8e15f2d76"),
        replacement=f"{__name__}:wrap_build_model_optimizer",
        why="get_model receives no config: the actor's recipe overlap settings reach it for the duration of the "
            "actor's model build (docs/RECIPE.md parity rows 66-67).",
        remove_when=REMOVE_WHEN,
    ),
]
