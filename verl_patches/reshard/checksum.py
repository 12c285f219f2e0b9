"""The weight fingerprint: after every reshard, proof that each rollout parameter holds exactly what
the training side implies for it, computed on the device, bit for bit.

The checksum of a parameter ``T`` (any layout, any dtype) is

    C(T) = sum_i bits(T_i) * k(i)   (mod M),   k(i) = K[i mod 2**22] + c(i div 2**22)

where ``i`` is the element's flat row-major index in ``T``, ``bits`` its raw bit pattern as a
signed integer (bf16/fp16: 16 bits; fp32: 32 bits reduced mod M first), ``K`` a table of 2**22
pseudo-random keys in [1, 2**15] drawn from a fixed seed and ``c`` a key per 2**22-element chunk.
With 16-bit values every product fits an int32 exactly and the sums are int64. It is exact integer
arithmetic, so:
- it is order free: the rollout rank sums its parameter in chunks; every training rank sums the
  boxes it sends at their *destination* offsets; the partial sums add up along the plan (one
  all-reduce) to the same integer, with no tolerance;
- it is position sensitive: an element written to the wrong place (a transpose, a shifted row, a
  swapped expert) changes the sum, unless the two values are bit-equal or the keys collide.

The destination offsets come from the plan's own placements applied to a *meta* tensor of the
rollout parameter's shape (``Slot.view`` is reshape / narrow / permute, all true views), so the
sender never needs the rollout tensor, and the check does not reuse the executor's copy path:
it asks "which element of vLLM's parameter should hold this training element", from the
placements, and the rollout side answers from the raw parameter. Padding the rollout zero-fills
(vocab rows) contributes nothing and must therefore be zero.

Cost (measured by scripts/bench_self_check.py, figures in docs/benchmarks.md): the rollout rank
reads its shard once; a sending rank reads what it sent once per distinct (values, destination
offsets) pair: a box replicated to many rollout ranks at the same offsets (the dense weights, once per
DP replica) gives the same sum, computed once and counted for every destination. Temporaries are
bounded by one block (2**24 elements) plus the 16 MiB key table; one all-reduce of 8 bytes per (rank,
parameter). Two code paths compute the same integers:
- torch (every device; the one an NPU runs): torch's sum(dtype=int64) of an int32 tensor writes an int64
  copy first, so 2-byte values' products with the keys (each below 2**30 in magnitude) are added in
  pairs within int32 before the widening sum, and the plain sums of the bits in int32 groups of 2**15;
  a sender's chunk keys come from a 512-entry table;
- a fused Triton kernel on CUDA (2-byte values; VERL_PATCHES_FINGERPRINT_TRITON=false turns it off):
  one pass that reads each value once and looks its key up in the (L2-resident) table.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist

from verl_patches.reshard.box import Box
from verl_patches.reshard.planner import Plan, Transfer
from verl_patches.base import accelerator
from verl_patches.config import env as overlay_env
from verl_patches.reshard.executor import src_view

MOD = (1 << 31) - 1  # the checksum's modulus (a prime); chunk sums stay far below 2**63
_SHIFT = 22
CHUNK = 1 << _SHIFT  # key period and chunk size: element i has key K[i mod CHUNK] + c(i div CHUNK)
_KEY_SEED = 0x5EED


class WeightMismatchError(RuntimeError):
    """A rollout parameter does not hold what the training side sent it; the message names the step,
    rollout rank, parameter, expected and found checksums."""


_TABLES: dict[str, torch.Tensor] = {}
_CHUNK_KEYS: dict[str, torch.Tensor] = {}


def key_table(device: torch.device) -> torch.Tensor:
    """K: CHUNK pseudo-random keys in [1, 2**15] (int32, 16 MiB), drawn once from a fixed seed on the
    host, so every rank and device has the same table."""
    dev = str(device)
    if dev not in _TABLES:
        g = torch.Generator().manual_seed(_KEY_SEED)
        _TABLES[dev] = torch.randint(1, (1 << 15) + 1, (CHUNK,), generator=g, dtype=torch.int32).to(device)
    return _TABLES[dev]


def _chunk_keys(device: torch.device) -> torch.Tensor:
    """c(q) for every chunk index an int32 element index can reach (512 of them), int32, per device."""
    dev = str(device)
    if dev not in _CHUNK_KEYS:
        _CHUNK_KEYS[dev] = _chunk_key(torch.arange(1 << (31 - _SHIFT), dtype=torch.int32, device=device))
    return _CHUNK_KEYS[dev]


def _chunk_key(q: torch.Tensor | int) -> torch.Tensor | int:
    """c(q) in [0, 2**15): what a chunk's index adds to its keys (so equal chunks at other places differ).
    q < 2**17 for any int32 index, so q * 40503 stays below 2**31."""
    return (q * 40503 + 7) & 0x7FFF


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as integers: bf16/fp16 as int16; 4-byte types as int64 reduced mod M."""
    size = values.element_size()
    if size == 2:
        return values.view(torch.int16)  # int16 x int32 keys promote to exact int32 products
    if size == 4:
        return torch.remainder(values.view(torch.int32).to(torch.int64), MOD)
    raise TypeError(f"weight fingerprint: dtype {values.dtype} is not a 2- or 4-byte type")


def _dot(bits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """sum(bits * keys) mod M, exact: 2-byte bits x keys < 2**31 fit int32 products, summed in int64."""
    if bits.dtype == torch.int64:
        return torch.remainder(torch.remainder(bits * keys, MOD).sum(), MOD)
    return torch.remainder((bits * keys).sum(dtype=torch.int64), MOD)


BLOCK = 1 << 24  # elements per kernel launch: bounds the temporaries (64 MiB of int32) and the launches


def _receive_rows(bits: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Per row of int16 ``bits`` [rows, CHUNK], sum(bits * K) as int64, exact. |bits * K| <= 2**30, so two
    products add up within an int32 (-2**31 at the very least) and only half the count is widened."""
    prod = bits * table
    return (prod[:, 0::2] + prod[:, 1::2]).sum(dim=1, dtype=torch.int64)


def _row_sums(bits: torch.Tensor) -> torch.Tensor:
    """Per row of int16 ``bits`` [rows, L] (L a multiple of 2**15 or at most it), the sum as int64."""
    rows, L = bits.shape
    g = min(L, 1 << 15)  # 2**15 values of at most 2**15 fit an int32 sum
    return bits.reshape(rows, L // g, g).sum(dim=2, dtype=torch.int32).sum(dim=1, dtype=torch.int64)


def tensor_checksum(t: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """C(t) over t's own flat row-major index, as a 0-dim int64 tensor (no host sync). Per chunk q of
    CHUNK elements: sum(bits * K) + c(q) * sum(bits); BLOCK // CHUNK chunks per launch. ``impl``:
    "auto" (the fused kernel where it applies), "torch" or "triton" (tests)."""
    flat = t.reshape(-1)
    if _use_fused(flat, impl):
        return _fused_checksum(flat, flat, 0)
    n = flat.numel()
    table = key_table(t.device)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    per = BLOCK // CHUNK
    full = n // CHUNK
    if flat.element_size() == 2:
        for q0 in range(0, full, per):
            q1 = min(full, q0 + per)
            bits = flat[q0 * CHUNK:q1 * CHUNK].view(torch.int16).view(q1 - q0, CHUNK)
            qs = torch.arange(q0, q1, dtype=torch.int64, device=t.device)
            rows = _receive_rows(bits, table) + _chunk_key(qs) * _row_sums(bits)
            total = torch.remainder(total + rows.sum(), MOD)
    else:
        for q0 in range(0, full, per):
            q1 = min(full, q0 + per)
            bits = _bits(flat[q0 * CHUNK:q1 * CHUNK]).view(q1 - q0, CHUNK)
            rows = torch.remainder(bits * table, MOD).sum(dim=1)
            sums = torch.remainder(bits.sum(dim=1, dtype=torch.int64), MOD)
            qs = torch.arange(q0, q1, dtype=torch.int64, device=t.device)
            total = torch.remainder(total + torch.remainder(rows + _chunk_key(qs) * sums, MOD).sum(), MOD)
    if full * CHUNK < n:
        bits = _bits(flat[full * CHUNK:])
        part = _dot(bits, table[:bits.numel()]) + _chunk_key(full) * torch.remainder(bits.sum(dtype=torch.int64), MOD)
        total = torch.remainder(total + part, MOD)
    return total


def view_checksum(values: torch.Tensor, dest: torch.Tensor, rows_per_chunk: int | None = None,
                  impl: str = "auto") -> torch.Tensor:
    """sum(bits(values) * k(flat index in the destination)) mod M, where ``dest`` is a view (of the
    same shape as ``values``) into a meta tensor of the destination's shape: its storage offset and
    strides give each element's flat index there. ``impl`` as in tensor_checksum."""
    if tuple(values.shape) != tuple(dest.shape):
        raise ValueError(f"weight fingerprint: values {tuple(values.shape)} vs destination {tuple(dest.shape)}")
    device = values.device
    total = torch.zeros((), dtype=torch.int64, device=device)
    if values.numel() == 0:
        return total
    if _use_fused(values, impl, dest):
        return _fused_checksum(values, dest, dest.storage_offset())
    values, dest = (values.reshape(1), dest.reshape(1)) if values.dim() == 0 else (values, dest)
    table = key_table(device)
    # Destination indices fit int32 below 2**31 elements (every parameter of DeepSeek-V3's layouts):
    # half the bytes of int64 index arithmetic.
    span = dest.storage_offset() + sum((n - 1) * st for n, st in zip(dest.shape, dest.stride())) + 1
    itype = torch.int32 if span < (1 << 31) else torch.int64
    # Offsets of the trailing dims, broadcast; the leading dim is walked in blocks of rows.
    rest = torch.zeros((), dtype=itype, device=device)
    for d in range(1, values.dim()):
        shape = [1] * (values.dim() - 1)
        shape[d - 1] = values.shape[d]
        rest = rest + (torch.arange(values.shape[d], dtype=itype, device=device) * dest.stride(d)).view(shape)
    row = max(1, math.prod(values.shape[1:]))
    rows = rows_per_chunk or max(1, BLOCK // row)
    for a in range(0, values.shape[0], rows):
        b = min(values.shape[0], a + rows)
        lead = (torch.arange(a, b, dtype=itype, device=device) * dest.stride(0) + dest.storage_offset())
        index = lead.view([-1] + [1] * (values.dim() - 1)) + rest
        if itype == torch.int32:
            keys = table[index & (CHUNK - 1)]
            keys += _chunk_keys(device)[index >> _SHIFT]
        else:
            keys = table[index & (CHUNK - 1)] + _chunk_key(index >> _SHIFT).to(torch.int32)
        total = torch.remainder(total + _dot(_bits(values[a:b]), keys), MOD)
    return total


# ---- the fused kernel (CUDA, Triton): the same integers in one pass ----

_FUSED_DIMS = 4


def _use_fused(values: torch.Tensor, impl: str, dest: torch.Tensor | None = None) -> bool:
    if impl == "torch":
        return False
    ok = (values.element_size() == 2 and values.dim() <= _FUSED_DIMS and values.numel() < (1 << 31)
          and (dest is None or _span(dest) < (1 << 62)))
    if impl == "triton":
        if not ok or _fused_kernel() is None:
            raise ValueError(f"weight fingerprint: the fused kernel does not apply to {values.dtype} "
                             f"{tuple(values.shape)} here (Triton {'missing' if _fused_kernel() is None else 'present'})")
        return True
    if impl != "auto":
        raise ValueError(f"weight fingerprint: impl {impl!r} is not auto, torch or triton")
    return ok and values.device.type == "cuda" and values.numel() >= (1 << 16) and _fused_kernel() is not None


def _span(dest: torch.Tensor) -> int:
    return dest.storage_offset() + sum((n - 1) * st for n, st in zip(dest.shape, dest.stride())) + 1


@functools.lru_cache(maxsize=1)
def _fused_kernel():
    if not overlay_env.get("VERL_PATCHES_FINGERPRINT_TRITON"):
        return None
    # Lazy: Triton is optional (none on an NPU or a CPU-only build), and fingerprint_kernel, the package's one
    # lazily imported module (tests/test_import_graph.py, LAZY_OWN), defines its kernel with Triton at its head.
    try:
        import triton
        from verl_patches.reshard.fingerprint_kernel import fingerprint_partials
    except Exception:  # noqa: BLE001 - no Triton (NPU, a CPU-only build): the torch path
        return None
    return triton, fingerprint_partials


def _fused_checksum(values: torch.Tensor, dest: torch.Tensor, offset: int) -> torch.Tensor:
    """The checksum of ``values`` at the flat destination indices ``offset + sum(i_d * dest.stride(d))``,
    through the fused kernel: per-program int64 partial sums (each below 2**43), added in int64 (below
    2**62 for fewer than 2**31 elements), then reduced mod M."""
    assert _KEY_SEED == 0x5EED and _SHIFT == 22 and CHUNK == 4194304  # the constants the kernel spells out
    triton, kern = _fused_kernel()
    shape, src, dst = list(values.shape), list(values.stride()), list(dest.stride())
    # The innermost loop runs along the source's smallest stride: coalesced reads of the values.
    order = sorted(range(len(shape)), key=lambda d: (shape[d] > 1, -src[d]))  # size-1 dims outermost
    shape, src, dst = [shape[d] for d in order], [src[d] for d in order], [dst[d] for d in order]
    while len(shape) < _FUSED_DIMS:
        shape, src, dst = [1] + shape, [0] + src, [0] + dst
    inner = shape[3]
    block = max(128, min(4096, triton.next_power_of_2(inner)))
    n_blk = triton.cdiv(inner, block)
    programs = shape[0] * shape[1] * shape[2] * n_blk
    partials = torch.empty(programs, dtype=torch.int64, device=values.device)
    kern[(programs,)](values.view(torch.int16), key_table(values.device), partials, inner, n_blk, shape[1], shape[2],
                      *src, *dst, offset, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return torch.remainder(partials.sum(), MOD)


def _rel(box: Box, part_box: Box) -> tuple[slice, ...]:
    return tuple(slice(a - pa, b - pa) for (a, b), (pa, _) in zip(box, part_box))


@dataclass
class FingerprintTable:
    """One slot per (rollout rank, parameter) of the plan, in a fixed order every rank agrees on."""

    names: list[list[str]]  # per rollout rank: its parameter names, sorted
    offsets: list[int]  # per rank: index of its first slot
    size: int
    meta: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: Plan) -> "FingerprintTable":
        cached = plan.__dict__.get("_fingerprint_table")
        if cached is None:
            names = [sorted(s) for s in plan.placements.rollout_storage]
            offsets, n = [], 0
            for ns in names:
                offsets.append(n)
                n += len(ns)
            cached = plan.__dict__["_fingerprint_table"] = cls(names, offsets, n)
        return cached

    def slot(self, rank: int, name: str) -> int:
        return self.offsets[rank] + self.names[rank].index(name)

    def dest_view(self, plan: Plan, tr: Transfer) -> tuple[str, torch.Tensor]:
        """(parameter name, meta view of the box in the destination rank's parameter)."""
        part = next((p for p in plan.placements.tensors[tr.tensor].rollout if tr.dst in p.ranks and
                     all(pa <= a and b <= pb for (a, b), (pa, pb) in zip(tr.box, p.box))), None)
        if part is None:
            raise KeyError(f"weight fingerprint: no rollout part of rank {tr.dst} holds box {tr.box} of "
                           f"{plan.placements.tensors[tr.tensor].name}")  # plan and placements disagree: a bug
        name = part.slot.name
        key = (tr.dst, name)
        if key not in self.meta:
            self.meta[key] = torch.empty(plan.placements.rollout_storage[tr.dst][name], device="meta")
        return name, part.slot.view(self.meta[key])[_rel(tr.box, part.box)]


@dataclass
class FingerprintResult:
    params: int  # rollout parameters compared on this rank
    bytes_read: int  # bytes this rank read for the check (its rollout shard + what it sent)
    seconds: float


def _sent_by(plan: Plan, rank: int) -> list[Transfer]:
    cache = plan.__dict__.setdefault("_fingerprint_sends", {})
    if rank not in cache:
        cache[rank] = [t for t in plan.local if t.src == rank] + [t for b in plan.buckets for t in b if t.src == rank]
    return cache[rank]


def _send_key(tr: Transfer, dest: torch.Tensor) -> tuple:
    """What a send's sum depends on: the training values (tensor, box) and the flat destination indices
    they go to (the meta view's offset, shape and strides), not which rank receives them."""
    return (tr.tensor, tuple(map(tuple, tr.box)), dest.storage_offset(), tuple(dest.shape), tuple(dest.stride()))


def checked_bytes(plan: Plan, rank: int) -> tuple[int, int]:
    """(bytes of the rank's rollout shard, bytes of training values it sums as a sender): what one
    check reads on that rank, each distinct (values, destination offsets) pair once (as verify does)."""
    table = FingerprintTable.of(plan)
    shard = plan.ranks[rank].shard_bytes
    seen, sent = set(), 0
    for tr in _sent_by(plan, rank):
        key = _send_key(tr, table.dest_view(plan, tr)[1])
        if key not in seen:
            seen.add(key)
            sent += tr.numel * plan.elem_size
    return shard, sent


def verify(plan: Plan, rank: int, train: Mapping[str, torch.Tensor], roll: Mapping[str, torch.Tensor], *,
           step: Any = None, group: Any = None) -> FingerprintResult:
    """Compare every rollout parameter of every rank with what the training side implies (all ranks
    call it together, after the reshard, with the training tensors it read). Raises
    WeightMismatchError on every rank when any rank differs."""
    t0 = time.perf_counter()
    P = plan.placements
    table = FingerprintTable.of(plan)
    device = next(iter(roll.values())).device
    expected = torch.zeros(table.size, dtype=torch.int64, device=device)
    read = 0
    slots, sums = [], []
    done: dict[tuple, torch.Tensor] = {}  # one sum per distinct (values, destination offsets)
    for tr in _sent_by(plan, rank):
        name, dest = table.dest_view(plan, tr)
        key = _send_key(tr, dest)
        if key not in done:
            values = src_view(P, tr, dict(train))
            done[key] = view_checksum(values, dest)
            read += values.numel() * values.element_size()
        slots.append(table.slot(tr.dst, name))
        sums.append(done[key])
    if sums:
        expected.index_add_(0, torch.tensor(slots, dtype=torch.int64, device=device), torch.stack(sums))
    mine = table.names[rank]
    found = torch.stack([tensor_checksum(roll[n]) for n in mine]) if mine else expected[:0]
    read += sum(roll[n].numel() * roll[n].element_size() for n in mine)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(expected, group=group)
    expected = torch.remainder(expected, MOD)
    lo = table.offsets[rank]
    bad = (expected[lo:lo + len(mine)] != found).nonzero().flatten().tolist()
    mismatches = [(rank, mine[i], int(expected[lo + i]), int(found[i])) for i in bad]
    mismatches = _everyone(mismatches, group, device)
    if mismatches:
        where = f"step {step}" if step is not None else "this switch"
        lines = [f"rollout rank {r}, {n}: expected {e:#010x}, found {f:#010x}" for r, n, e, f in mismatches[:8]]
        more = f" (and {len(mismatches) - 8} more)" if len(mismatches) > 8 else ""
        raise WeightMismatchError(
            f"weight fingerprint at {where}: {len(mismatches)} rollout parameter(s) do not hold what the training "
            f"side sent{more}:\n  " + "\n  ".join(lines) +
            "\nThe rollout would generate from other weights than the trainer's. Compare the reshard method "
            "(actor_rollout_ref.rollout.recipe.reshard_method) and the engine's weight layout; this check is "
            "actor_rollout_ref.rollout.recipe.fingerprint_every")
    accelerator.synchronize()
    return FingerprintResult(len(mine), read, time.perf_counter() - t0)


def _everyone(items: list, group: Any, device: torch.device) -> list:
    """Every rank's items, on every rank (one flag all-reduce; an object gather only when any)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return items
    flag = torch.tensor([len(items)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, group=group)
    if int(flag.item()) == 0:
        return []
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, items, group=group)
    return sorted(x for g in gathered for x in g)

