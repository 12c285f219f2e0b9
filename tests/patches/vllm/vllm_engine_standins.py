"""Stand-ins for the parts of a vLLM engine that need device kernels, around vLLM's real EngineCore.

The executor and its worker are stand-ins (vLLM's workers need kernels the CPU build lacks): the
worker allocates the KV cache from vLLM's own KVCacheConfig and binds it with vLLM's own
bind_kv_cache, as the GPU / NPU model runners do, and holds a small torch model as its weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
BLOCK = 16


def write_model_dir(d: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "torch_dtype": "float32"}))
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<unk>").save_pretrained(d)
    return d


def vllm_config(model_dir):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    mc = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype="float32", max_model_len=256,
                     enforce_eager=True)
    mc.use_async_output_proc = False  # the CPU build has no platform to ask
    cfg = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"),
                     cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.5, swap_space=0,
                                              cache_dtype="auto"),
                     scheduler_config=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256))
    cfg.scheduler_config.scheduler_cls = "vllm.v1.core.sched.scheduler.Scheduler"
    return cfg


def _model() -> torch.nn.Module:
    """Weights the reshard would rewrite, plus a buffer computed at build time (a rotary cache's part)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    model.register_buffer("cos_sin_cache", torch.arange(32, dtype=torch.float32))
    return model


class Worker:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.model_runner = SimpleNamespace(kv_caches=[], model=_model())
        ctx = vllm_config.compilation_config.static_forward_context
        for name in LAYERS:
            ctx[name] = SimpleNamespace(kv_cache=[torch.tensor([])])
        self.inits: list = []

    def initialize_from_config(self, kv_cache_configs):
        from vllm.v1.utils import bind_kv_cache

        cfg = kv_cache_configs[0]  # this worker's (rpc rank 0), as WorkerWrapperBase picks it
        caches = {}
        for t in cfg.kv_cache_tensors:
            buf = torch.zeros(t.size, dtype=torch.int8)
            for name in t.shared_by:
                caches[name] = buf
        bind_kv_cache(caches, self.vllm_config.compilation_config.static_forward_context, self.model_runner.kv_caches)
        self.inits.append(list(kv_cache_configs))


class Executor:
    max_concurrent_batches = 1

    def __init__(self, vllm_config):
        self.worker = Worker(vllm_config)

    def get_kv_cache_specs(self):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32, use_mla=False)
        return [{name: spec for name in LAYERS}]

    def determine_available_memory(self):
        return [1 << 20]

    def initialize_from_config(self, kv_cache_configs):
        self.collective_rpc("initialize_from_config", args=(kv_cache_configs,))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        from vllm.utils import run_method

        return [run_method(self.worker, method, args, kwargs or {})]

    def register_failure_callback(self, callback):
        pass

    def shutdown(self):
        pass


def engine_core(model_dir):
    import os

    from vllm.v1.engine.core import EngineCore

    # EngineCore loads vLLM's general plugins, ours among them: it would apply this (driver)
    # process's patches and leave them applied for later tests. Tests apply what they test.
    saved = os.environ.get("VERL_PATCHES_OFF")
    os.environ["VERL_PATCHES_OFF"] = "1"
    try:
        return EngineCore(vllm_config(model_dir), Executor, log_stats=False)
    finally:
        if saved is None:
            os.environ.pop("VERL_PATCHES_OFF")
        else:
            os.environ["VERL_PATCHES_OFF"] = saved


