"""vllm.LLM.sleep / wake_up reach the offload engine on a recipe engine (patches vllm.llm.*), as verl's
sharding manager calls them. The LLM object is vLLM's real class made without its constructor
(which would build an engine); behind it, vLLM's real EngineCore with stand-in workers."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from verl_patches.core.apply import apply_all, undo
from verl_patches.offload import OffloadEngine
from verl_patches.patches.vllm.patch_entrypoints_llm import MEMORY_ATTR
from verl_patches.patches.vllm.patch_entrypoints_llm import PATCHES as LLM_PATCHES
from verl_patches.patches.vllm.patch_v1_engine_core import PATCHES as ENGINE_CORE
from verl_patches.rollout.engine_memory import VllmEngineMemory, attach_engine_memory

sys.path.insert(0, str(Path(__file__).resolve().parent))  # an unrelated `tests` package is installed
import vllm_engine_standins as standins  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return standins.write_model_dir(tmp_path_factory.mktemp("tiny_llama"))


class _EngineCalls:
    def __init__(self, core):
        self.engine_core = SimpleNamespace(engine_core=core)
        self.calls: list = []

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self, device=None):
        self.calls.append(("reset_prefix_cache",))
        return True


def _llm(model_dir, attach: bool):
    from vllm.entrypoints.llm import LLM

    apply_all(ENGINE_CORE)
    try:
        core = standins.engine_core(model_dir)
    finally:
        undo()
    llm = LLM.__new__(LLM)
    llm.llm_engine = _EngineCalls(core)
    memory = VllmEngineMemory(llm, OffloadEngine())  # frees the KV cache, as the rollout's constructor does
    if attach:
        attach_engine_memory(llm, memory)  # the weights are released where the switch loop starts
    else:
        memory.weights.release()  # what the loop's start does to an attached engine
    return llm, memory


def _state(memory):
    runner = memory.core.model_executor.worker.model_runner
    weights = sum(p.untyped_storage().nbytes() for p in runner.model.parameters())
    return weights > 0, len(runner.kv_caches) > 0


def test_sharding_manager_calls_drive_the_offload_engine(model_dir):
    llm, memory = _llm(model_dir, attach=True)
    apply_all(LLM_PATCHES)
    try:
        assert _state(memory) == (False, False)
        llm.wake_up(tags=["weights"])  # MegatronVLLMShardingManager.__enter__, before the reshard
        assert _state(memory) == (True, False)
        llm.wake_up(tags=["kv_cache"])  # after the reshard
        assert _state(memory) == (True, True)
        llm.sleep(level=1)  # __exit__
        assert _state(memory) == (False, False)
        llm.wake_up()  # no tags: both
        assert _state(memory) == (True, True)
        with pytest.raises(ValueError, match="expected 'weights' and/or 'kv_cache'"):
            llm.wake_up(tags=["optimizer"])
        assert llm.llm_engine.calls == []  # vLLM's sleep mode never reached
    finally:
        undo()


def test_engines_without_recipe_memory_and_the_unpatched_class_keep_sleep_mode(model_dir):
    llm, memory = _llm(model_dir, attach=False)
    apply_all(LLM_PATCHES)
    try:
        llm.sleep(level=1)
        llm.wake_up(tags=["weights"])
    finally:
        undo()
    assert llm.llm_engine.calls == [("reset_prefix_cache",), ("sleep", 1), ("wake_up", ["weights"])]
    # Unpatched, an attached memory is ignored: the weights stay freed after wake_up.
    setattr(llm, MEMORY_ATTR, memory)
    llm.wake_up(tags=["weights"])
    assert _state(memory) == (False, False)
