"""torch.compile for the rollout only (docs/RECIPE.md item 7). MindSpeed's features manager registers
``torch.compile`` (and ``torch.jit.script``) -> ``dummy_compile``, a call-through that compiles nothing,
in RequirementsBasicFeature.te_adaptation (mindspeed/features_manager/megatron_basic/requirements_basic.py
at the lock's release v2.2.0_core_r0.12.1; 2.1.0 put ``torch.jit.script`` in torch.compile's place;
tests/patches/mindspeed/test_mindspeed_release.py reads it from the installed release). MindSpeed's patch manager also rebinds module aliases of the original; vLLM and vLLM-Ascend
call torch.compile by attribute, so only that is swapped. vLLM compiles while the engine is built (_build_rollout)
and vLLM-Ascend compiles TorchAir graphs lazily per batch size while generating, so both run inside
verl_patches.rollout.compile_context.real_torch_compile (the real function, saved by the prelude before MindSpeed's
adaptor is imported), which puts MindSpeed's object back on exit.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.config import settings

_W = "verl.workers.megatron_workers:ActorRolloutRefWorker."
_COMMON_OWN = dict(kind="wrap", phases=("worker",), upstream="verl", versions="==0.4.1")

COMPILE_FLAG = "actor_rollout_ref.rollout.recipe.rollout_torch_compile"


def rollout_compile_on(config: Any) -> bool:
    return settings.from_worker(config).rollout_torch_compile


# -- torch.compile for the rollout only ------------------------------------------------------------

def _wrap_compiled(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compiled(self, *args, **kwargs):
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.rollout.compile_context import real_torch_compile

        with real_torch_compile(enabled=rollout_compile_on(self.config)):
            return original(self, *args, **kwargs)

    return compiled


wrap_build_rollout_compile = _wrap_compiled
wrap_generate_sequences_compile = _wrap_compiled


PATCHES = [
    Patch(
        feature="rollout_engine",
        id="verl.megatron_worker.build_rollout_compile",
        target=_W + "_build_rollout",
        fingerprint=Fingerprint(signature="def _build_rollout(self, trust_remote_code=False)", source_sha="b1844e84e961641b"),
        replacement=f"{__name__}:wrap_build_rollout_compile",
        flag=COMPILE_FLAG,
        why="MindSpeed replaces torch.compile with a call-through for training; vLLM compiles its model while the "
            "engine is built. The real torch.compile (saved by the prelude) is put in for the build and "
            "MindSpeed's put back after.",
        remove_when="MindSpeed scopes its torch.compile replacement to training, or the rollout runs in its own process.",
        **_COMMON_OWN,
    ),
    Patch(
        feature="rollout_engine",
        id="verl.megatron_worker.generate_compile", after=("verl.tensor_cache.generate", "verl.megatron_worker.generate_offload"),
        target=_W + "generate_sequences",
        fingerprint=Fingerprint(signature="def generate_sequences(self, prompts: DataProto)", source_sha="9f3b8f496926ac8f"),
        replacement=f"{__name__}:wrap_generate_sequences_compile",
        flag=COMPILE_FLAG,
        why="vLLM-Ascend compiles TorchAir graphs lazily per batch size during generation "
            "(NPUModelRunner._get_torchair_lazy_compiled_model); generation gets the real torch.compile too.",
        remove_when="MindSpeed scopes its torch.compile replacement to training, or the rollout runs in its own process.",
        **_COMMON_OWN,
    ),
]
