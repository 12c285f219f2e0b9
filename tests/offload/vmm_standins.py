"""Stand-ins for what vLLM-Ascend's real camem.py needs from Ascend, which this machine lacks: the
vllm_ascend_C extension (ACL virtual memory: create_and_map / unmap_and_release, the pluggable
allocator's malloc callback), acl.rt (memcpy) and torch.npu's pluggable allocator and MemPool.

The stand-in keeps a map of which allocation is mapped, refuses to map a mapped one or unmap an
unmapped one (as ACL errors would), can fail on the n-th map, and reports an allocation made while
a pool is active to the malloc callback camem.py registered, with the handle layout the C
extension uses: (device, aligned size, device address, physical handle). Torch's CPU allocations
cannot be routed through a pluggable allocator, so code that allocates "inside a region" calls
``allocated(tensor)`` for each tensor it creates there.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from typing import Any

import torch

MODULE = "vllm_ascend.device_allocator.camem"


class Vmm:
    def __init__(self) -> None:
        self.mapped: dict[int, bool] = {}
        self.calls: list[tuple[str, int]] = []
        self.malloc_cb = self.free_cb = None
        self.active_pool: Any = None
        self.fail_map_at: int | None = None  # raise on this many-th map call (1-based)
        self._maps = 0
        self._handle = 1000

    # -- vllm_ascend.vllm_ascend_C -----------------------------------------------------
    def init_module(self, malloc_cb, free_cb) -> None:
        self.malloc_cb, self.free_cb = malloc_cb, free_cb

    def python_create_and_map(self, device: int, size: int, d_mem: int, handle: int) -> None:
        self._maps += 1
        if self.fail_map_at is not None and self._maps == self.fail_map_at:
            raise RuntimeError("stand-in ACL: aclrtMallocPhysical failed (out of memory)")
        if self.mapped.get(d_mem):
            raise RuntimeError(f"stand-in ACL: {d_mem:#x} is already mapped")
        self.mapped[d_mem] = True
        self.calls.append(("map", d_mem))

    def python_unmap_and_release(self, device: int, size: int, d_mem: int, handle: int) -> None:
        if not self.mapped.get(d_mem):
            raise RuntimeError(f"stand-in ACL: {d_mem:#x} is not mapped")
        self.mapped[d_mem] = False
        self.calls.append(("unmap", d_mem))

    # -- torch.npu.memory ------------------------------------------------------------
    def memory_module(self) -> types.SimpleNamespace:
        vmm = self

        class NPUPluggableAllocator:
            def __init__(self, path, malloc, free):
                self._allocator = ("pluggable", path, malloc, free)

        class MemPool:
            def __init__(self, allocator):
                self.allocator = allocator

        @contextlib.contextmanager
        def use_mem_pool(pool):
            vmm.active_pool = pool
            try:
                yield
            finally:
                vmm.active_pool = None

        return types.SimpleNamespace(NPUPluggableAllocator=NPUPluggableAllocator, MemPool=MemPool,
                                     use_mem_pool=use_mem_pool)

    # -- what the C extension's my_malloc does for each allocation in a pool --------------
    def allocated(self, t: torch.Tensor) -> torch.Tensor:
        if self.active_pool is not None:
            st = t.untyped_storage()
            self._handle += 1
            self.malloc_cb((0, int(st.nbytes()), int(st.data_ptr()), self._handle))
            self.mapped[int(st.data_ptr())] = True
        return t


def install(monkeypatch) -> tuple[Vmm, Any]:
    """Put the stand-ins in place and import the real camem.py fresh; returns (vmm, camem)."""
    vmm = Vmm()
    ext = types.ModuleType("vllm_ascend.vllm_ascend_C")
    ext.init_module = vmm.init_module
    ext.python_create_and_map = vmm.python_create_and_map
    ext.python_unmap_and_release = vmm.python_unmap_and_release
    acl, rt = types.ModuleType("acl"), types.ModuleType("acl.rt")
    rt.memcpy = lambda *a: vmm.calls.append(("memcpy", a[2]))
    acl.rt = rt
    for name, mod in (("vllm_ascend.vllm_ascend_C", ext), ("acl", acl), ("acl.rt", rt)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(memory=vmm.memory_module()), raising=False)
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    camem = importlib.import_module(MODULE)
    monkeypatch.setitem(sys.modules, MODULE, camem)  # dropped again when the test ends
    assert camem.camem_available and camem.CaMemAllocator.instance is None
    return vmm, camem
