"""Pinned host buffer pool and the chunked device<->host copy engine of the offload path.

Host buffers are allocated once per group and reused every step; copies run on a side
stream in copy chunks; on CPU the same code degrades to plain, synchronous copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from verl_patches.base import accelerator
from verl_patches.base import env as overlay_env

GiB = 1 << 30
MiB = 1 << 20

# A fault hook gets (point, copy chunk index, item index) before every copy and allocation;
# tests raise from it to check that a failure half-way through a group rolls back.
FaultHook = Callable[[str, int, int], None]


class HostMemoryError(MemoryError):
    """Not enough host memory for the pinned buffers an offload needs; nothing was moved."""

    def __init__(self, needed: int, available: int, reserve: int, detail: str) -> None:
        self.needed, self.available, self.reserve = needed, available, reserve
        super().__init__(
            f"host memory insufficient for offload: need {needed / GiB:.3f} GiB of "
            f"{'pinned' if accelerator.pin_memory_supported() else 'host'} buffers ({detail}), "
            f"available {available / GiB:.3f} GiB (MemAvailable, or the memory cgroup's headroom) minus a reserve of "
            f"{reserve / GiB:.3f} GiB kept for the rest of the process; nothing was moved. "
            "Offload fewer groups, lower the reserve (VERL_PATCHES_OFFLOAD_HOST_RESERVE_GB), "
            "or free host memory.")


def _power_of_two_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def segment_sizes(nbytes: int, *, pinned: bool, max_segment: int = GiB, min_segment: int = 2 * MiB) -> list[int]:
    """How a host buffer of ``nbytes`` is split into separately allocated segments.

    Torch's caching pinned-memory allocator rounds every request up to a power of two, so
    one 5 GiB pinned tensor would lock 8 GiB. Pinned buffers are therefore made of
    power-of-two segments (binary decomposition, the tail rounded up to ``min_segment``):
    at most ``min_segment`` bytes are wasted. Pageable buffers need no rounding.
    """
    if nbytes <= 0:
        return []
    sizes: list[int] = []
    rest = nbytes
    while rest >= max_segment:
        sizes.append(max_segment)
        rest -= max_segment
    if not pinned:
        return sizes + ([rest] if rest else [])
    while rest > 0:
        piece = _power_of_two_floor(rest)
        if piece < min_segment:
            sizes.append(min_segment)
            break
        sizes.append(piece)
        rest -= piece
    return sizes


@dataclass
class HostBuffer:
    """One group's host copy: segments of uint8 host memory, addressed as one linear range."""

    key: str
    nbytes: int
    pinned: bool
    segments: list[torch.Tensor] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return sum(int(s.numel()) for s in self.segments)

    def pieces(self, offset: int, length: int) -> Iterable[tuple[int, torch.Tensor]]:
        """(offset within the requested range, host view) for each segment the range touches."""
        if offset < 0 or offset + length > self.nbytes:
            raise IndexError(f"host buffer {self.key!r}: range [{offset}, {offset + length}) "
                             f"outside its {self.nbytes} bytes")
        done = 0
        for start, seg in zip(self.starts, self.segments):
            end = start + int(seg.numel())
            lo = max(offset + done, start)
            if lo >= end or done >= length:
                continue
            hi = min(offset + length, end)
            yield lo - offset, seg[lo - start:hi - start]
            done = hi - offset


def _default_reserve() -> int:
    # Leave headroom for the rest of the process (Ray, dataloaders, the next step's batch).
    # The typed table's reader: a value that is not a finite number >= 0 is an EnvError naming the variable.
    gb = overlay_env.get("VERL_PATCHES_OFFLOAD_HOST_RESERVE_GB")
    if gb is not None:
        return int(gb * GiB)
    _, total = accelerator.host_mem_info()
    return min(4 * GiB, total // 20)


class HostBufferPool:
    """Host buffers keyed by group, allocated once (pinned where the device allows) and reused.

    ``allocations`` counts segments ever allocated, so a test can show that steady-state
    steps pin nothing new. ``check`` compares the bytes a set of new buffers would take with
    the host's available memory and raises HostMemoryError before anything is allocated.
    """

    def __init__(self, *, pin: bool | None = None, max_segment: int = GiB, min_segment: int = 2 * MiB,
                 reserve_bytes: int | None = None,
                 host_mem_info: Callable[[], tuple[int, int]] | None = None) -> None:
        self.pin = accelerator.pin_memory_supported() if pin is None else bool(pin)
        self.max_segment, self.min_segment = max_segment, min_segment
        self._host_mem_info = host_mem_info or accelerator.host_mem_info
        self.reserve_bytes = _default_reserve() if reserve_bytes is None else int(reserve_bytes)
        self.buffers: dict[str, HostBuffer] = {}
        self.allocations = 0

    def footprint(self, nbytes: int) -> int:
        """Host bytes a buffer of ``nbytes`` really takes (segment rounding included)."""
        return sum(segment_sizes(nbytes, pinned=self.pin, max_segment=self.max_segment,
                                 min_segment=self.min_segment))

    @property
    def reserved_bytes(self) -> int:
        return sum(b.capacity for b in self.buffers.values())

    def check(self, requests: Mapping[str, int]) -> None:
        """Raise HostMemoryError if the buffers not yet held for ``requests`` do not fit."""
        new = {k: n for k, n in requests.items() if n > 0 and k not in self.buffers}
        needed = sum(self.footprint(n) for n in new.values())
        if not needed:
            return
        available, _ = self._host_mem_info()
        if needed > available - self.reserve_bytes:
            detail = ", ".join(f"{k}: {self.footprint(n) / GiB:.3f} GiB" for k, n in new.items())
            raise HostMemoryError(needed, available, self.reserve_bytes, detail)

    def acquire(self, key: str, nbytes: int) -> HostBuffer:
        """The buffer for ``key``: the one allocated before, or a new one after ``check``."""
        buf = self.buffers.get(key)
        if buf is not None:
            if buf.nbytes != nbytes:
                raise ValueError(f"host buffer {key!r} holds {buf.nbytes} bytes, asked for {nbytes}: "
                                 "a group's size must not change while it is offloadable")
            return buf
        self.check({key: nbytes})
        buf = HostBuffer(key, nbytes, self.pin)
        start = 0
        try:
            for size in segment_sizes(nbytes, pinned=self.pin, max_segment=self.max_segment,
                                      min_segment=self.min_segment):
                seg = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
                self.allocations += 1
                buf.segments.append(seg)
                buf.starts.append(start)
                start += size
        except BaseException:
            buf.segments.clear()
            if self.pin:
                accelerator.host_empty_cache()
            raise
        self.buffers[key] = buf
        return buf

    def get(self, key: str) -> HostBuffer | None:
        return self.buffers.get(key)

    def release(self, key: str) -> None:
        buf = self.buffers.pop(key, None)
        if buf is not None:
            buf.segments.clear()
            if self.pin:
                accelerator.host_empty_cache()

    def close(self) -> None:
        for key in list(self.buffers):
            self.release(key)


CopyJob = tuple[torch.Tensor, torch.Tensor]  # (destination, source), both flat uint8


class CopyEngine:
    """Bucketed copies between device and host on one side stream.

    A copy chunk is a run of copies of at most ``chunk_bytes`` (a larger single copy is its own
    copy chunk); for device<-host the copy chunk's device memory is allocated just before its
    copies are queued, so allocation overlaps the previous copy chunk's transfer. Every call
    returns only when its copies are complete, and drains the side stream before an error
    propagates, so callers may free or roll back memory safely.
    """

    def __init__(self, chunk_bytes: int = 256 * MiB) -> None:
        self.chunk_bytes = int(chunk_bytes)
        self.fault_hook: FaultHook | None = None
        self._stream = None
        self._stream_made = False

    @property
    def stream(self):
        if not self._stream_made:
            self._stream = accelerator.new_stream()
            self._stream_made = True
        return self._stream

    def fault(self, point: str, chunk: int, item: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point, chunk, item)

    def split(self, sizes: Sequence[int]) -> list[list[int]]:
        """Indices of ``sizes`` grouped into consecutive copy chunks of about chunk_bytes."""
        chunks: list[list[int]] = []
        cur: list[int] = []
        acc = 0
        for i, n in enumerate(sizes):
            if cur and acc + n > self.chunk_bytes:
                chunks.append(cur)
                cur, acc = [], 0
            cur.append(i)
            acc += n
        if cur:
            chunks.append(cur)
        return chunks

    def _run(self, point: str, chunks: Sequence[Callable[[], Sequence[CopyJob]]]) -> int:
        side = self.stream
        moved = 0
        if side is None:  # CPU: plain copies, in order
            for b, make_jobs in enumerate(chunks):
                for j, (dst, src) in enumerate(make_jobs()):
                    self.fault(point, b, j)
                    dst.copy_(src)
                    moved += int(dst.numel())
            return moved
        current = accelerator.current_stream()
        # The side stream must not read parameters before the compute stream finished
        # writing them, nor write into blocks the compute stream just freed and re-issued.
        side.wait_stream(current)
        try:
            for b, make_jobs in enumerate(chunks):
                # make_jobs allocates on the compute stream; a block the caching allocator
                # hands back may have been freed there with work still queued on it, so the
                # side stream waits again (an event, no host stall) before writing into it.
                jobs = make_jobs()
                side.wait_stream(current)
                with accelerator.stream(side):
                    for j, (dst, src) in enumerate(jobs):
                        self.fault(point, b, j)
                        dst.copy_(src, non_blocking=True)
                        moved += int(dst.numel())
        finally:
            # Copies in flight must finish before anyone frees or reuses their memory,
            # whether we succeed or roll back.
            side.synchronize()
        current.wait_stream(side)
        return moved

    def device_to_host(self, chunks: Sequence[Callable[[], Sequence[CopyJob]]]) -> int:
        """Run the (host dst, device src) copies of each copy chunk; returns bytes copied."""
        return self._run("d2h", chunks)

    def host_to_device(self, chunks: Sequence[Callable[[], Sequence[CopyJob]]]) -> int:
        """Allocate (inside each copy chunk callable) and copy host->device; returns bytes copied."""
        return self._run("h2d", chunks)


class OffloadEngine:
    """What the groups share: the host buffer pool, the copy engine, and a storage registry.

    The registry maps every device storage to the one group that owns it, so a tensor can
    never be given two host copies (tied weights and views are deduplicated by storage).
    """

    def __init__(self, *, pool: HostBufferPool | None = None, chunk_bytes: int = 256 * MiB,
                 copier: CopyEngine | None = None) -> None:
        self.pool = pool or HostBufferPool()
        self.copier = copier or CopyEngine(chunk_bytes)
        self._owners: dict[int, str] = {}
        self._names: set[str] = set()

    @property
    def fault_hook(self) -> FaultHook | None:
        return self.copier.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: FaultHook | None) -> None:
        self.copier.fault_hook = hook

    def claim(self, group: str, storage_keys: Iterable[int]) -> None:
        """Register a new group's storages; a name is a host buffer key, so it must be unique."""
        if group in self._names:
            raise ValueError(f"offload group name {group!r} is already used in this engine; "
                             "names key the host buffers and must be unique")
        keys = list(storage_keys)
        for k in keys:
            owner = self._owners.get(k)
            if owner is not None and owner != group:
                raise ValueError(f"offload group {group!r}: a tensor's storage already belongs to group "
                                 f"{owner!r}; one storage may be offloaded by one group only "
                                 "(otherwise the host would hold two copies of it)")
        for k in keys:
            self._owners[k] = group
        self._names.add(group)

    def owner(self, storage_key: int) -> str | None:
        """The group that claimed this storage, if any."""
        return self._owners.get(storage_key)

    def unclaim(self, group: str) -> None:
        self._names.discard(group)
        for k in [k for k, g in self._owners.items() if g == group]:
            del self._owners[k]

    def close(self) -> None:
        self.pool.close()
        self._owners.clear()
        self._names.clear()
