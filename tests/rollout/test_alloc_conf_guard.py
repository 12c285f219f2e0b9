"""PYTORCH_NPU_ALLOC_CONF with expandable segments and graph mode's address-stable regions on NPU
(vLLM-Ascend's CaMem pool): refused by name at arm time and by the configuration check, and off in
the launcher's default (docs/RECIPE.md, "Expandable segments").

No NPU here: the device is named through VERL_PATCHES_DEVICE=npu and the backend is a declared
stand-in carrying the CaMem backend's name; the refusal happens before either would touch the device.
The configuration check runs on the real composed run configs.
"""

from __future__ import annotations

import pytest

from verl_patches.checks import recipe_config as RC
from verl_patches.offload.stable import StableBackend
from verl_patches.rollout import graph_safe
from verl_patches.rollout.graph_safe import GraphModeError, alloc_conf_conflict, arm_for_build, expandable_segments

ON = "expandable_segments:True"


class _Named(StableBackend):
    """Stand-in: only the name of a backend is read before the refusal (nothing is allocated)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


@pytest.fixture(autouse=True)
def _disarm():
    yield
    graph_safe._ARMED = None


@pytest.mark.parametrize("conf, on", [
    (ON, True), ("max_split_size_mb:128,expandable_segments:True", True), (" expandable_segments : True ", True),
    ("expandable_segments:False", False), ("", False), ("max_split_size_mb:128", False),
    ("expandable_segments:true", False),  # torch's parser takes only True / False
])
def test_the_setting_is_read_as_the_allocator_reads_it(conf, on):
    assert expandable_segments(conf) is on
    assert (alloc_conf_conflict({"PYTORCH_NPU_ALLOC_CONF": conf}) is not None) is on


def test_arm_time_refuses_it_on_npu_naming_the_fix(monkeypatch):
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "npu")
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", ON)
    with pytest.raises(GraphModeError, match=r"PYTORCH_NPU_ALLOC_CONF='expandable_segments:True'.*CaMem.*"
                                             r"expandable_segments:False.*enforce_eager=True"):
        arm_for_build(enforce_eager=False, offload=True)
    assert graph_safe.armed() is None
    # Eager, or vLLM's own sleep mode path: no address-stable regions are armed, nothing to refuse.
    assert arm_for_build(enforce_eager=True, offload=True) is None
    assert arm_for_build(enforce_eager=False, offload=False) is None


def test_arm_time_with_the_camem_backend_and_without_the_setting(monkeypatch):
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", ON)
    with pytest.raises(GraphModeError, match="expandable segments"):
        arm_for_build(enforce_eager=False, offload=True, backend=_Named(graph_safe.NPU_BACKEND))
    # CUDA's backends: torch_npu's variable is nobody's business there.
    assert arm_for_build(enforce_eager=False, offload=True, backend=_Named("vllm_cumem")) is graph_safe.armed()
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:False")
    build = arm_for_build(enforce_eager=False, offload=True, backend=_Named(graph_safe.NPU_BACKEND))
    assert build is not None and build is graph_safe.armed() and build.backend.name == graph_safe.NPU_BACKEND
    monkeypatch.delenv("PYTORCH_NPU_ALLOC_CONF")
    assert arm_for_build(enforce_eager=False, offload=True, backend=_Named(graph_safe.NPU_BACKEND)) is not None


@pytest.fixture(scope="module")
def model():
    return RC.load_model_config(RC.DEFAULT_MODEL_CONFIG)


def _errors(name, model, environ, *overrides):
    return [e for e in RC.validate(RC.compose(name, list(overrides)), model, environ).errors
            if "PYTORCH_NPU_ALLOC_CONF" in e]


def test_the_configuration_check_says_the_same(model):
    name = "deepseekv3_256die_random_init"  # NPU, graph mode (TorchAir), recipe.offload
    (err,) = _errors(name, model, {"PYTORCH_NPU_ALLOC_CONF": ON})
    assert err == alloc_conf_conflict({"PYTORCH_NPU_ALLOC_CONF": ON})
    assert _errors(name, model, {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"}) == []
    assert _errors(name, model, {}) == []
    # Eager rollout or no recipe offload: no pool, so the setting is the user's choice.
    assert _errors(name, model, {"PYTORCH_NPU_ALLOC_CONF": ON}, "actor_rollout_ref.rollout.enforce_eager=True",
                   "actor_rollout_ref.rollout.free_cache_engine=False") == []
    assert _errors(name, model, {"PYTORCH_NPU_ALLOC_CONF": ON}, "actor_rollout_ref.rollout.recipe.offload=False") == []
    # Not on NPU: torch_npu's variable is read by nobody.
    assert _errors(name, model, {"PYTORCH_NPU_ALLOC_CONF": ON}, "trainer.device=cuda") == []


def test_the_launchers_default_is_off():
    from tests.recipe.test_env import env_rows

    (row,) = [r for r in env_rows() if r[0] == "PYTORCH_NPU_ALLOC_CONF"]
    assert row[1] == ON and row[3] == "expandable_segments:False" and not expandable_segments(row[3])
