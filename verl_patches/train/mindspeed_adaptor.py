"""MindSpeed-LLM's adaptor in an Ascend rank of the recipe: imported at the rank's start by the prelude
(verl_patches/entry_points.py: apply_prelude), its features re-selected by the worker binding from the model's
Megatron command line (``build_global_args``, which the worker binding,
verl_patches/patches/verl/patch_single_controller_base_megatron_worker.py, calls before the model is built, and the
layer-spec report, verl_patches/checks/layer_spec.py, calls as a rank would). docs/RECIPE.md, "The NPU path", says
why in this order.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Any

from verl_patches.config import megatron_args as ma
from verl_patches.config.megatron_args import RecipeMegatronError

logger = logging.getLogger(__name__)

# megatron-core 0.12.1's modules that decorate functions with jit_fuser when imported, on the DeepSeek path
# (megatron/core/transformer/utils.py and torch_norm.py do too, but verl's worker module imports them before any
# overlay code runs; their functions -- gelu, L2Norm -- are not on it).
JIT_FUSER_USERS = ("megatron.core.fusions.fused_bias_dropout", "megatron.core.fusions.fused_bias_swiglu",
                   "megatron.core.fusions.fused_bias_gelu", "megatron.core.fusions.fused_bias_geglu",
                   "megatron.core.fusions.fused_cross_entropy", "megatron.core.transformer.moe.experts")


def import_mindspeed_llm_at_rank_start() -> bool:
    """Ascend with MindSpeed-LLM, the worker phase: MindSpeed-LLM's adaptor (MindSpeed's and MindSpeed-LLM's features)
    when the rank's prelude runs, at the end of verl's worker module. Returns whether it was imported here.

    Why here and not where the worker's config is known (the binding, or ActorRolloutRefWorker.__init__): verl 0.4.1's
    __init__ seeds megatron-core (set_random_seed -> model_parallel_cuda_manual_seed) right after it builds the
    parallel groups, and megatron-core's own _set_cuda_rng_state indexes torch.cuda.default_generators, which an NPU
    does not fill (``IndexError: tuple index out of range``): MindSpeed's megatron_basic feature replaces it with
    torch.npu's, so the adaptor must have run before any worker's __init__. The prelude is the earliest point the
    overlay runs in the rank and it precedes every __init__ (verl's worker module has imported megatron-core by
    then: the record megatron.jit_fuser_mindspeed_compile makes megatron's jit_fuser read torch.compile when used,
    and megatron's fusions must not be imported before the adaptor -- refused below, naming them). The features MindSpeed-LLM
    selects depend on the command line (the model's shape, the recipe's MindSpeed flags), known only with the
    worker's config: the binding re-applies them from that command line (``reapply_mindspeed_llm_features``), as
    MindSpeed's own ``megatron_adaptor.repatch`` does for MindSpeed's.

    verl decides its device once, at the import of verl.utils.device, from torch.cuda.is_available(); the adaptor
    imports torch_npu.contrib.transfer_to_npu, after which torch.cuda.is_available() answers the NPU's. verl must
    have decided before (npu: its actor modules then take pad_input/unpad_input from transformers'
    npu_flash_attention; decided after, it takes them from flash_attn.bert_padding, which MindSpeed's
    te_adaptation registers as a bare module: ``No module named 'flash_attn.bert_padding'``)."""
    if importlib.util.find_spec("mindspeed_llm") is None or "mindspeed_llm" in sys.modules:
        return False
    device = importlib.import_module("verl.utils.device")
    if device.is_cuda_available or not device.is_npu_available:
        raise RecipeMegatronError(
            f"verl decided its device as {device.get_device_name()!r} before MindSpeed-LLM's adaptor, on an Ascend "
            "rank: torch.cuda.is_available() was already true when verl was imported (torch_npu.contrib."
            "transfer_to_npu imported before verl?); import verl before MindSpeed/transfer_to_npu in the worker")
    compiled = sorted(m for m in JIT_FUSER_USERS if m in sys.modules)
    if compiled:
        raise RecipeMegatronError(
            f"{compiled} were imported before MindSpeed-LLM's adaptor on an Ascend rank: their functions are "
            "decorated with megatron's jit_fuser = the real torch.compile (dynamo on the NPU). Apply the overlay's "
            "prelude before anything imports megatron's fusions (verl_patches/entry_points.py: apply_prelude)")
    # MindSpeed-LLM's parser reads sys.argv at import: the worker's (Ray's) command line is not Megatron's.
    saved = sys.argv
    sys.argv = [saved[0] if saved else "verl_worker"]
    try:
        importlib.import_module("mindspeed_llm")
    finally:
        sys.argv = saved
    bind_megatron_adam()
    return True


def reapply_mindspeed_llm_features() -> None:
    """MindSpeed-LLM's features re-selected from this process's Megatron command line (sys.argv set by the caller):
    the steps of ``mindspeed.megatron_adaptor.repatch`` (remove every MindSpeed patch, register and apply the pre
    patches and the patches again) with MindSpeed-LLM's arguments, which is what MindSpeed-LLM's adaptor applied
    at import (mindspeed_llm/tasks/megatron_adaptor_v2.py: FeatureAdaptor.execute). ``mindspeed.megatron_adaptor``
    itself is not imported: its import applies MindSpeed's own features from MindSpeed's parser a second time."""
    # Lazy: MindSpeed and MindSpeed-LLM exist on Ascend only, and their adaptor must load at the rank's start, not at
    # import.
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager
    from mindspeed_llm.tasks.megatron_adaptor_v2 import FeatureAdaptor

    args = FeatureAdaptor.get_mindspeed_llm_args()
    MindSpeedFeaturesManager.remove_patches()
    MindSpeedFeaturesManager.apply_features_pre_patches(args)
    MindSpeedFeaturesManager.apply_features_patches(args)
    sys.modules.pop("transformer_engine", None)  # as FeatureAdaptor.execute: accelerate checks sys.modules for TE
    bind_megatron_adam()


# megatron-core 0.12.1's modules that bind ``Adam`` when imported: TE's FusedAdam, else apex's, else torch's AdamW.
ADAM_USERS = ("megatron.core.optimizer", "megatron.core.optimizer.distrib_optimizer")


def bind_megatron_adam() -> list[str]:
    """megatron-core's ``Adam`` as MindSpeed selected it: the modules in ADAM_USERS bind ``Adam`` when imported,
    and verl's worker module imports them before MindSpeed's adaptor registers its optimizer as
    ``apex.optimizers.FusedAdam`` (MindSpeed's megatron_basic feature: ``--optimizer-selection``), so they hold
    torch's AdamW. MindSpeed's optimizer features patch its own class (the swap optimizer: its AdamW's step, whose
    state has no ``step`` entry for torch's AdamW to read: ``KeyError: 'step'``). Each module's ``Adam`` is
    rebound to what an import after the adaptor would have bound; returns the modules rebound. Without MindSpeed's
    registration (no apex FusedAdam) nothing changes."""
    apex_optimizers = sys.modules.get("apex.optimizers")
    fused = getattr(apex_optimizers, "FusedAdam", None)
    if fused is None:
        return []
    rebound = []
    for name in ADAM_USERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "Adam", None) is not fused:
            module.Adam = fused
            rebound.append(name)
    return rebound


# The command line this process built Megatron's global arguments from (the actor and the reference both pass
# through the binding; the second time must ask for the same arguments).
_GLOBAL_ARGV: list[str] | None = None


def _seq_length(worker_config: Any) -> int:
    rollout = worker_config.get("rollout") if hasattr(worker_config, "get") else None
    try:
        return int(rollout["prompt_length"]) + int(rollout["response_length"])
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError("the worker config needs rollout.prompt_length and rollout.response_length for Megatron's "
                         f"--seq-length (MindSpeed-LLM's arguments): {e}") from e


def build_global_args(worker_config: Any, model_path: str, dtype: Any, recipe: Any, *, tp: int, pp: int, ep: int,
                      etp: int | None, cp: int) -> Any:
    """Ascend with MindSpeed-LLM: Megatron's global arguments from verl's config, as the reference builds them.

    The command line (verl_patches.config.megatron_args.megatron_argv: the HF config's shape, the parallel layout,
    recipe.megatron's MindSpeed flags) is what MindSpeed-LLM's adaptor reads at ``import mindspeed_llm`` (which
    applies MindSpeed's and MindSpeed-LLM's features) and what megatron.training's parse_args, as MindSpeed-LLM
    patches it, parses; validate_args and set_global_variables follow, as in MindSpeed-LLM's own training entry.
    The worker's own sys.argv (Ray's) is put back afterwards. Returns the global arguments."""
    # Lazy: the doctor loads the catalogue (the binding's record imports this module) without torch.
    import torch

    global _GLOBAL_ARGV
    hf = json.loads((Path(model_path) / "config.json").read_text())
    mbs = 1
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    if dtype not in names:
        raise ma.RecipeMegatronError(f"Megatron's arguments on Ascend: dtype {dtype} is not bf16, fp16 or fp32")
    argv = ma.megatron_argv(hf, recipe, seq_length=_seq_length(worker_config), micro_batch_size=mbs, tp=tp, pp=pp,
                            ep=ep, etp=etp, cp=cp, dtype=names[dtype])
    if _GLOBAL_ARGV is not None:
        if argv != _GLOBAL_ARGV:
            raise ma.RecipeMegatronError("Megatron's global arguments were built for another model or layout in this "
                                         f"process: {_GLOBAL_ARGV} then {argv}; one worker builds one model shape")
        # Lazy: megatron's training package, built already (by the first call, after the adaptor).
        from megatron.training import global_vars

        return global_vars.get_args()
    ma.set_pending_mindspeed_args(ma.mindspeed_args(recipe))
    saved = sys.argv
    sys.argv = ["verl_worker", *argv]
    try:
        # Its adaptor first (MindSpeed's and MindSpeed-LLM's features), then Megatron's training package: the
        # adaptor replaces what megatron binds at import (torch.compile for jit_fuser, among others). Imported at
        # the rank's start by the prelude (import_mindspeed_llm_at_rank_start: before verl seeds megatron-core),
        # its features are re-selected here from the model's command line.
        if "mindspeed_llm" in sys.modules:
            reapply_mindspeed_llm_features()
        else:
            importlib.import_module("mindspeed_llm")
        # Lazy: megatron's training package after the adaptor (the order above), never at this module's import.
        from megatron.training import global_vars
        from megatron.training.arguments import parse_args, validate_args

        args = parse_args()
        validate_args(args, {})
        global_vars.set_global_variables(args, build_tokenizer=False)
    finally:
        sys.argv = saved
    _GLOBAL_ARGV = argv
    logger.info("Megatron's global arguments from verl's config through MindSpeed-LLM's parser: %s", " ".join(argv))
    return args
