"""KV cache freed and re-created every step through vLLM 0.9.1's real EngineCore and scheduler
(patch vllm.engine_core.keep_kv_cache_configs + verl_patches.rollout.kv_cache); the executor and
its worker are stand-ins (vllm_engine_standins.py says why)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verl_patches.core.apply import apply_all, undo
from verl_patches.patches.vllm.patch_v1_engine_core import PATCHES
from verl_patches.rollout.kv_cache import (KEPT_ATTR, PATCH_ID, KVCacheError, free_kv_cache, init_kv_cache,
                                           release_worker_kv_cache)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # site-packages has an unrelated `tests` package
import vllm_engine_standins as standins  # noqa: E402

LAYERS, BLOCK = standins.LAYERS, standins.BLOCK


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return standins.write_model_dir(tmp_path_factory.mktemp("tiny_llama"))


def _core(model_dir):
    return standins.engine_core(model_dir)


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
