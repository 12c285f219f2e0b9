"""Address-stable device memory for graph mode: tagged regions whose physical memory is given back
and mapped again at the same virtual addresses, over the platforms' maintained allocators.

Backends (chosen by stable_memory() below; docs/GRAPH_MODE.md says why):
- CUDA: torch_memory_saver (its in-process "torch" hook mode: a pluggable allocator behind a
  torch MemPool per tag), else vLLM's own sleep-mode CuMemAllocator where a CUDA build of vLLM
  ships its cumem extension;
- Ascend: vLLM-Ascend's CaMemAllocator (ACL's virtual-memory calls, the same shape as CuMem);
- CPU: none.
vLLM's and vLLM-Ascend's allocators only offer sleep() and wake_up(tags). Their sleep() unmaps every
tag and copies some to host. Per-tag release here unmaps and re-maps just that tag's allocations,
through their modules' own unmap_and_release / create_and_map.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch

from verl_patches.base import accelerator
from verl_patches.base import env as overlay_env

ENV = "VERL_PATCHES_STABLE_MEMORY"
CHOICES = ("auto", "torch_memory_saver", "vllm_cumem", "vllm_ascend_camem", "none")
TMS_PIN = "torch_memory_saver==0.0.10"  # configs/upstream.lock.toml, component torch_memory_saver
logger = logging.getLogger(__name__)


class StableMemoryError(RuntimeError):
    """The address-stable memory cannot do what was asked (no backend, a tensor outside its region...)."""


class AddressMovedError(StableMemoryError):
    """After an allocate, a tensor a captured graph reads is no longer at its captured address."""


class StableBackend:
    """One process-wide allocator with tagged regions. Release / allocate are per tag and idempotent."""

    name = "abstract"

    def __init__(self) -> None:
        self._released: set[str] = set()
        self.last_freed: dict[str, int] = {}  # device bytes the last release gave back, per tag

    def region(self, tag: str) -> ContextManager[None]:
        """Allocations made inside the block land in ``tag``'s region."""
        raise NotImplementedError

    def ranges(self, tag: str) -> list[tuple[int, int]]:
        """(start address, bytes) of every mapping that belongs to ``tag`` (mapped or not)."""
        raise NotImplementedError

    def _unmap(self, tag: str) -> None:
        raise NotImplementedError

    def _map(self, tag: str) -> None:
        raise NotImplementedError

    def is_released(self, tag: str) -> bool:
        return tag in self._released

    def region_bytes(self, tag: str) -> int:
        return sum(n for _, n in self.ranges(tag))

    def release(self, tag: str) -> None:
        """Give ``tag``'s physical memory back; its virtual addresses stay reserved."""
        if tag in self._released:
            return
        # Unmapping memory that queued kernels still read is undefined behaviour on both runtimes.
        accelerator.synchronize()
        measure = accelerator.device_type() != "cpu"
        before = accelerator.mem_get_info()[0] if measure else 0
        self._unmap(tag)
        self._released.add(tag)
        if measure:
            # The device's own count, not ours: the evidence that the memory really came back
            # (the recipe turned vLLM's sleep mode off because on multi-node NPU it did not).
            first = tag not in self.last_freed
            self.last_freed[tag] = accelerator.mem_get_info()[0] - before
            if first:
                logger.info("address-stable region %r (%s): release gave back %d of its %d bytes", tag, self.name,
                            self.last_freed[tag], self.region_bytes(tag))

    def allocate(self, tag: str) -> None:
        """Map fresh physical memory at ``tag``'s addresses; the contents are undefined."""
        if tag not in self._released:
            return
        self._map(tag)
        self._released.discard(tag)


class TorchMemorySaverBackend(StableBackend):
    """torch_memory_saver in hook mode "torch" (no LD_PRELOAD): one MemPool per tag, pause / resume."""

    name = "torch_memory_saver"

    def __init__(self) -> None:
        super().__init__()
        # Lazy: each backend's allocator is optional (torch_memory_saver on CUDA, vLLM's cumem on CUDA, CaMem on
        # Ascend); tried when chosen.
        from torch_memory_saver import torch_memory_saver as tms

        if getattr(tms, "_impl", None) is None:
            tms.hook_mode = "torch"
        self._tms = tms
        self._pools: dict[str, set[tuple[int, int]]] = {}
        self._segments: dict[str, set[int]] = {}
        atexit.register(self.close_at_exit)

    def close_at_exit(self) -> None:
        """Leave the process cleanly. torch_memory_saver 0.0.10's MemPools are destroyed by CUDA's own
        static destructors, after the library stopped accepting frees: its free hook then prints
        'only support interesting region' and calls exit(1), so a passing run (a Ray worker, a script)
        ended with status 1. At interpreter exit, while the runtime is alive: map every released region
        back (a pool's teardown frees mapped memory), wait for the device, and drop the library's pools
        (what the library itself does at exit on ROCm and XPU). Measured on an H100: status 1 without
        this, 0 with it, whether the regions were mapped or released at exit (docs/benchmarks.md)."""
        impl = getattr(self._tms, "_impl", None)
        pools = getattr(impl, "_mem_pools", None)
        if pools is None:
            return
        for tag in list(self._released):
            self.allocate(tag)
        torch.cuda.synchronize()
        pools.clear()

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        before = {s["address"] for s in torch.cuda.memory_snapshot()}
        with self._tms.region(tag):
            yield
        # The library exposes no address list; its MemPool's segments are in the allocator's
        # public snapshot, named by the pool's id (and, failing that, by being new).
        pools, segments = self._pools.setdefault(tag, set()), self._segments.setdefault(tag, set())
        for s in torch.cuda.memory_snapshot():
            if s["address"] not in before:
                segments.add(int(s["address"]))
                pool = tuple(s.get("segment_pool_id") or (0, 0))
                if pool != (0, 0):
                    pools.add(pool)

    def ranges(self, tag: str) -> list[tuple[int, int]]:
        pools, segments = self._pools.get(tag, set()), self._segments.get(tag, set())
        return [(int(s["address"]), int(s["total_size"])) for s in torch.cuda.memory_snapshot()
                if tuple(s.get("segment_pool_id") or (0, 0)) in pools
                or (not pools and int(s["address"]) in segments)]

    def _unmap(self, tag: str) -> None:
        self._tms.pause(tag)

    def _map(self, tag: str) -> None:
        self._tms.resume(tag)


class VmmAllocatorBackend(StableBackend):
    """vLLM's CuMemAllocator or vLLM-Ascend's CaMemAllocator, one tag at a time.

    ``module`` is vllm.device_allocator.cumem or vllm_ascend.device_allocator.camem: their
    ``unmap_and_release`` / ``create_and_map`` take the handle the allocator records per mapping
    in ``pointer_to_data`` (handle[1] is its size); ``use_memory_pool(tag)`` is the region.
    """

    def __init__(self, name: str, module: Any, allocator: Any) -> None:
        super().__init__()
        self.name, self._mod, self._alloc = name, module, allocator

    def region(self, tag: str) -> ContextManager[None]:
        return self._alloc.use_memory_pool(tag=tag)

    def _handles(self, tag: str) -> list[tuple]:
        return [d.handle for d in list(self._alloc.pointer_to_data.values()) if d.tag == tag]

    def ranges(self, tag: str) -> list[tuple[int, int]]:
        return [(int(ptr), int(d.handle[1])) for ptr, d in list(self._alloc.pointer_to_data.items()) if d.tag == tag]

    def _apply(self, tag: str, do: Callable[[tuple], None], undo: Callable[[tuple], None]) -> None:
        done: list[tuple] = []
        try:
            for h in self._handles(tag):
                do(h)
                done.append(h)
        except BaseException:
            # All-or-nothing: a tag half mapped would pass the address check and read unmapped pages.
            for h in reversed(done):
                undo(h)
            raise

    def _unmap(self, tag: str) -> None:
        self._apply(tag, self._mod.unmap_and_release, self._mod.create_and_map)

    def _map(self, tag: str) -> None:
        self._apply(tag, self._mod.create_and_map, self._mod.unmap_and_release)


# -- selection ---------------------------------------------------------------------------------

_CACHE: dict[tuple[str, str], tuple[StableBackend | None, str]] = {}


def _tms() -> tuple[StableBackend | None, str]:
    try:
        import torch_memory_saver  # noqa: F401
    except ImportError as e:
        return None, f"torch_memory_saver is not installed ({e})"
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
        return None, f"torch {torch.__version__} has no torch.cuda.MemPool / use_mem_pool for its torch hook mode"
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return None, "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which memory pools do not support"
    return TorchMemorySaverBackend(), "torch_memory_saver (hook mode torch): pause / resume per tag"


def _cumem() -> tuple[StableBackend | None, str]:
    try:
        # Lazy: each backend's allocator is optional (torch_memory_saver on CUDA, vLLM's cumem on CUDA, CaMem on
        # Ascend); tried when chosen.
        from vllm.device_allocator import cumem
    except ImportError as e:
        return None, f"vllm.device_allocator.cumem does not import ({e})"
    if not cumem.cumem_available:
        return None, "this vLLM build has no cumem_allocator extension (a CUDA build of vLLM ships it)"
    return (VmmAllocatorBackend("vllm_cumem", cumem, cumem.CuMemAllocator.get_instance()),
            "vLLM's CuMemAllocator: unmap / map per tag")


def _camem() -> tuple[StableBackend | None, str]:
    try:
        # Lazy: each backend's allocator is optional (torch_memory_saver on CUDA, vLLM's cumem on CUDA, CaMem on
        # Ascend); tried when chosen.
        from vllm_ascend.device_allocator import camem
    except ImportError as e:
        return None, f"vllm_ascend.device_allocator.camem does not import ({e})"
    if not camem.camem_available:
        return None, "vLLM-Ascend was built without its vllm_ascend_C extension (CaMemAllocator unavailable)"
    return (VmmAllocatorBackend("vllm_ascend_camem", camem, camem.CaMemAllocator.get_instance()),
            "vLLM-Ascend's CaMemAllocator (ACL virtual memory): unmap / map per tag")


def stable_memory() -> tuple[StableBackend | None, str]:
    """The address-stable allocator graph mode needs on this process's accelerator, or None, and a
    sentence saying which one or why none: torch_memory_saver or vLLM's CuMemAllocator on CUDA,
    vLLM-Ascend's CaMemAllocator on NPU, none on CPU. One per process."""
    return select(accelerator.device_type())


def select(device_type: str) -> tuple[StableBackend | None, str]:
    """The process's backend for ``device_type`` and a sentence saying which one, or why none.
    ``VERL_PATCHES_STABLE_MEMORY`` (one of CHOICES) forces a choice; "none" turns it off."""
    # The typed table's reader: a value not in the table's choices is an EnvError naming the variable.
    choice = overlay_env.get(ENV)
    key = (device_type, choice)
    if key not in _CACHE:
        _CACHE[key] = _select(device_type, choice)
    return _CACHE[key]


def _select(device_type: str, choice: str) -> tuple[StableBackend | None, str]:
    if choice == "none":
        return None, f"{ENV}=none"
    makers = {"cuda": {"torch_memory_saver": _tms, "vllm_cumem": _cumem},
              "npu": {"vllm_ascend_camem": _camem}}.get(device_type, {})
    if not makers:
        return None, f"no address-stable allocator on {device_type!r}"
    if choice != "auto":
        if choice not in makers:
            return None, f"{ENV}={choice} is not a backend for {device_type!r} (those are {sorted(makers)})"
        return makers[choice]()
    reasons = []
    for make in makers.values():
        backend, why = make()
        if backend is not None:
            return backend, why
        reasons.append(why)
    return None, "; ".join(reasons)


def install_hint(device_type: str) -> str:
    if device_type == "cuda":
        return f"pip install {TMS_PIN} (or use a CUDA build of vLLM, whose cumem allocator serves too)"
    if device_type == "npu":
        return "a vLLM-Ascend build with its vllm_ascend_C extension (CaMemAllocator)"
    return "an accelerator (graph mode needs one)"


# -- address checks ----------------------------------------------------------------------------

def storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return int(st.data_ptr()), int(st.nbytes())


def inside(span: tuple[int, int], ranges: Iterable[tuple[int, int]]) -> bool:
    start, n = span
    return any(lo <= start and start + n <= lo + size for lo, size in ranges)


def overlaps(span: tuple[int, int], ranges: Iterable[tuple[int, int]]) -> bool:
    start, n = span
    return any(start < lo + size and lo < start + max(n, 1) for lo, size in ranges)


def live_tensors_in(ranges: list[tuple[int, int]], *, exclude: set[int]) -> list[torch.Tensor]:
    """Every tensor the garbage collector can see whose storage lies in ``ranges`` and is not one of
    the ``exclude`` storages (storage_key). Tensors held only by C++ are out of its sight."""
    if not ranges:
        return []
    gc.collect()
    dev = accelerator.device_type()
    out = []
    for obj in gc.get_objects():
        # type(), not isinstance: some module proxies warn when their __class__ is read.
        if not issubclass(type(obj), torch.Tensor) or obj.device.type != dev:
            continue
        try:
            span, key = storage_span(obj), storage_key(obj)
        except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers: no plain storage
            continue
        if span[1] and key not in exclude and overlaps(span, ranges):
            out.append(obj)
    return out


def describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} at {t.data_ptr():#x}"


class Region:
    """One tag of a backend: what an offload group holds to release and re-map its memory."""

    def __init__(self, backend: StableBackend, tag: str) -> None:
        self.backend, self.tag = backend, tag

    def __repr__(self) -> str:
        return f"Region({self.backend.name}, {self.tag!r})"

    @property
    def released(self) -> bool:
        return self.backend.is_released(self.tag)

    def ranges(self) -> list[tuple[int, int]]:
        return self.backend.ranges(self.tag)

    def region(self) -> ContextManager[None]:
        return self.backend.region(self.tag)

    def release(self) -> None:
        self.backend.release(self.tag)

    def allocate(self) -> None:
        self.backend.allocate(self.tag)
