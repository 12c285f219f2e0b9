"""verl 0.4.1's real vLLMRollout constructed from the recipe's real YAML (patch verl.vllm_rollout.recipe_engine).

vllm.LLM cannot be built on CPU (no kernels in the empty build), so verl's module-level LLM is
swapped for a recorder that keeps the engine arguments and holds vLLM's real EngineCore and
scheduler around stand-in workers (tests/patches/vllm/vllm_engine_standins.py). Everything
else is real: verl's class, the composed Hydra config, the DP-domain collective (one gloo rank),
the KV-cache configs kept by the engine-core patch and the offload engine behind the methods.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from verl_patches.core import stash
import torch.distributed as dist

from verl_patches.core.apply import apply_all, undo
from verl_patches.patches.verl.patch_workers_rollout_vllm_rollout_spmd import PATCHES as ROLLOUT
from verl_patches.patches.vllm.patch_entrypoints_llm import MEMORY_ATTR
from verl_patches.patches.vllm.patch_v1_engine_core import PATCHES as ENGINE_CORE
from verl_patches.rollout.dp_sync import FLAG_ENV
from verl_patches.launch.local_ranks import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))  # an unrelated `tests` is installed
import vllm_engine_standins as standins  # noqa: E402

ONE_RANK = ["actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.recipe.vllm_dp.dp_size=1",
            "actor_rollout_ref.rollout.recipe.vllm_dp.instances=1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return standins.write_model_dir(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def world():
    """verl's job world as the rollout sees it: here one gloo rank."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def env():
    saved = dict(os.environ)
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def recorder(model_dir, monkeypatch):
    from verl.workers.rollout.vllm_rollout import vllm_rollout_spmd

    class RecordingLLM:
        built: list = []

        def __init__(self, **kwargs):
            RecordingLLM.built.append(kwargs)
            self.slept = None
            core = standins.engine_core(model_dir)
            self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=core))

        def sleep(self, level=1):
            self.slept = level

    monkeypatch.setattr(vllm_rollout_spmd, "LLM", RecordingLLM)
    return RecordingLLM


def _rollout_config(*overrides):
    from verl_patches.checks.recipe_config import compose

    return compose("deepseekv3_256die_true_weight", [*ONE_RANK, *overrides]).actor_rollout_ref.rollout


def _build(cfg, model_dir):
    from transformers import AutoTokenizer, LlamaConfig
    from verl.workers.rollout.vllm_rollout.vllm_rollout_spmd import vLLMRollout

    hf = LlamaConfig(max_position_embeddings=8192)
    return vLLMRollout(str(model_dir), cfg, AutoTokenizer.from_pretrained(str(model_dir)), hf)


def _weights_bytes(rollout):
    model = stash.get(rollout, "engine_memory").core.model_executor.worker.model_runner.model
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def test_upstream_constructor_rejects_the_recipes_token_budget(model_dir, world, env, recorder):
    with pytest.raises(ValueError, match="max_num_batched_tokens is smaller than max_model_len"):
        _build(_rollout_config(), model_dir)
    assert recorder.built == []


def test_the_yamls_graph_mode_needs_an_address_stable_backend(model_dir, world, env, recorder, monkeypatch):
    from verl_patches.rollout.graph_safe import GraphModeError

    cfg = _rollout_config()
    assert cfg.enforce_eager is False  # the recipe runs graphs (TorchAir / CUDA graphs)
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")  # none on CPU (tests/offload/test_stable_memory.py: NPU)
    apply_all(ENGINE_CORE + ROLLOUT)
    try:
        with pytest.raises(GraphModeError, match="Set actor_rollout_ref.rollout.enforce_eager=True, or install"):
            _build(cfg, model_dir)
    finally:
        undo()
    assert recorder.built == []  # refused before the engine was built


def test_graph_mode_on_npu_refuses_expandable_segments_before_the_engine(model_dir, world, env, recorder, monkeypatch):
    from verl_patches.rollout.graph_safe import GraphModeError

    cfg = _rollout_config()
    # The NPU is named, not present: the refusal comes before anything touches it.
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "npu")
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True")
    apply_all(ENGINE_CORE + ROLLOUT)
    try:
        with pytest.raises(GraphModeError, match="Unset it or set expandable_segments:False"):
            _build(cfg, model_dir)
    finally:
        undo()
    assert recorder.built == []


@pytest.mark.slow
def test_recipe_engine_from_yaml(model_dir, world, env, recorder):
    # Eager here: graph mode needs an address-stable allocator, which CPU has none of
    # (its build and switch: tests/patches/vllm/test_worker_stable_regions.py).
    cfg = _rollout_config("actor_rollout_ref.rollout.enforce_eager=True")
    apply_all(ENGINE_CORE + ROLLOUT)
    try:
        rollout = _build(cfg, model_dir)
    finally:
        undo()
    (kw,) = recorder.built
    assert kw["enable_sleep_mode"] is False and kw["enable_expert_parallel"] is True
    assert kw["max_num_batched_tokens"] == cfg.max_num_batched_tokens == 1024
    assert kw["enable_chunked_prefill"] is True and kw["max_model_len"] == 1024 + 3072
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["load_format"] == "dummy"
    from omegaconf import OmegaConf

    assert kw["additional_config"] == OmegaConf.to_container(cfg.engine_kwargs.vllm.additional_config, resolve=True)
    assert kw["additional_config"]["torchair_graph_config"]["enable_view_optimize"] is False
    # The reference's engine: prefix caching off (upstream hard-codes it on), 64 sequences per rank, and
    # the memory share it ran with; TorchAir graphs of five batch sizes up to 64 (the reference: one).
    assert kw["enable_prefix_caching"] is False and kw["max_num_seqs"] == cfg.max_num_seqs == 64
    assert kw["additional_config"]["torchair_graph_config"]["graph_batch_sizes"] == [2, 8, 16, 32, 64]
    assert kw["gpu_memory_utilization"] == 0.8
    # The DP domain reached the environment vLLM reads, with the YAML's port base.
    assert os.environ["VLLM_DP_SIZE"] == "1" and os.environ["VLLM_DP_RANK"] == "0"
    assert os.environ["VLLM_DP_MASTER_PORT"] == str(cfg.recipe.vllm_dp.master_port_base)
    assert os.environ["VLLM_DP_MASTER_IP"] == "127.0.0.1" and os.environ[FLAG_ENV] == "1"
    # Sampling from YAML, as upstream builds it.
    sp = rollout.sampling_params
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (16, 0.9, 0.9, 50, 3072)
    assert rollout.inference_engine.slept is None  # no sleep mode: the offload engine freed memory

    # The switch, as the loop drives it (the rows of the engine's wake_up and sleep, which verl's
    # sharding manager calls): weights and KV cache come and go for real.
    from verl_patches.offload.live import live_switch, wake_call

    switch = live_switch()
    worker = stash.get(rollout, "engine_memory").core.model_executor.worker
    full = sum(p.numel() * p.element_size() for p in worker.model_runner.model.parameters())
    buffer = worker.model_runner.model.cos_sin_cache
    assert buffer.tolist() == list(range(32))  # built once, rewritten by nobody: must never be freed
    assert _weights_bytes(rollout) == 0 and worker.model_runner.kv_caches == []
    for _ in range(2):
        switch.run_call(wake_call("weights"))
        assert _weights_bytes(rollout) == full
        switch.run_call(wake_call("kv_cache"))
        assert len(worker.model_runner.kv_caches) == len(standins.LAYERS)
        assert all(t.numel() > 0 for t in worker.model_runner.kv_caches)
        switch.run_call("LLM.sleep")
        assert _weights_bytes(rollout) == 0 and worker.model_runner.kv_caches == []
        assert buffer.tolist() == list(range(32))
    from verl_patches.offload.schedule import ROLES

    # The groups are the loop's, on the loop's own offload engine.
    assert set(stash.get(rollout, "engine_memory").groups()) <= set(ROLES)
    assert any(m is stash.get(rollout, "engine_memory") for m in switch.members)
    assert stash.get(rollout, "engine_memory").engine is switch.offload_engine()
    # verl's sharding manager reaches the same methods through the engine's sleep / wake_up.
    assert getattr(rollout.inference_engine, MEMORY_ATTR) is stash.get(rollout, "engine_memory")
    stash.get(rollout, "engine_memory").close()  # one rollout per process on the cluster; tests build several


def test_recipe_flags_off_keep_upstream_memory_behaviour(model_dir, world, env, recorder):
    cfg = _rollout_config("actor_rollout_ref.rollout.recipe.offload=False",
                          "actor_rollout_ref.rollout.recipe.dp_sync_on_device=False",
                          "actor_rollout_ref.rollout.enforce_eager=True")
    apply_all(ROLLOUT)
    try:
        rollout = _build(cfg, model_dir)
    finally:
        undo()
    (kw,) = recorder.built
    assert kw["enable_sleep_mode"] is True and rollout.inference_engine.slept == 1
    assert stash.get(rollout, "engine_memory") is None
    assert not hasattr(rollout.inference_engine, MEMORY_ATTR)
    assert os.environ[FLAG_ENV] == "0"


def test_no_chunked_prefill_with_a_small_budget_is_refused_by_name(model_dir, world, env, recorder):
    cfg = _rollout_config("actor_rollout_ref.rollout.enable_chunked_prefill=False")
    apply_all(ROLLOUT)
    try:
        with pytest.raises(ValueError, match="needs rollout.enable_chunked_prefill=True"):
            _build(cfg, model_dir)
    finally:
        undo()
    assert recorder.built == []
