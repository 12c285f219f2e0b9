"""KV cache freed and re-created every step through vLLM 0.9.1's real EngineCore and scheduler
(patch vllm.engine_core.keep_kv_cache_configs + verl_patches.rollout.kv_cache).

The executor and its worker are stand-ins: vLLM's workers need device kernels that the CPU
build lacks. The stand-in worker allocates the cache from vLLM's own KVCacheConfig and binds
it with vLLM's own bind_kv_cache, as the GPU / NPU model runners do.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from verl_patches.core.apply import apply_all, undo
from verl_patches.patches.vllm.patch_v1_engine_core import PATCHES
from verl_patches.rollout.kv_cache import (KEPT_ATTR, PATCH_ID, KVCacheError, free_kv_cache, init_kv_cache,
                                           release_worker_kv_cache)

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tiny_llama")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "torch_dtype": "float32"}))
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<unk>").save_pretrained(d)
    return d


def _vllm_config(model_dir):
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


class _Worker:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.model_runner = SimpleNamespace(kv_caches=[])
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


class _Executor:
    max_concurrent_batches = 1

    def __init__(self, vllm_config):
        self.worker = _Worker(vllm_config)

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


def _core(model_dir):
    from vllm.v1.engine.core import EngineCore

    return EngineCore(_vllm_config(model_dir), _Executor, log_stats=False)


@pytest.fixture
def patched():
    assert apply_all(PATCHES) == [PATCH_ID]
    yield
    undo()


def _bound(worker):
    ctx = worker.vllm_config.compilation_config.static_forward_context
    return [ctx[n].kv_cache[0] for n in LAYERS]


def test_without_the_patch_the_cache_cannot_come_back(model_dir):
    core = _core(model_dir)
    worker = core.model_executor.worker
    assert not hasattr(core, KEPT_ATTR)
    with pytest.raises(KVCacheError, match=PATCH_ID):
        free_kv_cache(core)
    with pytest.raises(KVCacheError, match=PATCH_ID):
        init_kv_cache(core)
    assert all(t.numel() > 0 for t in _bound(worker))  # refused before freeing anything


def test_free_and_recreate_every_step(model_dir, patched):
    core = _core(model_dir)
    ex, worker = core.model_executor, core.model_executor.worker
    assert "initialize_from_config" not in vars(ex)  # the executor's own method is back
    kept = getattr(core, KEPT_ATTR)
    assert kept == worker.inits[0] and len(kept) == 1
    sizes = [t.size for t in kept[0].kv_cache_tensors]
    blocks = core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    assert blocks == kept[0].num_blocks == core.vllm_config.cache_config.num_gpu_blocks
    for step in range(3):
        assert free_kv_cache(core) == sum(sizes)
        assert worker.model_runner.kv_caches == [] and all(t.numel() == 0 for t in _bound(worker))
        init_kv_cache(core)
        after = _bound(worker)
        assert [t.numel() for t in after] == sizes and len(worker.model_runner.kv_caches) == len(LAYERS)
        assert len(worker.inits) == step + 2 and worker.inits[-1] == kept
        assert core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks == blocks  # scheduler still valid


def test_free_refuses_while_a_request_holds_blocks(model_dir, patched):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    core = _core(model_dir)
    req = Request("r0", [1] * (3 * BLOCK), None, None, None, SamplingParams(max_tokens=4), eos_token_id=0)
    core.scheduler.add_request(req)
    core.scheduler.schedule()
    with pytest.raises(KVCacheError, match="still hold KV blocks"):
        free_kv_cache(core)
    assert all(t.numel() > 0 for t in _bound(core.model_executor.worker))


def test_worker_release_counts_shared_storage_once():
    shared = torch.zeros(64, dtype=torch.int8)
    worker = SimpleNamespace(model_runner=SimpleNamespace(kv_caches=[shared, shared[:32]]),
                             vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(
                                 static_forward_context={"a": SimpleNamespace(kv_cache=[shared])})))
    runner_list = worker.model_runner.kv_caches
    assert release_worker_kv_cache(worker) == 64
    assert worker.model_runner.kv_caches is runner_list and runner_list == []
    assert worker.vllm_config.compilation_config.static_forward_context["a"].kv_cache[0].numel() == 0
