"""Graph mode's address-stable build and switch on CPU (patches vllm.worker.stable_regions and
vllm.worker.stable_kv_cache_region, verl_patches.rollout.graph_safe / engine_memory).

Real: vLLM 0.9.1's EngineCore and scheduler, the GPU worker's own load_model and
initialize_from_config (wrapped by the patches), vllm.LLM's sleep / wake_up (patched as in the
recipe), and vLLM-Ascend's camem.py as the backend. Stand-ins, declared: the model runner (vLLM's
needs kernels; this one builds a small torch model and a KV cache from vLLM's own KVCacheConfig)
and camem.py's Ascend calls (tests/offload/vmm_standins.py; the runner reports each tensor it
creates to the stand-in allocator, which the real C extension would see by itself).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verl_patches.core.apply import apply_all, undo
from verl_patches.offload import AddressMovedError, Location, OffloadEngine
from verl_patches.offload.stable import _select
from verl_patches.patches.vllm.patch_entrypoints_llm import PATCHES as LLM_PATCHES
from verl_patches.patches.vllm.patch_v1_engine_core import PATCHES as ENGINE_CORE
from verl_patches.patches.vllm.patch_v1_worker_gpu_worker import PATCHES as WORKER
from verl_patches.rollout.engine_memory import VllmEngineMemory, attach_engine_memory
from verl_patches.rollout.graph_safe import GraphModeError, arm_for_build

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "offload"))
import vllm_engine_standins as standins  # noqa: E402
import vmm_standins  # noqa: E402


class Runner:
    """Stand-in model runner: what vLLM's allocates in load_model and initialize_kv_cache."""

    vmm = None
    stray: list = []

    def __init__(self, vllm_config, leak: bool) -> None:
        self.vllm_config, self.leak = vllm_config, leak
        self.kv_caches: list = []
        self.model = None

    def load_model(self) -> None:
        model = standins._model()  # two Linear layers and a rotary-cache-like buffer
        for t in [*model.parameters(), *model.buffers()]:
            self.vmm.allocated(t)
        model.expert_map = self.vmm.allocated(torch.arange(4))  # a plain tensor attribute (FusedMoE's)
        if self.leak:  # held where no walk of the model finds it
            Runner.stray.append(self.vmm.allocated(torch.ones(3)))
        self.model = model

    def initialize_kv_cache(self, cfg) -> None:
        from vllm.v1.utils import bind_kv_cache

        caches = {}
        for t in cfg.kv_cache_tensors:
            buf = self.vmm.allocated(torch.zeros(t.size, dtype=torch.int8))
            for name in t.shared_by:
                caches[name] = buf
        bind_kv_cache(caches, self.vllm_config.compilation_config.static_forward_context, self.kv_caches)


class Executor(standins.Executor):
    """The stand-in executor around vLLM's real GPU Worker methods (the object made without
    its constructor, which would initialise a device)."""

    leak = False

    def __init__(self, vllm_config):
        from vllm.v1.worker.gpu_worker import Worker

        worker = Worker.__new__(Worker)
        worker.vllm_config = vllm_config
        worker.model_runner = Runner(vllm_config, self.leak)
        for name in standins.LAYERS:
            vllm_config.compilation_config.static_forward_context[name] = SimpleNamespace(kv_cache=[torch.tensor([])])
        self.worker = worker
        worker.load_model()

    def initialize_from_config(self, kv_cache_configs):
        self.collective_rpc("initialize_from_config", args=(kv_cache_configs[0],))  # this rank's, as vLLM picks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return standins.write_model_dir(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")  # the stand-in's memory is host memory
    vmm, _ = vmm_standins.install(monkeypatch)
    Runner.vmm, Runner.stray = vmm, []
    b, why = _select("npu", "auto")
    assert b is not None, why
    yield vmm, b
    arm_for_build(enforce_eager=True, offload=True)  # disarm


def _llm(model_dir, *, patched: bool, leak: bool = False):
    from vllm.entrypoints.llm import LLM
    from vllm.v1.engine.core import EngineCore

    Executor.leak = leak
    cfg = standins.vllm_config(model_dir)
    apply_all(ENGINE_CORE + (WORKER if patched else []))
    saved = os.environ.get("VERL_PATCHES_OFF")
    os.environ["VERL_PATCHES_OFF"] = "1"  # EngineCore loads vLLM's plugins, ours among them
    try:
        core = EngineCore(cfg, Executor, log_stats=False)
    finally:
        undo()
        os.environ.pop("VERL_PATCHES_OFF") if saved is None else os.environ.__setitem__("VERL_PATCHES_OFF", saved)
    cfg.model_config.enforce_eager = False  # graph mode (set after the build: no capture runs on CPU)
    llm = LLM.__new__(LLM)
    llm.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=core))
    return llm, core


def test_graph_mode_switch_keeps_every_address_and_frees_the_regions(model_dir, backend):
    vmm, b = backend
    arm_for_build(enforce_eager=False, offload=True, backend=b)
    llm, core = _llm(model_dir, patched=True)
    worker = core.model_executor.worker
    runner, model = worker.model_runner, worker.model_runner.model
    memory = VllmEngineMemory(llm, OffloadEngine())
    attach_engine_memory(llm, memory)  # as the rollout's constructor does: weights released where the loop starts
    assert memory.stable is not None and memory.weights.region.tag == "rollout_weights"
    # load_model's buffer and tensor attribute left the weights region with their values.
    assert sorted(memory.stable.moved_out) == ["<model>.cos_sin_cache", "<model>.expert_map"]
    assert model.cos_sin_cache.tolist() == list(range(32)) and model.expert_map.tolist() == [0, 1, 2, 3]
    regions = {tag: [p for p, _ in b.ranges(tag)] for tag in ("rollout_weights", "rollout_kv_cache")}
    assert len(regions["rollout_weights"]) == 4 + 2 and len(regions["rollout_kv_cache"]) == len(standins.LAYERS)
    mapped = lambda tag: {vmm.mapped[p] for p in regions[tag]}  # noqa: E731
    assert mapped("rollout_weights") == mapped("rollout_kv_cache") == {False}
    params_at = [p.data_ptr() for p in model.parameters()]
    kv_at = [t.data_ptr() for t in runner.kv_caches]
    apply_all(LLM_PATCHES)
    try:
        for step in range(3):
            llm.wake_up(tags=["weights"])  # the sharding manager, before the reshard
            assert mapped("rollout_weights") == {True} and mapped("rollout_kv_cache") == {False}
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(step)  # the reshard writes in place
            llm.wake_up(tags=["kv_cache"])
            assert mapped("rollout_kv_cache") == {True}
            assert all(int(t.abs().sum()) == 0 for t in runner.kv_caches)  # zeroed, as a fresh cache
            assert [p.data_ptr() for p in model.parameters()] == params_at
            assert [t.data_ptr() for t in runner.kv_caches] == kv_at
            ctx = worker.vllm_config.compilation_config.static_forward_context
            assert [ctx[n].kv_cache[0].data_ptr() for n in standins.LAYERS] == kv_at
            runner.kv_caches[0].fill_(1)  # generation
            llm.sleep(level=1)
            assert mapped("rollout_weights") == mapped("rollout_kv_cache") == {False}
            assert memory.weights.device_bytes() == memory.kv.device_bytes() == 0
            assert model.cos_sin_cache.tolist() == list(range(32))
        # A weight re-created instead of written in place is caught before generation.
        llm.wake_up(tags=["weights"])
        first = next(model.parameters())
        first.data = first.data.clone()
        with pytest.raises(AddressMovedError, match="0.weight"):
            llm.wake_up(tags=["kv_cache"])
        assert memory.kv.location is Location.RELEASED
    finally:
        undo()
    memory.close()


def test_graph_mode_without_the_worker_patches_is_refused(model_dir, backend):
    _, b = backend
    arm_for_build(enforce_eager=False, offload=True, backend=b)
    llm, _ = _llm(model_dir, patched=False)
    with pytest.raises(GraphModeError, match="was not built inside address-stable regions"):
        VllmEngineMemory(llm, OffloadEngine())


def test_a_tensor_left_in_the_weights_region_fails_the_build(model_dir, backend):
    _, b = backend
    arm_for_build(enforce_eager=False, offload=True, backend=b)
    with pytest.raises(GraphModeError, match=r"1 tensor\(s\) besides the rollout parameters .*\(3,\) float32 at 0x[0-9a-f]+ held by \['list'\]"):
        _llm(model_dir, patched=True, leak=True)
