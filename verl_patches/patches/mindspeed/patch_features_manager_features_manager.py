"""MindSpeed-LLM's features, less its patches of Megatron-LM's text-generation server (Ascend only).

Upstream: mindspeed/features_manager/features_manager.py:MindSpeedFeaturesManager.set_features_list
(features_list), which MindSpeed-LLM calls at ``import mindspeed_llm`` with its whole feature list
(mindspeed_llm/features_manager/__init__.py, create_features_list) before its adaptor applies the features.

What we change, and why:
1. The list stays whole. Every feature keeps its arguments, checks and patches, with one exception.
2. The exception is the feature named "inference" of MindSpeed-LLM
   (mindspeed_llm/features_manager/inference/inference.py, InferenceFeature). Its arguments (--task,
   --top-p, --max-new-tokens, ...) and checks stay. Its patches of Megatron-LM's own text-generation
   package (``megatron.inference.text_generation``: tokenisation, beam search, forward step) are
   not registered.
3. The reason: the recipe generates with vLLM, and Megatron's text-generation code never runs in the RL
   loop. Registering those patches imports ``megatron.inference``, a package of the Megatron-LM
   repository that neither megatron-core nor the training package the lock installs carries
   (configs/upstream.lock.toml, megatron_training: ``megatron/training`` and ``megatron/legacy``). Without
   this record ``import mindspeed_llm`` fails with ``No module named 'megatron.inference'``.

Applied before ``import mindspeed_llm`` (the adaptor runs at that import). A MindSpeed-LLM release whose
inference feature carries other patches, or a feature list without it, is caught by the test
(tests/npu_rehearsal/test_platform.py builds the NPU path with this record applied).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

TEXT_GENERATION_FEATURE = "inference"  # MindSpeed-LLM's InferenceFeature.feature_name
_FEATURE_MODULE = "mindspeed_llm.features_manager.inference.inference"


def _register_no_text_generation_patches(self, patch_manager, args) -> None:
    """InferenceFeature.register_patches for the recipe: none (module docstring, item 3)."""
    return None


def without_text_generation_patches(features_list: list[Any]) -> list[str]:
    """Binds the no-patch method to MindSpeed-LLM's inference feature in ``features_list``, in place.
    Returns the names of the features changed (empty where the list has no such feature)."""
    changed = []
    for feature in features_list:
        if (getattr(feature, "feature_name", None) == TEXT_GENERATION_FEATURE
                and type(feature).__module__ == _FEATURE_MODULE):
            feature.register_patches = types.MethodType(_register_no_text_generation_patches, feature)
            changed.append(f"{_FEATURE_MODULE}.{type(feature).__qualname__}")
    return changed


def wrap_set_features_list(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of the classmethod's function (the patch machinery re-wraps it as a classmethod)."""

    @functools.wraps(original)
    def set_features_list(cls, features_list):
        without_text_generation_patches(features_list)
        return original(cls, features_list)

    return set_features_list


PATCHES = [
    Patch(
        feature="model_layout",
        id="mindspeed.no_megatron_text_generation",
        target="mindspeed.features_manager.features_manager:MindSpeedFeaturesManager.set_features_list",
        kind="wrap",
        phases=("worker",),
        upstream="mindspeed",
        versions="==0.12.1",
        fingerprint=Fingerprint(signature="def set_features_list(cls, features_list: List[MindSpeedFeature])",
                                source_sha="1a1b6027727dd12e"),
        replacement=f"{__name__}:wrap_set_features_list",
        flag="",
        why="MindSpeed-LLM's inference feature patches Megatron-LM's text-generation package "
            "(megatron.inference), which the RL loop never runs (generation is vLLM's) and which the lock's "
            "Megatron-LM training package does not carry; registering those patches makes `import mindspeed_llm` "
            "fail. Its arguments and checks stay.",
        remove_when="MindSpeed-LLM registers its text-generation patches only for its inference tasks, or the "
                    "lock installs Megatron-LM's megatron/inference too.",
        upstream_ref="MindSpeed-LLM v2.2.0 mindspeed_llm/features_manager/inference/inference.py",
        platforms=("npu",),
    ),
]
