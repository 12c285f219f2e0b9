"""vllm.LLM's engine and generation on the CPU platform: vLLM built for no device has no forward
kernels, so LLM.__init__ and LLM.generate are replaced by the host stand-ins of
verl_patches/rigs/cpu/engine.py (the recipe's own LLM sleep / wake_up wraps are in
verl_patches/patches/vllm/patch_entrypoints_llm.py).
"""

from __future__ import annotations

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def cpu_llm_init(self, model, **kwargs):
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.rigs.cpu.engine import llm_init

    llm_init(self, model, **kwargs)


def cpu_llm_generate(self, prompts=None, sampling_params=None, prompt_token_ids=None, use_tqdm=True,
                     lora_request=None, prompt_adapter_request=None, guided_options_request=None, priority=None):
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.rigs.cpu.engine import llm_generate

    return llm_generate(self, prompts, sampling_params, prompt_token_ids, use_tqdm, lora_request,
                        prompt_adapter_request, guided_options_request, priority)


_LLM_INIT_SIGNATURE = (
    "def __init__(self, model: str, *, task: TaskOption='auto', tokenizer: Optional[str]=None, "
    "tokenizer_mode: TokenizerMode='auto', skip_tokenizer_init: bool=False, trust_remote_code: bool=False, "
    "allowed_local_media_path: str='', tensor_parallel_size: int=1, dtype: ModelDType='auto', "
    "quantization: Optional[QuantizationMethods]=None, revision: Optional[str]=None, "
    "tokenizer_revision: Optional[str]=None, seed: Optional[int]=None, gpu_memory_utilization: float=0.9, "
    "swap_space: float=4, cpu_offload_gb: float=0, enforce_eager: bool=False, max_seq_len_to_capture: int=8192, "
    "disable_custom_all_reduce: bool=False, disable_async_output_proc: bool=False, "
    "hf_token: Optional[Union[bool, str]]=None, hf_overrides: Optional[HfOverrides]=None, "
    "mm_processor_kwargs: Optional[dict[str, Any]]=None, override_pooler_config: Optional[PoolerConfig]=None, "
    "compilation_config: Optional[Union[int, dict[str, Any]]]=None, **kwargs) -> None")
_LLM_GENERATE_SIGNATURE = (
    "def generate(self, prompts: Union[Union[PromptType, Sequence[PromptType]], Optional[Union[str, list[str]]]]"
    "=None, sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]]=None, "
    "prompt_token_ids: Optional[Union[list[int], list[list[int]]]]=None, use_tqdm: Union[bool, Callable[..., "
    "tqdm]]=True, lora_request: Optional[Union[list[LoRARequest], LoRARequest]]=None, "
    "prompt_adapter_request: Optional[PromptAdapterRequest]=None, guided_options_request: Optional[Union["
    "LLMGuidedOptions, GuidedDecodingRequest]]=None, priority: Optional[list[int]]=None) -> list[RequestOutput]")

PATCHES = [
    Patch(
        feature="cpu_platform",
        id="cpu.vllm.llm_engine",
        target="vllm.entrypoints.llm:LLM.__init__",
        kind="replace",
        phases=("worker",),
        upstream="vllm",
        versions="==0.9.1",
        fingerprint=Fingerprint(
            signature=_LLM_INIT_SIGNATURE,
            source_sha="a4fbf50bb1feec57"),
        replacement=f"{__name__}:cpu_llm_init",
        flag="the CPU platform (no accelerator)",
        why="vLLM's engine cannot run a forward pass on a host (its 'empty' build has no kernels); the stand-in "
            "builds vLLM's engine config, distributed groups, model and KV cache as vLLM's worker does, so the "
            "recipe's rollout constructor, DP domain, reshard and offload run against the real vLLM model.",
        remove_when="vLLM's CPU backend runs DeepSeek-V3 (MLA and fused MoE) on the host.",
        platforms=("cpu",),
    ),
    Patch(
        feature="cpu_platform",
        id="cpu.vllm.llm_generate",
        target="vllm.entrypoints.llm:LLM.generate",
        kind="replace",
        phases=("worker",),
        upstream="vllm",
        versions="==0.9.1",
        fingerprint=Fingerprint(signature=_LLM_GENERATE_SIGNATURE, source_sha="f33ba2415372b759"),
        replacement=f"{__name__}:cpu_llm_generate",
        flag="the CPU platform (no accelerator)",
        why="Generation on the host: transformers' DeepseekV3 loaded with exactly the tensors the reshard wrote "
            "into vLLM's parameters on every rank, returning vLLM's RequestOutputs to verl's rollout.",
        remove_when="vLLM's CPU backend runs DeepSeek-V3 (MLA and fused MoE) on the host.",
        platforms=("cpu",),
    ),
]
