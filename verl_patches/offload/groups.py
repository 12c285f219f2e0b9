"""Offloadable groups: training params, grads, optimizer state, reference params, rollout
weights and KV cache behind one interface (offload, onload, release, allocate).
"""

# A group frees device memory for real in one of two ways (its memory strategy):
# - resize (default): each distinct storage is resized to zero bytes and back. Parameter objects,
#   ``.data`` and every view keep their identity (optimizers, Megatron's DDP buffers and vLLM
#   hold references to them); works the same on torch 2.5.1 and 2.11 and on torch_npu (verl's own
#   Megatron offload relies on it). The caching allocator picks new addresses each time.
# - stable region (verl_patches.offload.stable): the storages live in a tagged region of an
#   address-stable allocator; release unmaps the region's physical memory, allocate maps new
#   memory at the same addresses, so graphs captured over the tensors stay valid. After every
#   allocate the tensors a graph reads are checked against their captured addresses.

from __future__ import annotations

import enum
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from verl_patches.base import accelerator
from verl_patches.offload.pool import CopyJob, OffloadEngine
from verl_patches.offload.stable import AddressMovedError, Region, StableMemoryError, inside, storage_span

_ALIGN = 512  # host offsets aligned for DMA; the waste is under 512 bytes per storage


class Location(str, enum.Enum):
    DEVICE = "device"      # resident on device (the host copy, if any, may be stale)
    HOST = "host"          # device storage freed, host copy valid
    RELEASED = "released"  # device storage freed, no valid copy anywhere (rebuilt by its owner)


class GroupStateError(RuntimeError):
    """An action that the group's current location does not allow (e.g. onload with no host copy)."""


class OffloadGroup:
    """The common interface. Every action is all-or-nothing and idempotent.

    - ``offload()``: copy to host, then free device memory (DEVICE -> HOST).
    - ``onload()``: allocate device memory and copy back (HOST -> DEVICE).
    - ``release()``: free device memory without a copy (DEVICE -> RELEASED, or HOST for a
      read-only group whose host copy is still exact).
    - ``allocate(zero)``: allocate device memory without a copy (-> DEVICE); the contents
      are undefined (or zero) until the owner fills them (the reshard, the next backward).
    A failure inside an action leaves the group where it was, data intact.
    Each returns the bytes it moved over the host link.
    """

    name: str
    location: Location

    @property
    def nbytes(self) -> int:  # device bytes when resident
        raise NotImplementedError

    @property
    def host_nbytes(self) -> int:  # host bytes a copy needs (0: the group never copies)
        return self.nbytes

    def device_bytes(self) -> int:
        """Bytes resident on device now, read from the storages themselves."""
        raise NotImplementedError

    def reserve_host(self) -> None:
        """Make sure the host buffer exists (the schedule reserves all before moving anything)."""

    def offload(self, force_copy: bool = False) -> int:
        raise NotImplementedError

    def onload(self) -> int:
        raise NotImplementedError

    def release(self) -> int:
        raise NotImplementedError

    def allocate(self, zero: bool | None = None) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Give back the host buffer; the group must not be used afterwards."""


def _storage_key(t: torch.Tensor) -> int:
    # The StorageImpl pointer: stable for the storage's life (the group keeps the tensor
    # alive, so the pointer cannot be recycled while the group exists).
    return int(t.untyped_storage()._cdata)


def _u8(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A flat uint8 view of a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


Watch = Callable[[], Mapping[str, torch.Tensor]]


class _Resize:
    """Today's strategy: storages resized to zero bytes and back through the caching allocator."""

    name = "resize"
    checked = 0  # no captured addresses to check

    def bind(self, group: "TensorGroup") -> None:
        for t in group._anchors:
            if not t.untyped_storage().resizable():
                raise ValueError(f"offload group {group.name!r}: a tensor of shape {tuple(t.shape)} has a "
                                 "non-resizable storage (from_blob / DLPack / numpy); it cannot be freed in place")

    def free(self, group: "TensorGroup") -> None:
        for t in group._anchors:
            t.untyped_storage().resize_(0)

    def alloc(self, group: "TensorGroup", indices: Sequence[int], chunk: int) -> None:
        for j, i in enumerate(indices):
            st = group._anchors[i].untyped_storage()
            if st.nbytes() == 0:
                group.engine.copier.fault("alloc", chunk, j)
                st.resize_(group._sizes[i])

    def resident(self, group: "TensorGroup") -> int:
        return sum(int(t.untyped_storage().nbytes()) for t in group._anchors)

    def verify(self, group: "TensorGroup") -> None:
        return None


class _Stable:
    """Address-stable strategy: the whole region is released and mapped again at once.

    The region must hold nothing but this group's storages that anyone reads afterwards (its
    contents are lost on release). ``watch`` names every tensor a captured graph reads (views
    and derived tensors included); after each allocate each must be where it was at build.
    """

    def __init__(self, region: Region, watch: Watch | None) -> None:
        self.region, self.watch = region, watch
        self.name = f"stable:{region.backend.name}:{region.tag}"
        self._addresses: list[int] = []
        self._watched: dict[str, int] = {}
        self.checked = 0  # addresses compared so far (the run reports them per step)

    def bind(self, group: "TensorGroup") -> None:
        ranges = self.region.ranges()
        outside = [t for t in group._anchors if not inside(storage_span(t), ranges)]
        if outside:
            raise StableMemoryError(
                f"offload group {group.name!r}: {len(outside)} of {len(group._anchors)} storages are not in the "
                f"address-stable region {self.region}; the first has shape {tuple(outside[0].shape)}. They must be "
                "allocated inside the region (before any graph is captured), or releasing it frees nothing of them")
        self._addresses = [int(t.untyped_storage().data_ptr()) for t in group._anchors]
        self._watched = self._snapshot()

    def _snapshot(self) -> dict[str, int]:
        return {} if self.watch is None else {n: int(t.data_ptr()) for n, t in self.watch().items()}

    def free(self, group: "TensorGroup") -> None:
        self.region.release()

    def alloc(self, group: "TensorGroup", indices: Sequence[int], chunk: int) -> None:
        for j, _ in enumerate(indices):
            group.engine.copier.fault("alloc", chunk, j)
        self.region.allocate()

    def resident(self, group: "TensorGroup") -> int:
        return 0 if self.region.released else sum(group._sizes)

    def verify(self, group: "TensorGroup") -> None:
        moved = [f"storage {i} of shape {tuple(t.shape)}" for i, (t, at) in enumerate(zip(group._anchors, self._addresses))
                 if int(t.untyped_storage().data_ptr()) != at]
        now = self._snapshot()
        moved += [f"{n} (gone)" for n in self._watched if n not in now]
        moved += [f"{n} (new)" for n in now if n not in self._watched]
        moved += [f"{n} ({self._watched[n]:#x} -> {now[n]:#x})" for n in now
                  if n in self._watched and now[n] != self._watched[n]]
        self.checked += len(self._addresses) + len(now)
        if moved:
            raise AddressMovedError(
                f"offload group {group.name!r}: {len(moved)} tensor(s) that captured graphs read are no longer at "
                f"their captured addresses after allocate: {', '.join(moved[:6])}{' ...' if len(moved) > 6 else ''}. "
                "Something replaced them instead of writing in place (copy_); replays would read stale memory")


class TensorGroup(OffloadGroup):
    """A set of tensors (parameters, grads, optimizer states, cache blocks) offloaded as one.

    Tensors are deduplicated by storage (views, tied weights), and each distinct storage is
    copied whole into one fixed range of the group's host buffer, allocated once.
    ``read_only``: the device copy is never written between onload and offload (the
    reference model), so an offload after the first is a release; nothing moves twice.
    ``zero_on_allocate``: what ``allocate()`` fills with (grads restart from zero).
    ``region``: keep the storages in this address-stable region (see the module comment) instead
    of resizing them; ``watch`` then returns, by name, every tensor a captured graph reads, checked
    after each allocate (AddressMovedError; the group is released again).
    """

    def __init__(self, engine: OffloadEngine, name: str, tensors: Iterable[torch.Tensor], *,
                 read_only: bool = False, zero_on_allocate: bool = False, region: Region | None = None,
                 watch: Watch | None = None) -> None:
        self.engine, self.name = engine, name
        self.read_only, self.zero_on_allocate = read_only, zero_on_allocate
        anchors: dict[int, torch.Tensor] = {}
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"offload group {name!r}: expected tensors, got {type(t).__name__}")
            if t.untyped_storage().nbytes() == 0:
                continue
            anchors.setdefault(_storage_key(t), t)
        if not anchors:
            raise ValueError(f"offload group {name!r}: no tensor with allocated storage")
        devices = {str(t.device) for t in anchors.values()}
        if len(devices) != 1:
            raise ValueError(f"offload group {name!r}: tensors on several devices {sorted(devices)}; "
                             "make one group per device")
        self.device = next(iter(anchors.values())).device
        if self.device.type != accelerator.tensor_device_type():
            raise ValueError(f"offload group {name!r}: tensors on {self.device}, but the accelerator "
                             f"({accelerator.device_type()!r}) holds its tensors on "
                             f"{accelerator.tensor_device_type()!r}; only device tensors can be offloaded")
        if watch is not None and region is None:
            raise ValueError(f"offload group {name!r}: watch needs a region (resized storages move anyway)")
        self._anchors = list(anchors.values())
        self._keys = list(anchors)
        self._sizes = [int(t.untyped_storage().nbytes()) for t in self._anchors]
        self._offsets: list[int] = []
        off = 0
        for n in self._sizes:
            self._offsets.append(off)
            off += -(-n // _ALIGN) * _ALIGN
        self._host_nbytes = off
        self.memory = _Resize() if region is None else _Stable(region, watch)
        self.memory.bind(self)
        try:
            engine.claim(name, anchors.keys())
        except ValueError as e:
            owned = [t for k, t in anchors.items() if engine.owner(k) not in (None, name)]
            what = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in owned[:3])
            raise ValueError(f"{e} [the shared tensor(s): {what}]") from None
        self.location = Location.DEVICE
        self._host_valid = False

    # -- accounting ------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(self._sizes)

    @property
    def host_nbytes(self) -> int:
        return self._host_nbytes

    @property
    def num_storages(self) -> int:
        return len(self._anchors)

    def device_bytes(self) -> int:
        return self.memory.resident(self)

    @property
    def region(self) -> Region | None:
        return getattr(self.memory, "region", None)

    def check_addresses(self) -> None:
        """Raise AddressMovedError if a watched tensor left its captured address (stable groups only)."""
        self.memory.verify(self)

    @property
    def addresses_checked(self) -> int:
        """Captured addresses compared so far (0 outside an address-stable region)."""
        return self.memory.checked

    def tensors(self) -> list[torch.Tensor]:
        """One tensor per distinct storage (what checksums should cover)."""
        return list(self._anchors)

    def storage_views(self) -> list[torch.Tensor]:
        """Flat uint8 views of each storage (valid while the group is on device)."""
        return [_u8(t.untyped_storage(), n) for t, n in zip(self._anchors, self._sizes)]

    # -- actions ---------------------------------------------------------------------
    def reserve_host(self) -> None:
        self.engine.pool.acquire(self.name, self._host_nbytes)

    def _chunks(self) -> list[list[int]]:
        return self.engine.copier.split(self._sizes)

    def _jobs(self, i: int, to_host: bool) -> list[CopyJob]:
        buf = self.engine.pool.get(self.name)
        assert buf is not None
        dev = _u8(self._anchors[i].untyped_storage(), self._sizes[i])
        jobs = []
        for rel, host in buf.pieces(self._offsets[i], self._sizes[i]):
            d = dev[rel:rel + int(host.numel())]
            jobs.append((host, d) if to_host else (d, host))
        return jobs

    def _free_all(self) -> None:
        self.memory.free(self)

    def _alloc(self, indices: Sequence[int], chunk: int) -> None:
        self.memory.alloc(self, indices, chunk)

    def check_storages(self) -> None:
        """Every tensor must still hold the storage (and size) it was registered with. An owner that
        rebinds ``.data`` (megatron-core turns the router's expert_bias into a new fp32 tensor at its
        first forward) leaves the group copying and freeing a storage that is not the tensor's any
        more: the tensor would come back short or stale. Refused, naming the tensor."""
        for t, key, size in zip(self._anchors, self._keys, self._sizes):
            st = t.untyped_storage()
            if _storage_key(t) != key or st.nbytes() not in (0, size):
                raise GroupStateError(
                    f"offload group {self.name!r}: a tensor of shape {tuple(t.shape)} ({t.dtype}) holds another "
                    f"storage than when the group was made ({st.nbytes()} bytes, registered {size}): its owner "
                    "replaced its .data; build the group after the owner's tensors take their final form")

    def offload(self, force_copy: bool = False) -> int:
        if self.location is Location.HOST:
            return 0
        if self.location is Location.RELEASED:
            raise GroupStateError(f"offload group {self.name!r} is released: there is no data to offload")
        self.check_storages()
        if self.read_only and self._host_valid and not force_copy:
            self._free_all()
            self.location = Location.HOST
            return 0
        # Raises HostMemoryError on the first offload if the host cannot hold it: nothing moved yet.
        self.reserve_host()
        self._host_valid = False  # the host range is being overwritten
        moved = self.engine.copier.device_to_host(
            [lambda b=b: [job for i in b for job in self._jobs(i, True)] for b in self._chunks()])
        # Free only once every byte is on host: a failure above leaves the group on device.
        self._host_valid = True
        self._free_all()
        self.location = Location.HOST
        return moved

    def onload(self) -> int:
        if self.location is Location.DEVICE:
            return 0
        if self.location is Location.RELEASED or not self._host_valid:
            raise GroupStateError(f"offload group {self.name!r} has no host copy to onload "
                                  f"(location {self.location.value}); use allocate()")

        def chunk(b: int, idx: list[int]) -> Callable[[], list[CopyJob]]:
            def make() -> list[CopyJob]:
                self._alloc(idx, b)
                return [job for i in idx for job in self._jobs(i, False)]
            return make

        try:
            moved = self.engine.copier.host_to_device([chunk(b, idx) for b, idx in enumerate(self._chunks())])
            self.memory.verify(self)
        except BaseException:
            # Roll back to wholly-on-host: the host copy was only read, so it is intact.
            self._free_all()
            raise
        self.location = Location.DEVICE
        return moved

    def release(self) -> int:
        if self.location is not Location.DEVICE:
            return 0
        self.check_storages()
        self._free_all()
        if self.read_only and self._host_valid:
            self.location = Location.HOST
        else:
            self._host_valid = False
            self.location = Location.RELEASED
        return 0

    def allocate(self, zero: bool | None = None) -> int:
        if self.location is Location.DEVICE:
            return 0
        zero = self.zero_on_allocate if zero is None else zero
        try:
            for b, idx in enumerate(self._chunks()):
                self._alloc(idx, b)
            self.memory.verify(self)
        except BaseException:
            self._free_all()
            raise
        if zero:
            for v in self.storage_views():
                v.zero_()
        # The device contents no longer match any host copy.
        self._host_valid = False
        self.location = Location.DEVICE
        return 0

    def close(self) -> None:
        self.engine.pool.release(self.name)
        self.engine.unclaim(self.name)
        self._host_valid = False


class CallbackGroup(OffloadGroup):
    """A group whose memory its owner allocates and frees (vLLM's KV cache): no copies.

    ``allocate_fn()`` builds the tensors and returns them (for the ledger's accounting);
    ``release_fn()`` drops every reference the owner holds. offload == release.
    """

    def __init__(self, name: str, allocate_fn: Callable[[], Sequence[torch.Tensor]],
                 release_fn: Callable[[], None], *, nbytes: int | None = None) -> None:
        self.name, self._allocate_fn, self._release_fn = name, allocate_fn, release_fn
        self._tensors: list[torch.Tensor] = []
        self._nbytes = nbytes
        self.location = Location.RELEASED

    @property
    def nbytes(self) -> int:
        if self._nbytes is None:
            raise RuntimeError(f"group {self.name!r}: size unknown until first allocate()")
        return self._nbytes

    @property
    def host_nbytes(self) -> int:
        return 0

    def device_bytes(self) -> int:
        seen: dict[int, int] = {}
        for t in self._tensors:
            seen[_storage_key(t)] = int(t.untyped_storage().nbytes())
        return sum(seen.values())

    def allocate(self, zero: bool | None = None) -> int:
        if self.location is Location.DEVICE:
            return 0
        try:
            tensors = list(self._allocate_fn())
        except BaseException:
            self._release_fn()  # let the owner drop whatever it built before failing
            raise
        self._tensors = tensors
        if zero:
            for t in tensors:
                t.zero_()
        self._nbytes = self.device_bytes()
        self.location = Location.DEVICE
        return 0

    def release(self) -> int:
        if self.location is Location.DEVICE:
            self._tensors = []
            self._release_fn()
            self.location = Location.RELEASED
        return 0

    def offload(self, force_copy: bool = False) -> int:
        return self.release()

    def onload(self) -> int:
        raise GroupStateError(f"group {self.name!r} keeps no copy; use allocate()")


class HookedGroup(OffloadGroup):
    """Another group with its owner's side effects run before an action that changes where the
    group is (``before``: action name -> callable). The rollout engine's: MLA's derived tensors
    are freed with its weights; the prefix cache is reset before its KV cache is freed; in graph
    mode the weights' addresses are checked before the KV cache comes back."""

    def __init__(self, inner: OffloadGroup, before: dict[str, Callable[[], Any]]) -> None:
        unknown = set(before) - {"offload", "onload", "release", "allocate"}
        if unknown:
            raise ValueError(f"group {inner.name!r}: no action {sorted(unknown)} to hook")
        self.inner, self.before, self.name = inner, dict(before), inner.name

    def __getattr__(self, name: str) -> Any:  # check_addresses, tensors, engine, ...
        return getattr(self.__dict__["inner"], name)

    @property
    def location(self) -> Location:  # type: ignore[override]
        return self.inner.location

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    @property
    def host_nbytes(self) -> int:
        return self.inner.host_nbytes

    def device_bytes(self) -> int:
        return self.inner.device_bytes()

    def reserve_host(self) -> None:
        self.inner.reserve_host()

    def _hook(self, action: str, changes: bool) -> None:
        if changes and action in self.before:
            self.before[action]()

    def offload(self, force_copy: bool = False) -> int:
        self._hook("offload", self.location is Location.DEVICE)
        return self.inner.offload(force_copy)

    def onload(self) -> int:
        self._hook("onload", self.location is not Location.DEVICE)
        return self.inner.onload()

    def release(self) -> int:
        self._hook("release", self.location is Location.DEVICE)
        return self.inner.release()

    def allocate(self, zero: bool | None = None) -> int:
        self._hook("allocate", self.location is not Location.DEVICE)
        return self.inner.allocate(zero)

    def close(self) -> None:
        self.inner.close()


# -- builders for the recipe's groups --------------------------------------------------

def module_tensors(module_or_tensors, *, buffers: bool = True) -> list[torch.Tensor]:
    if isinstance(module_or_tensors, torch.nn.Module):
        out = list(module_or_tensors.parameters())
        return out + list(module_or_tensors.buffers()) if buffers else out
    return list(module_or_tensors)


def train_params_group(engine: OffloadEngine, params, name: str = "train_params") -> TensorGroup:
    """The actor's parameters (with Megatron DDP, pass the param buffers: one storage each)."""
    return TensorGroup(engine, name, module_tensors(params))


def grads_group(engine: OffloadEngine, params, name: str = "grads", *, attr: str | None = None,
                zero_on_allocate: bool = True) -> TensorGroup:
    """Gradients: Megatron's ``main_grad`` buffers if present, else ``.grad``.

    The schedule releases them after the update and re-allocates them zeroed before the
    next one (Megatron zeroes its grad buffers before each backward anyway); ``offload``
    still copies them when a caller must keep accumulated gradients.
    """
    tensors = []
    for p in module_tensors(params):
        a = attr or ("main_grad" if getattr(p, "main_grad", None) is not None else "grad")
        g = getattr(p, a, None)
        if g is not None:
            tensors.append(g)
    return TensorGroup(engine, name, tensors, zero_on_allocate=zero_on_allocate)


def optimizer_state_group(engine: OffloadEngine, optimizer, name: str = "optimizer", *,
                          include_params: bool = False) -> TensorGroup:
    """Every device tensor of ``optimizer.state`` (Adam moments), plus with ``include_params``
    the optimizer's own parameters: for Megatron's (distributed) optimizer the inner torch
    optimizer's params are the fp32 master shards, which move with the state. ``optimizer``
    may be a list (the inner optimizers of a Megatron ChainedOptimizer): one group for all."""
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    return TensorGroup(engine, name, optimizer_tensors(optimizers, include_params=include_params))


def optimizer_tensors(optimizers: Sequence[torch.optim.Optimizer], *, include_params: bool,
                      exclude: frozenset[int] | set[int] = frozenset()) -> list[torch.Tensor]:
    """The resident device tensors of torch optimizers' state (and, with ``include_params``, their
    params), leaving out storages in ``exclude`` (_storage_key). 0-dim tensors (Adam's step
    counters) stay: bytes not worth a copy, read every step."""
    dev = accelerator.device_type()
    out = []
    for opt in optimizers:
        cand = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if include_params:
            cand += [p for grp in opt.param_groups for p in grp["params"]]
        out += [t for t in cand if t.device.type == dev and t.untyped_storage().nbytes() > 0
                and _storage_key(t) not in exclude]
    return out


def reference_group(engine: OffloadEngine, params, name: str = "ref_params") -> TensorGroup:
    """The frozen reference model: copied to host once, later offloads only release."""
    return TensorGroup(engine, name, module_tensors(params), read_only=True)


def rollout_weights_group(engine: OffloadEngine, params, name: str = "rollout_weights", *,
                          region: Region | None = None, watch: Watch | None = None) -> TensorGroup:
    """Rollout engine weights: released after generation, allocated empty before the reshard.

    Parameters only: a module's buffers (rotary caches) are not rebuilt by the reshard, so
    releasing them would lose them; pass tensors explicitly to include more. With ``region``
    (graph mode) they come back at the same addresses.
    """
    return TensorGroup(engine, name, module_tensors(params, buffers=False), region=region, watch=watch)


def kv_cache_group(engine: OffloadEngine, tensors, name: str = "kv_cache", *, region: Region | None = None,
                   watch: Watch | None = None, zero_on_allocate: bool = False) -> TensorGroup:
    """KV cache blocks as plain tensors: freed after generation, re-initialised before it."""
    return TensorGroup(engine, name, module_tensors(tensors), zero_on_allocate=zero_on_allocate, region=region,
                       watch=watch)
