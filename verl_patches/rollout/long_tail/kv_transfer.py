"""The transfer of a rebalance's moved requests between the DP ranks: each request's state, with its KV
rows carried as device tensors over a device process group (NCCL on CUDA, HCCL on Ascend, gloo on the
host: the same code) and everything else pickled over the host group.

For the moves list (the same on every rank; src / dst are group ranks) and this rank's outgoing
payloads (request id -> the engine's state dict):

1. The tensors under a payload's ``"kv"`` entry (nested dicts, lists and tuples are walked; the
   engines' layouts: ``kv_blocks.export_request``'s ``{"num_tokens", "rows"}`` and the CPU stand-in's
   per-layer ``(key, value)`` pairs) are taken out and replaced by ``Slot`` placeholders. For each
   (source, destination) pair the source packs them into one contiguous buffer per dtype on the KV
   group's device (one buffer per pair for an MLA cache, which has one dtype), concatenated flat in the
   order of the moves list, then each request's tensors in payload order.
2. The rest of the payloads, with the placeholders and the buffers' layout (dtype, size, and each
   slot's offset and shape), is pickled and goes point to point over the host group: a size, then the
   bytes (as before this module: small now).
3. The receiver checks the layout against the moves, allocates the buffers on its device, and every
   isend / irecv of the KV group is posted before any wait (``batch_isend_irecv``: NCCL coalesces them,
   so no pair order deadlocks); then it splits the buffers back into each request's tensors (views of
   the received buffer, on the destination's device) and puts them where the placeholders were.

No KV byte passes through the host on a device backend: packing and splitting run on the device. A
device backend's communicator must exist on every rank before a transfer that not every rank joins
(``prepare``, a collective; ``migrate.Lockstep`` runs it at construction). Imports torch and the
accelerator facade only (no vLLM): it runs wherever torch.distributed runs.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_patches.base import accelerator

KV_KEY = "kv"
_DEVICE_OF_BACKEND = {"nccl": "cuda", "hccl": "npu"}
_prepared: dict[int, Any] = {}  # id(group) -> group (kept alive with its id)


class TransferError(RuntimeError):
    """A transfer is malformed (a request this rank does not hold, a layout that disagrees with the
    moves or the buffers, a tensor off the group's device); the message names the problem."""


@dataclass(frozen=True)
class Slot:
    """Where a KV tensor was in a payload: its index in the pair's slot list."""

    index: int


def group_device(group: Any) -> torch.device:
    """The device a process group's backend carries: the host for gloo, this rank's current device
    (through the accelerator facade) for nccl / hccl."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "gloo":
        return torch.device("cpu")
    kind = _DEVICE_OF_BACKEND.get(backend)
    if kind is None:
        raise TransferError(f"process group backend {backend!r}: KV tensors go over gloo, nccl or hccl")

    dev = accelerator.current_device()
    if dev.type != kind:
        raise TransferError(f"process group backend {backend} carries {kind} tensors, but this rank's device is "
                            f"{dev} (VERL_PATCHES_DEVICE or the accelerator facade disagrees with the group)")
    return dev


def prepare(group: Any) -> torch.device:
    """Every rank of ``group`` calls it together once, before its first transfer: on a device backend,
    one small all-reduce makes the group's communicator (NCCL builds it lazily, and a batched
    point-to-point call that not every rank joins cannot build it). Returns the group's device."""
    dev = group_device(group)
    if dev.type != "cpu":
        dist.all_reduce(torch.zeros(1, device=dev), group=group)
    _prepared[id(group)] = group
    return dev


def _map_kv(payload: Any, leaf: Any) -> Any:
    """``payload`` with ``leaf`` applied to every value under its ``"kv"`` entry that is not a dict, list
    or tuple (those are walked); a payload without a ``"kv"`` entry is returned as is."""
    if not isinstance(payload, Mapping) or KV_KEY not in payload:
        return payload

    def walk(obj: Any) -> Any:
        if isinstance(obj, Mapping):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v) for v in obj)
        return leaf(obj)

    out = dict(payload)
    out[KV_KEY] = walk(payload[KV_KEY])
    return out


def split_payload(payload: Any, first: int = 0) -> tuple[Any, list[torch.Tensor]]:
    """(the payload with each tensor under its ``"kv"`` entry replaced by a ``Slot``, numbered from
    ``first``; those tensors in walk order). A payload without a ``"kv"`` entry: as is, no tensors."""
    tensors: list[torch.Tensor] = []

    def leaf(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return Slot(first + len(tensors) - 1)
        return obj

    return _map_kv(payload, leaf), tensors


def fill_payload(payload: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The inverse of ``split_payload``: the ``Slot`` numbered ``i`` becomes ``tensors[i]``."""

    def leaf(obj: Any) -> Any:
        if isinstance(obj, Slot):
            if not 0 <= obj.index < len(tensors):
                raise TransferError(f"KV slot {obj.index} of a payload; the buffers hold {len(tensors)} tensors")
            return tensors[obj.index]
        return obj

    return _map_kv(payload, leaf)


def pack(tensors: Sequence[torch.Tensor], device: torch.device, what: str = "") -> tuple[list[torch.Tensor], dict]:
    """``tensors`` flat into one contiguous buffer per dtype on ``device`` (in order of first
    appearance), and the layout: ``{"dtypes", "sizes" (elements per buffer), "slots" ((buffer index,
    element offset, shape) per tensor)}``. A tensor on another device is an error naming it."""
    dtypes: list[torch.dtype] = []
    sizes: list[int] = []
    slots: list[tuple[int, int, tuple[int, ...]]] = []
    for i, t in enumerate(tensors):
        if t.device != device:
            raise TransferError(f"{what}KV tensor {i} {tuple(t.shape)} is on {t.device}, not on {device}, the device "
                                "of the KV process group (move the rows with a group of their device's backend)")
        if t.dtype not in dtypes:
            dtypes.append(t.dtype)
            sizes.append(0)
        b = dtypes.index(t.dtype)
        slots.append((b, sizes[b], tuple(t.shape)))
        sizes[b] += t.numel()
    buffers = [torch.empty(n, dtype=dt, device=device) for dt, n in zip(dtypes, sizes)]
    for t, (b, off, shape) in zip(tensors, slots):
        buffers[b][off:off + t.numel()].view(shape).copy_(t)
    return buffers, {"dtypes": dtypes, "sizes": sizes, "slots": slots}


def check_layout(layout: Any, what: str = "") -> None:
    """A received layout is well formed: every slot lies in its buffer, the slots tile each buffer
    exactly (a size that disagrees with the slots is an error naming both)."""
    try:
        dtypes, sizes, slots = list(layout["dtypes"]), list(layout["sizes"]), list(layout["slots"])
    except (TypeError, KeyError) as e:
        raise TransferError(f"{what}malformed KV layout ({e!r})") from e
    if len(dtypes) != len(sizes) or not all(isinstance(d, torch.dtype) for d in dtypes):
        raise TransferError(f"{what}KV layout: {len(dtypes)} dtypes {dtypes} for {len(sizes)} buffer sizes")
    ends = [0] * len(sizes)
    for i, (b, off, shape) in enumerate(slots):
        if not 0 <= b < len(sizes):
            raise TransferError(f"{what}KV slot {i} names buffer {b} of {len(sizes)}")
        if off != ends[b]:
            raise TransferError(f"{what}KV slot {i} starts at element {off} of buffer {b}; the slots before it end "
                                f"at {ends[b]}")
        ends[b] = off + math.prod(shape)
    if ends != sizes:
        raise TransferError(f"{what}KV buffer sizes {sizes} (elements) disagree with the slots, which fill {ends}")


def unpack(buffers: Sequence[torch.Tensor], layout: Mapping[str, Any], what: str = "") -> list[torch.Tensor]:
    """The tensors of ``layout`` as views of ``buffers`` (on the buffers' device). A buffer whose dtype
    or size is not the layout's is an error naming both."""
    check_layout(layout, what)
    if len(buffers) != len(layout["sizes"]):
        raise TransferError(f"{what}{len(buffers)} KV buffers for a layout of {len(layout['sizes'])}")
    for b, (buf, dt, n) in enumerate(zip(buffers, layout["dtypes"], layout["sizes"])):
        if buf.dtype != dt or buf.dim() != 1 or buf.numel() != n:
            raise TransferError(f"{what}KV buffer {b} is {tuple(buf.shape)} {buf.dtype}; the layout says ({n},) {dt}")
    return [buffers[b][off:off + math.prod(shape)].view(shape) for b, off, shape in layout["slots"]]


def _exchange(ops: list) -> None:
    """Post every isend / irecv, then wait for all of them."""
    if not ops:
        return
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def transfer(moves: Sequence[Any], payloads: Mapping[Any, Any], group: Any,
             kv_group: Any = None) -> tuple[dict, int]:
    """Send the payload of every move whose source is this rank, receive those whose destination is.

    ``moves``: the same sequence on every rank of ``group`` (items with ``request``, ``src``, ``dst``:
    group ranks); ``payloads``: request id -> what to send, for this rank's outgoing moves. The
    tensors under a payload's ``"kv"`` entry go over ``kv_group`` (default ``group``) as device
    buffers, on that group's device; the rest is pickled over ``group`` (tensors there go to the host).
    Returns (request id -> received payload, bytes this rank sent: pickled plus KV). A rank may both
    send and receive: every isend / irecv is posted before any wait.
    """
    kv_group = group if kv_group is None else kv_group
    me = dist.get_rank(group)
    if dist.get_rank(kv_group) != me or dist.get_process_group_ranks(kv_group) != dist.get_process_group_ranks(group):
        raise TransferError("the KV group and the host group must hold the same ranks in the same order")
    ranks = dist.get_process_group_ranks(group)
    outgoing: dict[int, list] = {}
    rows_out: dict[int, list[torch.Tensor]] = {}
    incoming: set[int] = set()
    for m in moves:
        if m.src == m.dst:
            raise TransferError(f"move of request {m.request!r} from rank {m.src} to itself")
        if m.src == me:
            if m.request not in payloads:
                raise TransferError(f"rank {me} is to send request {m.request!r} but does not hold it")
            pair = rows_out.setdefault(m.dst, [])
            rest, tensors = split_payload(payloads[m.request], len(pair))
            pair.extend(tensors)
            outgoing.setdefault(m.dst, []).append((m.request, _to_host(rest)))
        elif m.dst == me:
            incoming.add(m.src)
    device = None
    if any(rows_out.values()) or incoming:
        if kv_group is not group and id(kv_group) not in _prepared:
            raise TransferError("the KV process group was not prepared (kv_transfer.prepare(group), called by every "
                                "rank once before the first transfer)")
        device = group_device(kv_group)
    buffers_out: dict[int, list[torch.Tensor]] = {}
    layouts: dict[int, dict] = {}
    for dst, tensors in rows_out.items():
        buffers_out[dst], layouts[dst] = pack(tensors, device, f"rank {me} to rank {dst}: ")
    blobs = {dst: pickle.dumps((items, layouts[dst]), protocol=pickle.HIGHEST_PROTOCOL)
             for dst, items in outgoing.items()}
    # The pickled part (small): sizes, then bytes, over the host group.
    sizes_in = {src: torch.zeros(1, dtype=torch.int64) for src in incoming}
    _exchange([dist.P2POp(dist.isend, torch.tensor([len(b)], dtype=torch.int64), ranks[dst], group, 1)
               for dst, b in blobs.items()]
              + [dist.P2POp(dist.irecv, t, ranks[src], group, 1) for src, t in sizes_in.items()])
    data_in = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in sizes_in.items()}
    _exchange([dist.P2POp(dist.isend, torch.frombuffer(bytearray(b), dtype=torch.uint8), ranks[dst], group, 2)
               for dst, b in blobs.items()]
              + [dist.P2POp(dist.irecv, t, ranks[src], group, 2) for src, t in data_in.items()])
    received_items: dict[int, tuple[list, dict]] = {}
    for src in sorted(data_in):
        items, layout = pickle.loads(data_in[src].numpy().tobytes())
        what = f"rank {me} from rank {src}: "
        check_layout(layout, what)
        for rid, _ in items:
            if not any(m.request == rid and m.dst == me and m.src == src for m in moves):
                raise TransferError(f"rank {me} received request {rid!r} from rank {src}, which no move sends it")
        received_items[src] = (items, layout)
    # The KV buffers, over the KV group: one per (pair, dtype), on the devices.
    buffers_in = {src: [torch.empty(n, dtype=dt, device=device) for dt, n in zip(layout["dtypes"], layout["sizes"])]
                  for src, (_, layout) in received_items.items()}
    ops = [dist.P2POp(dist.isend, buf, ranks[dst], kv_group, 10 + k)
           for dst, bufs in buffers_out.items() for k, buf in enumerate(bufs)]
    ops += [dist.P2POp(dist.irecv, buf, ranks[src], kv_group, 10 + k)
            for src, bufs in buffers_in.items() for k, buf in enumerate(bufs)]
    _exchange(ops)
    received: dict = {}
    for src, (items, layout) in sorted(received_items.items()):
        tensors = unpack(buffers_in[src], layout, f"rank {me} from rank {src}: ")
        for rid, payload in items:
            received[rid] = fill_payload(payload, tensors)
    missing = [m.request for m in moves if m.dst == me and m.request not in received]
    if missing:
        raise TransferError(f"rank {me} did not receive request(s) {missing[:3]}")
    kv_bytes = sum(b.numel() * b.element_size() for bufs in buffers_out.values() for b in bufs)
    return received, sum(len(b) for b in blobs.values()) + kv_bytes


def _to_host(obj: Any) -> Any:
    """Tensors of the pickled part, on the host (gloo carries the bytes)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj
