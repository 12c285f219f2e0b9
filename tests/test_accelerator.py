"""The accelerator facade: resolved at call time, importable without torch_npu, NPU path via a fake."""

import pytest
import torch

from tests.helpers import run_py
from verl_patches.base import accelerator as acc


def test_cpu_resolution_here(monkeypatch):
    monkeypatch.delenv("VERL_PATCHES_DEVICE", raising=False)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert acc.device_type() == "cpu"
    assert acc.dist_backend() == "gloo"
    assert acc.current_device() == torch.device("cpu")
    assert acc.new_stream() is None and acc.new_event() is None
    assert not acc.pin_memory_supported()
    free, total = acc.mem_get_info()
    assert 0 < free <= total
    acc.synchronize(); acc.empty_cache(); acc.reset_peak_memory_stats()
    assert acc.memory_allocated() == 0
    with acc.stream(None):
        pass


def test_resolved_at_call_time_not_at_import(monkeypatch):
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cuda")
    assert acc.device_type() == "cuda" and acc.dist_backend() == "nccl"
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")
    assert acc.device_type() == "cpu" and acc.dist_backend() == "gloo"


def test_bad_forced_value_is_named(monkeypatch):
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "tpu")
    with pytest.raises(ValueError, match="VERL_PATCHES_DEVICE='tpu'"):
        acc.device_type()


def test_importable_without_torch_npu_and_does_not_import_it():
    r = run_py("""
import importlib.util, sys
assert importlib.util.find_spec("torch_npu") is None
from verl_patches.base import accelerator
assert accelerator.device_type() in ("cpu", "cuda")
assert "torch_npu" not in sys.modules
print("OK")
""")
    assert "OK" in r.stdout, r.stderr


def test_npu_path_with_a_fake_torch_npu():
    """FAKE: torch_npu cannot be installed off Ascend (it breaks `import torch`). A stand-in does
    what torch_npu's registration does (rename the privateuse1 backend to "npu" and add a
    torch.npu namespace), in a subprocess because the rename cannot be undone."""
    r = run_py(r"""
import os, sys, types, torch
os.environ.pop("VERL_PATCHES_DEVICE", None)  # resolved from the platform, whatever another test left here
calls = []
torch.utils.rename_privateuse1_backend("npu")
torch.npu = types.SimpleNamespace(
    is_available=lambda: True, current_device=lambda: 3, set_device=lambda i: calls.append(("set", i)),
    synchronize=lambda *a: calls.append("sync"), empty_cache=lambda: calls.append("empty"),
    memory_allocated=lambda *a: 123, max_memory_allocated=lambda *a: 456,
    reset_peak_memory_stats=lambda *a: calls.append("reset"), mem_get_info=lambda: (1, 2),
    Stream=lambda: "npu-stream", Event=lambda: "npu-event", device_count=lambda: 16,
    get_device_name=lambda i: "Ascend910_9392")
sys.modules["torch_npu"] = types.ModuleType("torch_npu")
from verl_patches.base import accelerator as acc
assert acc.device_type() == "npu" and acc.dist_backend() == "hccl"
assert acc.device_module() is torch.npu
assert acc.set_device(5) == torch.device("npu", 5) and ("set", 5) in calls
assert acc.current_device() == torch.device("npu", 3)
acc.synchronize(); acc.empty_cache(); acc.reset_peak_memory_stats()
assert calls[1:] == ["sync", "empty", "reset"]
assert acc.memory_allocated() == 123 and acc.max_memory_allocated() == 456
assert acc.mem_get_info() == (1, 2) and acc.new_stream() == "npu-stream" and acc.new_event() == "npu-event"
assert acc.pin_memory_supported()
assert acc.describe()["device_name"] == "Ascend910_9392"
print("NPU-OK")
""")
    assert "NPU-OK" in r.stdout, r.stderr[-3000:]
