"""Address-stable memory on CPU: the NPU binding (vLLM-Ascend's real camem.py) per tag, offload groups
over a region (release / allocate / address check), backend selection, and MLA's derived tensors
rewritten in place.

camem.py runs for real; what it calls on Ascend is a declared stand-in (tests/offload/vmm_standins.py:
the vllm_ascend_C extension, acl.rt and torch.npu's pluggable allocator and MemPool). Unmapping cannot
be observed on CPU, so the stand-in's map is what the tests read. The same binding class serves vLLM's
CuMemAllocator; the real CUDA path is tests/offload/test_graph_switch_gpu.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from verl_patches.offload import (AddressMovedError, GroupStateError, Location, OffloadEngine, Region,
                                  StableMemoryError, TensorGroup)
from verl_patches.offload.stable import ENV, VmmAllocatorBackend, _select, select

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vmm_standins  # noqa: E402


@pytest.fixture
def camem(monkeypatch):
    pytest.importorskip("vllm_ascend")  # its real camem.py is what is bound (the CPU test environment has it)
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")  # the stand-in's memory is host memory
    vmm, mod = vmm_standins.install(monkeypatch)
    backend, why = _select("npu", "auto")
    assert isinstance(backend, VmmAllocatorBackend) and backend.name == "vllm_ascend_camem", why
    return vmm, backend


def _in_region(vmm, backend, tag, *shapes):
    with backend.region(tag):
        return [vmm.allocated(torch.randn(*s)) for s in shapes]


def test_camem_binding_releases_and_maps_one_tag_only(camem):
    vmm, backend = camem
    w = _in_region(vmm, backend, "w", (64,), (8, 8))
    kv = _in_region(vmm, backend, "kv", (32,))
    assert sorted(p for p, _ in backend.ranges("w")) == sorted(t.data_ptr() for t in w)
    assert backend.ranges("kv") == [(kv[0].data_ptr(), 32 * 4)]
    backend.release("w")
    assert [vmm.mapped[t.data_ptr()] for t in w + kv] == [False, False, True]
    backend.release("w")  # idempotent: no second unmap (the stand-in would refuse it)
    assert backend.is_released("w") and not backend.is_released("kv")
    backend.allocate("w")
    assert all(vmm.mapped[t.data_ptr()] for t in w + kv)
    assert [c for c, _ in vmm.calls] == ["unmap", "unmap", "map", "map"]  # never sleep()'s memcpy


def test_camem_binding_maps_all_or_nothing(camem):
    vmm, backend = camem
    w = _in_region(vmm, backend, "w", (16,), (16,), (16,))
    backend.release("w")
    vmm.fail_map_at = 2
    with pytest.raises(RuntimeError, match="out of memory"):
        backend.allocate("w")
    assert backend.is_released("w") and not any(vmm.mapped[t.data_ptr()] for t in w)
    vmm.fail_map_at = None
    backend.allocate("w")
    assert all(vmm.mapped[t.data_ptr()] for t in w)


def test_group_over_a_region_keeps_addresses_and_frees_for_real(camem):
    vmm, backend = camem
    params = [torch.nn.Parameter(t) for t in _in_region(vmm, backend, "w", (4, 8), (8,))]
    view = params[0][1:]  # a view a graph might read
    region = Region(backend, "w")
    g = TensorGroup(OffloadEngine(), "rollout_weights", params, region=region,
                    watch=lambda: {"p0": params[0], "p1": params[1], "p0.view": view})
    at = [p.data_ptr() for p in params]
    assert g.device_bytes() == g.nbytes == (32 + 8) * 4
    for _ in range(3):
        g.release()
        assert g.location is Location.RELEASED and g.device_bytes() == 0
        assert not any(vmm.mapped[a] for a in at)
        g.allocate()
        assert g.location is Location.DEVICE and g.device_bytes() == g.nbytes
        assert [p.data_ptr() for p in params] == at and all(vmm.mapped[a] for a in at)
    # Copies go through the same region: offload -> host, onload maps again and copies back.
    want = [p.detach().clone() for p in params]
    g.offload()
    assert not any(vmm.mapped[a] for a in at)
    g.onload()
    assert all(torch.equal(p, w) for p, w in zip(params, want)) and [p.data_ptr() for p in params] == at


def test_a_replaced_tensor_is_an_error_after_allocate_not_a_warning(camem):
    vmm, backend = camem
    holder = {"w": torch.nn.Parameter(_in_region(vmm, backend, "w", (16,))[0])}
    g = TensorGroup(OffloadEngine(), "w", [holder["w"]], region=Region(backend, "w"), watch=lambda: dict(holder))
    g.release()
    holder["w"] = torch.nn.Parameter(torch.zeros(16))  # re-created instead of written in place
    with pytest.raises(AddressMovedError, match=r"w \(0x"):
        g.allocate()
    # Rolled back: released again, so the schedule's retry raises again instead of passing.
    assert g.location is Location.RELEASED and backend.is_released("w")
    with pytest.raises(AddressMovedError):
        g.allocate()
    with pytest.raises(GroupStateError):
        g.onload()


def test_a_storage_outside_the_region_is_refused_at_build(camem):
    vmm, backend = camem
    inside = _in_region(vmm, backend, "w", (8,))
    with pytest.raises(StableMemoryError, match="not in the address-stable region"):
        TensorGroup(OffloadEngine(), "w", inside + [torch.zeros(8)], region=Region(backend, "w"))


def test_selection_on_cpu_and_by_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    backend, why = select("cpu")
    assert backend is None and "no address-stable allocator on 'cpu'" in why
    assert _select("cuda", "none") == (None, f"{ENV}=none")
    backend, why = _select("cuda", "vllm_ascend_camem")
    assert backend is None and "not a backend for 'cuda'" in why
    monkeypatch.setenv(ENV, "bogus")
    with pytest.raises(ValueError, match=ENV):
        select("cuda")


def test_graph_mode_without_a_backend_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")
    from verl_patches.rollout.graph_safe import GraphModeError, arm_for_build, armed

    assert arm_for_build(enforce_eager=True, offload=True) is None and armed() is None
    assert arm_for_build(enforce_eager=False, offload=False) is None  # vLLM's own sleep mode path
    with pytest.raises(GraphModeError, match=r"enforce_eager=True, or install an accelerator"):
        arm_for_build(enforce_eager=False, offload=True)
    assert armed() is None


def test_graph_mode_on_cuda_without_the_allocator_is_refused_naming_torch_memory_saver(monkeypatch):
    """The GPU configs run graph mode by default: where neither torch_memory_saver nor a CUDA build of
    vLLM's cumem allocator is there (this machine has neither), the rollout must refuse to build."""
    from verl_patches.offload import stable
    from verl_patches.rollout import graph_safe

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(stable, "_CACHE", {})
    monkeypatch.setattr(graph_safe.accelerator, "device_type", lambda: "cuda")
    with pytest.raises(graph_safe.GraphModeError) as e:
        graph_safe.arm_for_build(enforce_eager=False, offload=True)
    msg = str(e.value)
    assert "torch_memory_saver is not installed" in msg and "enforce_eager=True" in msg
    assert "pip install torch_memory_saver==0.0.10" in msg.replace("-", "_")
    assert graph_safe.armed() is None
    assert graph_safe.arm_for_build(enforce_eager=True, offload=True) is None  # the explicit eager override


class _ContiguousMLA:
    """An MLA impl deriving contiguous copies, as vLLM-Ascend's AscendMLAImpl does (stand-in for
    it: its module needs torch_npu); vLLM's own MLACommonImpl derives views instead."""

    def __init__(self, weight: torch.Tensor, views: bool = False) -> None:
        self.weight, self.views = weight, views
        self.recompute()

    def recompute(self) -> None:
        w = self.weight.view(4, 2, 6)  # kv_lora_rank 4, 2 heads, nope 3 + v 3
        uk, uv = w.split([3, 3], dim=-1)
        self.W_UV = uv.transpose(0, 1) if self.views else uv.transpose(0, 1).contiguous()
        self.W_UK_T = uk.permute(1, 2, 0) if self.views else uk.permute(1, 2, 0).contiguous()


@pytest.mark.parametrize("views", [False, True], ids=["contiguous", "views"])
def test_mla_derived_tensors_are_rewritten_in_place(views):
    from verl_patches.rollout.mla import DERIVED, rewrite_in_place

    weight = torch.randn(4, 12)
    impl = _ContiguousMLA(weight, views)
    kept = {n: getattr(impl, n) for n in DERIVED}
    at = {n: t.data_ptr() for n, t in kept.items()}
    weight.copy_(torch.randn(4, 12))  # the reshard writes the new weight in place
    copied = rewrite_in_place(impl, impl.recompute)
    want = _ContiguousMLA(weight.clone(), False)
    for n in DERIVED:
        got = getattr(impl, n)
        assert got is kept[n] and got.data_ptr() == at[n]
        assert torch.equal(got, getattr(want, n))
    assert copied == (0 if views else 2 * 4 * 2 * 3 * 4)


def test_mla_released_tensors_take_the_new_ones_and_bad_shapes_are_refused():
    from verl_patches.rollout.mla import MLADerivedError, rewrite_in_place

    impl = _ContiguousMLA(torch.randn(4, 12))
    impl.W_UV, impl.W_UK_T = impl.W_UV.new_empty(0), impl.W_UK_T.new_empty(0)  # eager mode's release
    rewrite_in_place(impl, impl.recompute)
    assert impl.W_UV.shape == (2, 4, 3)
    impl.weight = torch.randn(2, 24)
    with pytest.raises(MLADerivedError, match="cannot be rewritten in place"):
        rewrite_in_place(impl, lambda: setattr(impl, "W_UV", torch.zeros(3)))
