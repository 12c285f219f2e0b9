"""Which of the CPU platform's patch records apply on the NPU rehearsal platform, decided per record.

On the rehearsal the accelerator is ``npu`` (the torch_npu stand-in answers ``torch.npu.is_available()``), so
the recipe's records for ``npu`` apply as on an NPU, and none of the CPU platform's (``platforms=("cpu",)``)
would. A CPU record applies on the rehearsal only where the NPU path itself has nothing that runs on the host:
the torch.cuda runtime, verl's device helpers and megatron-core's streams are already answered by the stand-in
(``torch_npu.contrib.transfer_to_npu`` maps torch.cuda onto its host ``torch.npu``; ``hccl`` is gloo), and the
model is MindSpeed-LLM's, never the host Transformer Engine spec (that would rehearse a parallel path).

Every CPU record is in exactly one of the two tables, with the reason (tests/npu_rehearsal/test_records.py:
a new CPU record fails until it is decided here).
"""

from __future__ import annotations

from types import MappingProxyType

_CUDA_NAMES = ("current_device", "synchronize", "current_stream", "stream", "get_rng_state", "set_rng_state",
               "manual_seed")

# Host records (CPU platform) that apply on the rehearsal too: what the host lacks whatever the device API says.
APPLY = MappingProxyType({
    "cpu.verl.reduce_timing": "gloo (the stand-in's hccl) has no ReduceOp.AVG; HCCL has",
    "cpu.megatron.moe_host_split_sizes": "the rehearsal's tensors are host tensors, which megatron's "
                                         "maybe_move_tensor_to_cpu returns as tensors (all_to_all_single refuses "
                                         "them as split sizes); on an NPU they are device tensors and become numpy",
    "cpu.vllm.inspect_model_in_process": "generation stays the CPU platform's stand-in (issue 35, item 4)",
    "cpu.vllm.llm_engine": "generation stays the CPU platform's stand-in: vLLM built for no device has no kernels",
    "vllm.fixed_routing.select_experts": "generation stays the CPU platform's stand-in, whose MoE routing this "
                                         "record fixes as on the host",
    "cpu.vllm.llm_generate": "generation stays the CPU platform's stand-in: transformers generates from vLLM's "
                             "model, which receives the reshard",
})

# CPU records that do not: the NPU path's own answer runs instead.
SKIP = MappingProxyType({
    "cpu.verl.deepseek_v3_host_layer_spec": "the model is MindSpeed-LLM's DeepSeek spec "
                                            "(verl.deepseek_v3_mindspeed_llm_layer_spec); the host TE spec would be "
                                            "a parallel path beside the one rehearsed",
    "cpu.verl.dist_backend": "verl's get_nccl_backend answers hccl on an NPU; the stand-in maps hccl to gloo",
    "cpu.verl.device_id": "verl's get_device_id answers torch.npu's, the stand-in's host device",
    "cpu.verl.device_module": "verl's get_torch_device answers torch.npu, the stand-in's device module",
    "cpu.megatron.fp8_quantize_without_te": "MindSpeed registers its own quantize_param_shard "
                                            "(mindspeed/core/fp8_utils.py) on the NPU path",
    "cpu.megatron.alltoall_dispatcher_host_stream": "torch.cuda.Stream is the stand-in's torch.npu.Stream "
                                                    "(transfer_to_npu)",
    "cpu.megatron.shared_experts_host_stream": "torch.cuda.Stream is the stand-in's torch.npu.Stream "
                                               "(transfer_to_npu)",
    "cpu.megatron.optimizer_on_host": "device='cuda' is the stand-in's host device (transfer_to_npu); the "
                                      "optimizer is MindSpeed's NPU path (its fused AdamW answered by the host "
                                      "kernel of the op-builder table)",
    "cpu.megatron.rng_tracker_set_state": "torch.cuda's generator is the stand-in's torch.npu generator "
                                          "(transfer_to_npu), which sets the host generator at once",
    "cpu.megatron.rng_tracker_fork": "a log-volume fix of the CPU platform only; the NPU path's fork is upstream's",
    "cpu.megatron.schedules_on_host": ".cuda() and device='cuda' reach the stand-in's host device (transfer_to_npu)",
    **{f"cpu.torch.cuda_{n}": "torch.cuda is mapped onto the stand-in's torch.npu (transfer_to_npu)" for n in _CUDA_NAMES},
})


# NPU records that do not apply on the rehearsal: vLLM-Ascend's rollout is not rehearsed (generation is the CPU
# platform's stand-in, vLLM as the host platform: verl_patches/rigs/cpu/vllm_platform.py).
NPU_SKIP = MappingProxyType({
    "vllm_ascend.dp_sync.forward_metadata_on_device": "vLLM-Ascend's model runner: generation is the host stand-in",
    "vllm_ascend.worker.stable_regions": "vLLM-Ascend's worker: generation is the host stand-in",
    "vllm_ascend.worker.stable_kv_cache_region": "vLLM-Ascend's worker: generation is the host stand-in",
    "vllm_ascend.fixed_routing.force_load_balance": "vLLM-Ascend's MoE: generation is the host stand-in",
})


def host_only(patch) -> bool:
    """A record of the CPU platform (it applies on the host but not on an NPU): decided per record here."""
    return patch.platforms is not None and "cpu" in patch.platforms and "npu" not in patch.platforms


def applies_on_rehearsal(patch) -> bool:
    """Whether ``patch`` applies on the rehearsal platform: the NPU's records, and the host records of APPLY."""
    if host_only(patch):
        return applies(patch.id)
    if patch.upstream == "vllm_ascend" and patch.applies_on("npu"):
        if patch.id not in NPU_SKIP:
            raise KeyError(f"vLLM-Ascend record {patch.id!r} is not decided for the NPU rehearsal platform: add it to "
                           "NPU_SKIP in verl_patches/rigs/npu_rehearsal/records.py, or rehearse vLLM-Ascend")
        return False
    return patch.applies_on("npu")


def applies(patch_id: str) -> bool:
    """Whether the CPU record ``patch_id`` applies on the rehearsal platform; an undecided one raises."""
    if patch_id in APPLY:
        return True
    if patch_id in SKIP:
        return False
    raise KeyError(f"CPU record {patch_id!r} is not decided for the NPU rehearsal platform: add it to APPLY or SKIP "
                   "in verl_patches/rigs/npu_rehearsal/records.py with the reason")
