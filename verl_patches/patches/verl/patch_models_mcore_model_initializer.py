"""DeepSeek-V3's layer spec on Ascend: MindSpeed-LLM's DeepSeek spec, as the reference recipe builds it.

Upstream: verl/models/mcore/model_initializer.py:DeepseekV3Model.get_transformer_layer_spec asks
megatron-core for the Transformer Engine spec (``get_gpt_decoder_block_spec(..., use_transformer_engine=True)``):
``TELayerNormColumnParallelLinear``, ``TEDotProductAttention``, TE grouped experts. Transformer Engine does not
exist on an NPU. The reference recipe (verl's Ascend DeepSeek recipe) builds its training model from
MindSpeed-LLM's DeepSeek layer spec (``mindspeed_llm/tasks/models/spec/deepseek_spec.py``, ``layer_spec``:
MindSpeed-LLM's MLA with its fused down-projection, MindSpeed's grouped-matmul experts, megatron-core's
local norms), built under Megatron's global arguments that MindSpeed-LLM's parser made
(verl_patches/config/megatron_args.py ``megatron_argv``, applied by ``verl.recipe_megatron.binding``
before the model is built). We return that spec unchanged, so the model is the one the reference trains.

The spec reads Megatron's global arguments when it is imported (``get_args()``), so it is imported here, at
the call, never at the patch's import. Every class it resolves to is checked (verl_patches/train/layer_classes.py:
no None, no bare torch.nn.Module dummy, nothing of Transformer Engine or the CPU platform) and printed once with
its release, before the model is built. Ascend only (the NPU and its rehearsal platform); the CPU platform has
its own host spec (cpu.verl.deepseek_v3_host_layer_spec) and CUDA keeps upstream's TE spec.
"""

from __future__ import annotations

import functools
import importlib

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.train import layer_classes

SPEC_MODULE = "mindspeed_llm.tasks.models.spec.deepseek_spec"


@functools.lru_cache(maxsize=None)
def _report(lines: tuple[str, ...]) -> None:
    """Print the resolved classes once per process (the actor and the reference both build the model)."""
    print("verl_patches: DeepSeek-V3's layer spec on Ascend resolves to\n  " + "\n  ".join(lines), flush=True)


def get_transformer_layer_spec(self):
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from megatron.training import global_vars

    if getattr(global_vars, "_GLOBAL_ARGS", None) is None:
        raise RuntimeError(
            f"{SPEC_MODULE} needs Megatron's global arguments (MindSpeed-LLM's parser) before DeepSeek-V3 is "
            "built: they are set by verl.recipe_megatron.binding from the worker's "
            "actor_rollout_ref.rollout.recipe.megatron section; give the worker config that section")
    spec = importlib.import_module(SPEC_MODULE).layer_spec
    entries = layer_classes.check(spec, f"{SPEC_MODULE}.layer_spec")
    _report(tuple(layer_classes.report(entries)))
    return spec


PATCHES = [
    Patch(
        feature="model_layout",
        id="verl.deepseek_v3_mindspeed_llm_layer_spec",
        target="verl.models.mcore.model_initializer:DeepseekV3Model.get_transformer_layer_spec",
        kind="replace",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint("def get_transformer_layer_spec(self)", "63fbbc674d1586dc"),
        replacement=f"{__name__}:get_transformer_layer_spec",
        flag="",
        why="verl builds DeepSeek-V3 from megatron-core's Transformer Engine spec, whose layers do not exist on an "
            "NPU; the reference recipe builds from MindSpeed-LLM's DeepSeek layer spec (its MLA, MindSpeed's "
            "grouped experts), so that is the model trained on Ascend.",
        remove_when="verl builds DeepSeek-V3 on Ascend from MindSpeed-LLM's spec itself (or from MindSpeed's TE "
                    "replacements, when the recipe chooses those).",
        upstream_ref="MindSpeed-LLM v2.2.0 mindspeed_llm/tasks/models/spec/deepseek_spec.py",
        platforms=("npu",),
    ),
]
