"""verl's vLLM SPMD rollout built the recipe's way: DP domain, expert parallel, no sleep mode, memory under the switch loop.

Upstream: verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py:vLLMRollout.__init__ builds the
engine with sleep mode on and puts it to sleep (which frees nothing on multi-node NPU), has no
vLLM data-parallel domain (experts then span one TP pair instead of every die), and rejects
max_num_batched_tokens < max_model_len with chunked prefill, the recipe's 1024 against 4096.
We replace it (the upstream body must not run: it builds the engine): our constructor keeps
upstream's contract (same engine arguments, engine_kwargs.vllm passed through, so vLLM-Ascend's
additional_config, TorchAir graph / multistream MLA and MoE / KV NZ / view optimize / Ascend
scheduler, comes from YAML; same sampling parameters) and adds, in this order:
1. the DP domain (verl_patches.rollout.dp_domain): VLLM_DP_SIZE / RANK / MASTER_IP and a
   MASTER_PORT distinct per DP group, published before vLLM reads them, plus the DP-agreement
   flag for the vLLM-side patches;
2. expert parallel on unless the YAML says otherwise;
3. max_num_batched_tokens and chunked prefill from YAML, checked only where vLLM needs it;
4. with recipe.offload (default on): sleep mode off, and the engine's weights and KV cache as
   groups on the process's offload engine (verl_patches.rollout.engine_memory); the KV cache comes
   back through the configs the engine core keeps (patch vllm.engine_core.keep_kv_cache_configs); the
   groups are attached to the process's switch loop (verl_patches/offload/live.py), which alone
   moves them: the engine's sleep / wake_up, which verl's sharding manager calls, reach its steps
   (patches vllm.llm.sleep_to_offload / wake_up_to_onload).
"""

from __future__ import annotations

import os
from copy import deepcopy
from typing import Any

from verl_patches.core import stash
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.rollout.dp_domain import setup_dp_domain
from verl_patches.rollout.long_tail.rebalance import RebalancePolicy
from verl_patches.rollout.settings import RECIPE_KEY, RolloutSettings, STASH_KEY

def _max_model_len(config: Any, model_hf_config: Any) -> int:
    """The engine's context: rollout.max_model_len, else prompt + response, checked against the model."""
    total = int(config.prompt_length) + int(config.response_length)
    if not getattr(model_hf_config, "rope_scaling", None):
        limit = None
        for holder in (model_hf_config, getattr(model_hf_config, "llm_config", None),
                       getattr(model_hf_config, "text_config", None)):
            if holder is not None and getattr(holder, "max_position_embeddings", None) is not None:
                limit = holder.max_position_embeddings
                break
        if limit is None:
            raise ValueError("max_position_embeddings not found in the model's config (nor its llm_config / "
                             "text_config)")
        if limit < total:
            raise ValueError(f"prompt_length + response_length = {total} exceeds the model's "
                             f"max_position_embeddings {limit}")
    return int(config.get("max_model_len") or total)


def _engine_kwargs(config: Any) -> dict:
    """rollout.engine_kwargs.vllm as plain values; None means 'leave vLLM's default'."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from omegaconf import OmegaConf

    section = config.get("engine_kwargs", None)
    raw = section.get("vllm", None) if section is not None else None
    kwargs = {} if raw is None else OmegaConf.to_container(deepcopy(raw), resolve=True)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if config.get("limit_images", None):
        kwargs["limit_mm_per_prompt"] = {"image": config.get("limit_images")}
    # The recipe's experts span the whole DP group (EP = DP x TP).
    kwargs.setdefault("enable_expert_parallel", True)
    return kwargs


def _check_rebalance(recipe: Any) -> None:
    """recipe.rebalance* (``recipe``: the run's RecipeSettings), which the generation reads from the rollout
    settings (verl_patches/rollout/long_tail/migrate.py). Only the CPU generation stand-in
    (verl_patches/rigs/cpu/engine.py) runs the mechanism: on a device the move inside vLLM's engine
    (verl_patches/rollout/long_tail/vllm_move.run_engine, ready to replace LLM._run_engine's loop) has not
    run, so rebalance: True is refused there rather than silently ignored."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.base import accelerator

    policy = RebalancePolicy.from_settings(recipe)
    stagger = recipe.rebalance_cpu_stagger
    device = accelerator.device_type()
    if device != "cpu" and (policy.enabled or stagger):
        raise ValueError(f"rollout.{RECIPE_KEY}.rebalance is implemented for the CPU generation stand-in only; vLLM's "
                         f"engine on {device} cannot move a request between DP ranks yet: the move inside vLLM's engine "
                         "(verl_patches/rollout/long_tail/vllm_move.py) is tested on CPU against vLLM's classes, "
                         "but its device path (KV transfer device to device over HCCL / NCCL, the NZ cache layout "
                         "under TorchAir, batch-invariant kernels) has not run anywhere (docs/ROLLOUT.md): set "
                         "rebalance: False and rebalance_cpu_stagger: 0")
    if stagger and not policy.enabled:
        raise ValueError(f"rollout.{RECIPE_KEY}.rebalance_cpu_stagger={stagger} forces an imbalance for rebalance to "
                         "move: it needs rebalance: True")


def vllm_rollout_init(self, model_path: str, config, tokenizer, model_hf_config, **kwargs) -> None:
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch.distributed as dist
    from vllm import SamplingParams
    from vllm.utils import get_ip
    from verl.workers.rollout.base import BaseRollout
    from verl.workers.rollout.vllm_rollout import vllm_rollout_spmd as upstream
    from verl_patches.rollout.dp_sync import FLAG_ENV

    BaseRollout.__init__(self)
    self.config = config
    world = dist.get_world_size()
    settings = RolloutSettings.from_config(config, world)
    _check_rebalance(settings.recipe)
    tp = settings.dp.tp_size
    if tp > world:
        raise ValueError(f"rollout.tensor_model_parallel_size={tp} exceeds the world size {world}")
    if not settings.recipe.offload and not config.enforce_eager and config.free_cache_engine:
        # Upstream's rule for its own path: vLLM's sleep cannot free a cache graphs were captured on.
        raise ValueError("rollout.free_cache_engine=True needs rollout.enforce_eager=True without recipe.offload")

    # Before vLLM builds its ParallelConfig (inside LLM below), which reads VLLM_DP_* then.
    self.dp_domain = setup_dp_domain(settings.dp, get_ip())
    os.environ[FLAG_ENV] = "1" if settings.recipe.dp_sync_on_device else "0"
    if kwargs.get("train_tp") is not None:
        # verl's older Megatron path builds vLLM's groups before the engine; vLLM's own function.
        from vllm.distributed import parallel_state as vllm_ps

        vllm_ps.initialize_model_parallel(tensor_model_parallel_size=tp)

    max_model_len = _max_model_len(config, model_hf_config)
    settings.check_batched_tokens(max_model_len)
    self.lora_kwargs = kwargs.pop("lora_kwargs", {})
    load_format = "dummy" if str(config.load_format).startswith("dummy") else config.load_format
    # Graph mode with offload: weights and KV cache go into address-stable regions (refused without a backend).
    from verl_patches.rollout.graph_safe import arm_for_build

    arm_for_build(enforce_eager=bool(config.enforce_eager), offload=settings.recipe.offload)
    engine_kwargs = _engine_kwargs(config)
    # Upstream hard-codes prefix caching on; the recipe's engine_kwargs may turn it off (the reference did).
    prefix_caching = engine_kwargs.pop("enable_prefix_caching", True)
    # Looked up on verl's module at call time, where verl imported it.
    self.inference_engine = upstream.LLM(
        model=model_path,
        enable_sleep_mode=not settings.recipe.offload,
        tensor_parallel_size=tp,
        distributed_executor_backend="external_launcher",
        dtype=config.dtype,
        enforce_eager=config.enforce_eager,
        gpu_memory_utilization=config.gpu_memory_utilization,
        disable_custom_all_reduce=True,
        skip_tokenizer_init=False,
        max_model_len=max_model_len,
        load_format=load_format,
        disable_log_stats=config.disable_log_stats,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_chunked_prefill=settings.enable_chunked_prefill,
        enable_prefix_caching=prefix_caching,
        trust_remote_code=kwargs.get("trust_remote_code", False),
        seed=config.get("seed", 0),
        **self.lora_kwargs,
        **engine_kwargs,
    )

    # For the sharding manager, which receives the engine only (patch verl.sharding_manager.reshard),
    # and the generation (the rebalance settings).
    stash.put(self.inference_engine, STASH_KEY, settings)
    if settings.recipe.offload:
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.rollout.engine_memory import VllmEngineMemory, attach_engine_memory

        memory = VllmEngineMemory(self.inference_engine)
        stash.put(self, "engine_memory", memory)
        # Into the process's switch loop, which starts where an update ends: the KV cache and the
        # weights are released now, where upstream would put the engine to sleep. verl's sharding
        # manager then drives the loop through the engine's sleep / wake_up (patches vllm.llm.*).
        attach_engine_memory(self.inference_engine, memory)
    else:
        self.inference_engine.sleep(level=1)

    sampling = {"n": 1, "logprobs": 0, "max_tokens": config.response_length, "detokenize": False}
    probe = SamplingParams()
    for key in config.keys():
        if hasattr(probe, str(key)):
            sampling[key] = config.get(key)
    self.sampling_params = SamplingParams(**sampling)
    self.pad_token_id = tokenizer.pad_token_id


PATCHES = [
    Patch(
        feature="rollout_engine",
        id="verl.vllm_rollout.recipe_engine",
        target="verl.workers.rollout.vllm_rollout.vllm_rollout_spmd:vLLMRollout.__init__",
        kind="replace",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint(
            signature="def __init__(self, model_path: str, config: DictConfig, tokenizer, model_hf_config, **kwargs)",
            source_sha="319cff6f33aafb1a",
        ),
        replacement=f"{__name__}:vllm_rollout_init",
        flag="actor_rollout_ref.rollout.recipe.{offload, dp_sync_on_device, vllm_dp.dp_size, vllm_dp.instances, "
             "vllm_dp.master_port_base, vllm_dp.port_stride}; rollout.max_num_batched_tokens, "
             "rollout.enable_chunked_prefill, rollout.engine_kwargs.vllm (additional_config, enable_expert_parallel)",
        why="The recipe's rollout runs vLLM data parallel inside each instance with experts over every die "
            "(DP128 x TP2 = EP256), needs a distinct DP master port per DP group, frees weights and KV cache by "
            "offload instead of sleep mode (which does not free memory on multi-node NPU), and runs "
            "max_num_batched_tokens=1024 with chunked prefill, which upstream's constructor rejects "
            "(docs/RECIPE.md items 2, 5, 6, 8; docs/DESIGN.md section 6).",
        remove_when="verl's vLLM rollout takes a data-parallel domain and chunked-prefill budgets below "
                    "max_model_len from its config, and offers offload/onload of weights and KV cache that frees "
                    "device memory on NPU (later verl releases move to vLLM's external-launcher DP).",
    ),
]
