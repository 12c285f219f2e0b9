"""Host buffer pool and copy engine: power-of-two pinned segments, reuse across steps,
the host-memory check before anything is allocated, and copy chunk splitting."""

import pytest
import torch

from verl_patches.base import accelerator
from verl_patches.offload import CopyEngine, HostBufferPool, HostMemoryError, segment_sizes
from verl_patches.offload.pool import MiB


@pytest.mark.parametrize("n", [1, 511, 2 * MiB, 2 * MiB + 1, 5 * MiB + 12345, 3 * 1024 * MiB + 7])
def test_pinned_segments_are_powers_of_two_with_bounded_waste(n):
    sizes = segment_sizes(n, pinned=True, max_segment=1024 * MiB, min_segment=2 * MiB)
    assert all(s & (s - 1) == 0 for s in sizes), sizes
    assert sum(sizes) >= n
    assert sum(sizes) - n < 2 * MiB  # the caching host allocator would round 5 GiB up to 8 GiB


def test_pageable_segments_are_exact():
    assert sum(segment_sizes(10_000_000, pinned=False, max_segment=4 * MiB)) == 10_000_000


def test_pieces_span_segment_boundaries():
    pool = HostBufferPool(pin=False, max_segment=4096, reserve_bytes=0)
    buf = pool.acquire("g", 10_000)
    assert [int(s.numel()) for s in buf.segments] == [4096, 4096, 10_000 - 8192]
    data = torch.arange(3000, dtype=torch.int64).to(torch.uint8)
    pieces = list(buf.pieces(3000, 3000))
    assert len(pieces) == 2  # 3000..4096 and 4096..6000
    for rel, view in pieces:
        view.copy_(data[rel:rel + view.numel()])
    back = torch.cat([v for _, v in buf.pieces(3000, 3000)])
    assert torch.equal(back, data)
    with pytest.raises(IndexError):
        list(buf.pieces(9000, 2000))


def test_acquire_reuses_and_refuses_a_size_change():
    pool = HostBufferPool(pin=False, reserve_bytes=0)
    a = pool.acquire("g", 1000)
    n = pool.allocations
    assert pool.acquire("g", 1000) is a and pool.allocations == n
    with pytest.raises(ValueError, match="holds 1000 bytes"):
        pool.acquire("g", 2000)
    pool.release("g")
    assert pool.reserved_bytes == 0


def test_host_memory_check_names_needed_and_available_and_allocates_nothing():
    pool = HostBufferPool(pin=False, reserve_bytes=MiB, host_mem_info=lambda: (3 * MiB, 8 * MiB))
    pool.check({"small": MiB})  # 1 MiB fits in 3 - 1
    with pytest.raises(HostMemoryError) as err:
        pool.acquire("big", 5 * MiB)
    msg = str(err.value)
    assert "need 0.005 GiB" in msg and "available 0.003 GiB" in msg and "nothing was moved" in msg
    assert err.value.needed == 5 * MiB and err.value.available == 3 * MiB
    assert pool.allocations == 0 and pool.reserved_bytes == 0


def test_chunks_group_consecutive_items():
    eng = CopyEngine(chunk_bytes=100)
    assert eng.split([40, 40, 40, 300, 10, 10]) == [[0, 1], [2], [3], [4, 5]]
    assert eng.split([]) == []


@pytest.mark.skipif(accelerator.device_type() == "cpu", reason="pinned memory needs a device runtime")
def test_pool_pins_on_a_device():
    pool = HostBufferPool(reserve_bytes=0)
    buf = pool.acquire("g", 3 * MiB)
    assert pool.pin and all(s.is_pinned() for s in buf.segments)
    pool.close()


def test_host_memory_respects_a_container_limit(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text(f"{1 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{600 * MiB}\n")
    (tmp_path / "memory.stat").write_text(f"anon 1\ninactive_file {100 * MiB}\n")
    monkeypatch.setattr(accelerator, "CGROUP_MEMORY_FILES",
                        ((str(tmp_path), "memory.max", "memory.current", "memory.stat"),))
    monkeypatch.setattr(accelerator, "_machine_mem_info", lambda: (64 << 30, 128 << 30))
    assert accelerator.host_mem_info() == (524 * MiB, 1 << 30)
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the machine's numbers
    assert accelerator.host_mem_info() == (64 << 30, 128 << 30)
    (tmp_path / "memory.max").write_text(f"{1 << 30}\n")
    with pytest.raises(HostMemoryError, match="need 1.000 GiB"):
        HostBufferPool(pin=False, reserve_bytes=0).acquire("g", 1 << 30)
