"""The weight fingerprint: after every reshard, proof that each rollout parameter holds exactly what
the training side implies for it, computed on the device, bit for bit.

The checksum of a parameter ``T`` (any layout, a 2- or 4-byte dtype) is an integer modulo 2**32:

    C(T) = sum_i bits(T_i) * k(i)   (mod 2**32),   k(i) = K[i mod 2**22] * c(i div 2**22)   (mod 2**32)

where ``i`` is the element's flat row-major index in ``T``; ``bits`` its raw bit pattern as an integer
(bf16/fp16: the int16, sign-extended; fp32 and other 4-byte types: the 32-bit word ``w`` mixed as
``w ^ (w >>> 16)``, a bijection of 32-bit words); ``K`` a table of 2**22 pseudo-random *odd* 32-bit keys
drawn from a fixed seed; and ``c(q) = ((q * 0x9E3779B1 + 0x7F4A7C15) mod 2**32) | 1`` the odd key of
chunk ``q``. Every ``k(i)`` is odd (a product of odd numbers), so it is invertible modulo 2**32. All of
it is int32 arithmetic that wraps (products and sums taken modulo 2**32), so:
- it is order free: the rollout rank sums its parameter in chunks; every training rank sums the
  boxes it sends at their *destination* offsets; the partial sums add up along the plan (one int64
  all-reduce, reduced modulo 2**32 after) to the same integer, with no tolerance;
- any single changed element is always detected: its change ``d`` is a non-zero integer of magnitude
  below 2**32 (two distinct int16, or two distinct mixed words), and ``d * k(i)`` is 0 modulo 2**32
  only if ``d`` is, ``k(i)`` being invertible; so is every single flipped bit;
- it is position sensitive: two unequal values ``a``, ``b`` swapped between places ``i`` and ``j``
  change the sum by ``(a - b) * (k(j) - k(i))``. Both keys are odd, so ``k(j) - k(i)`` is even: with
  random keys the swap goes unseen with probability 2**-(31 - v), ``v`` the number of trailing zero bits
  of ``a - b`` (v <= 15 for 2-byte values: at worst 2**-16, typically 2**-30; the previous checksum modulo
  2**31 - 1 with keys in [1, 2**15] missed a swap whenever two keys collided, 2**-15). The mix of 4-byte
  words keeps ``v`` small for their natural faults: a flipped sign changes the mixed word by 2**31 +- 2**15
  (v = 15), where the plain word would change by 2**31 and a whole fp32 tensor negated (an even number of
  elements) would sum to the same integer. A transposed block or a shifted row moves many values: the
  change is a sum of many such terms, zero with probability about 2**-31.

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
- torch (every device; the one an NPU runs): the box is cut into pieces that each lie in one key period
  (``_plan``); a piece's keys are a *view* of the table (a slice, or ``as_strided`` with the destination's
  strides modulo 2**22), so one piece is one int32 multiply and one int32 sum, times its chunk key (one
  per piece, or a short per-row vector where the rows lie in different chunks). A box whose pieces would
  be too small falls back to gathering each element's key. It relies on the device's int32 multiply and
  sum wrapping modulo 2**32: a one-time probe per device (``_check_wraps``) compares small overflowing
  sums with Python's exact result and raises FingerprintArithmeticError where they differ;
- a fused Triton kernel on CUDA (2-byte values; VERL_PATCHES_FINGERPRINT_TRITON=false turns it off):
  one pass that reads each value once and looks its key up in the (L2-resident) table, in uint32
  arithmetic (which wraps by definition).
"""

from __future__ import annotations

import collections
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
from verl_patches.base import env as overlay_env
from verl_patches.reshard.direct import src_view

MASK = (1 << 32) - 1  # the checksum is an integer modulo 2**32, in [0, 2**32)
_SHIFT = 22
CHUNK = 1 << _SHIFT  # key period and chunk size: element i has key K[i mod CHUNK] * c(i div CHUNK)
_KEY_SEED = 0x5EED
_CHUNK_MUL, _CHUNK_ADD = 0x9E3779B1, 0x7F4A7C15  # c(q) = ((q * _CHUNK_MUL + _CHUNK_ADD) mod 2**32) | 1
_MAX_CHUNKS = 1 << 20  # chunk keys kept on a device at most (4 MiB): destinations below 2**42 elements
BLOCK = 1 << 24  # elements per multiply at most: bounds the temporaries (64 MiB of int32 products)


class WeightMismatchError(RuntimeError):
    """A rollout parameter does not hold what the training side sent it; the message names the step,
    rollout rank, parameter, expected and found checksums."""


class FingerprintArithmeticError(RuntimeError):
    """This device's int32 multiply or sum does not wrap modulo 2**32 (or fails on int32 tensors), so the
    torch path's checksum would be wrong there; the message says what differed and how to turn the check off."""


def chunk_key(q: int) -> int:
    """c(q): chunk q's odd 32-bit key, in [0, 2**32)."""
    return ((q * _CHUNK_MUL + _CHUNK_ADD) & MASK) | 1


def _signed(x: int) -> int:
    """x modulo 2**32 as a signed int32 value (what an int32 tensor holds for it)."""
    x &= MASK
    return x - (1 << 32) if x >> 31 else x


_TABLES: dict[str, torch.Tensor] = {}
_CHUNK_TABLES: dict[str, torch.Tensor] = {}


def key_table(device: torch.device) -> torch.Tensor:
    """K: CHUNK pseudo-random odd 32-bit keys (int32, 16 MiB), drawn once from a fixed seed on the host,
    so every rank and device has the same table."""
    dev = str(device)
    if dev not in _TABLES:
        g = torch.Generator().manual_seed(_KEY_SEED)
        keys = torch.randint(-(1 << 31), 1 << 31, (CHUNK,), generator=g, dtype=torch.int64) | 1
        _TABLES[dev] = keys.to(torch.int32).to(device)
    return _TABLES[dev]


def chunk_table(device: torch.device, n: int) -> torch.Tensor:
    """c(q) for q < n at least (int32, the signed form of each key), per device, grown by powers of two."""
    if n > _MAX_CHUNKS:
        raise ValueError(f"weight fingerprint: a destination of {n} key periods of 2**{_SHIFT} elements "
                         f"(more than {_MAX_CHUNKS}); no parameter is that large")
    dev = str(device)
    have = _CHUNK_TABLES.get(dev)
    if have is None or have.numel() < n:
        size = max(1 << 12, 1 << max(0, n - 1).bit_length())
        q = torch.arange(size, dtype=torch.int64)
        c = ((q * _CHUNK_MUL + _CHUNK_ADD) & MASK) | 1  # q * _CHUNK_MUL < 2**52: exact in int64
        _CHUNK_TABLES[dev] = have = (c - ((c >> 31) << 32)).to(torch.int32).to(device)
    return have


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as a same-shaped integer view: 2-byte types as int16, 4-byte as int32
    (mixed by _mix where they are multiplied)."""
    size = values.element_size()
    if size == 2:
        return values.view(torch.int16)  # int16 x int32 keys promote to int32 products
    if size == 4:
        return values.view(torch.int32)
    raise TypeError(f"weight fingerprint: dtype {values.dtype} is not a 2- or 4-byte type")


def _mix(bits: torch.Tensor) -> torch.Tensor:
    """bits(x) of a 4-byte word w: w ^ (w >>> 16) (a bijection; 2-byte bits pass as they are)."""
    if bits.dtype != torch.int32:
        return bits
    return torch.bitwise_xor(bits, torch.bitwise_and(torch.bitwise_right_shift(bits, 16), 0xFFFF))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return tuple(reversed(out))


def _span(offset: int, shape, strides) -> int:
    """One past the largest destination index of the view."""
    return offset + sum((n - 1) * st for n, st in zip(shape, strides)) + 1


# ---- the torch path ----

PATHS: collections.Counter = collections.Counter()  # pieces summed per kind (tests read it)


def _canonical(bits: torch.Tensor, shape, strides) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The same elements with size-1 dims dropped, dims ordered by destination stride (largest first;
    the order of a sum does not matter) and adjacent dims merged where both the destination and the
    values step through them as one; the last dim has destination stride 1 (a trailing dim of size 1
    is added where none has). Returns (values view, sizes, destination strides)."""
    keep = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -strides[d])
    n: list[int] = []
    D: list[int] = []
    S: list[int] = []
    for d in keep:
        if n and D[-1] == strides[d] * shape[d] and S[-1] == bits.stride(d) * shape[d]:
            n[-1] *= shape[d]
            D[-1], S[-1] = strides[d], bits.stride(d)
        else:
            n.append(shape[d])
            D.append(strides[d])
            S.append(bits.stride(d))
    if not n or D[-1] != 1:
        n.append(1)
        D.append(1)
        S.append(1)
    return bits.as_strided(n, S, bits.storage_offset()), tuple(n), tuple(D)


class _TooMany(Exception):
    pass


@functools.lru_cache(maxsize=1 << 16)  # one entry per distinct box layout of a plan (a few thousand per rank)
def _plan(offset: int, n: tuple[int, ...], D: tuple[int, ...], limit: int, block: int) -> tuple | None:
    """Cut the canonical box (sizes n, destination strides D, D[-1] == 1, at destination ``offset``) into
    pieces that each lie in one key period, so that a piece's keys are a view of the table. A piece is
    (kind, prefix, lo, hi, t, q): indices ``prefix`` of the leading dims, then ``lo:hi`` of the next one;
    ``t`` the table offset of its first element, ``q`` its chunk. Kinds:
    - "slice": part of one row (the last dim) inside one period: keys K[t:t + hi - lo], chunk key c(q);
    - "rows": whole periods of one row (t == 0), as [w, CHUNK]: keys K per period, chunk keys c(q + r);
    - "box": indices lo:hi of dim len(prefix), everything after it: keys K.as_strided(sizes, (D[k] mod
      CHUNK, D[k+1], ...), t); index r of the range lies in chunk q + r * (D[k] div CHUNK).
    None when it takes more than ``limit`` pieces (then each element's key is gathered). A piece has at
    most ``block`` elements (BLOCK) or one index's."""
    m = len(n) - 1
    L = n[m]
    ext = [1] * (m + 2)  # ext[k]: destination extent of dims k.. (all indices before k fixed)
    size = [1] * (m + 2)  # size[k]: elements of dims k..
    for k in range(m, -1, -1):
        ext[k] = ext[k + 1] + (n[k] - 1) * D[k]
        size[k] = size[k + 1] * n[k]
    out: list[tuple] = []

    def emit(item: tuple) -> None:
        out.append(item)
        if len(out) > limit:
            raise _TooMany

    def rec(o: int, prefix: tuple[int, ...], k: int) -> None:
        if k == m:  # one row, destination stride 1
            j = 0
            while j < L:
                t = (o + j) % CHUNK
                if t == 0 and L - j >= CHUNK:
                    w = min((L - j) // CHUNK, max(1, block // CHUNK))
                    emit(("rows", prefix, j, j + w * CHUNK, 0, (o + j) >> _SHIFT))
                    j += w * CHUNK
                else:
                    g = min(L - j, CHUNK - t)
                    emit(("slice", prefix, j, j + g, t, (o + j) >> _SHIFT))
                    j += g
            return
        sub = ext[k + 1]  # extent of one index of dim k
        if sub > CHUNK:  # one index spans more than a period: each on its own
            for i in range(n[k]):
                rec(o + i * D[k], prefix + (i,), k + 1)
            return
        step, per = D[k] % CHUNK, max(1, block // size[k + 1])
        i = 0
        while i < n[k]:
            oi = o + i * D[k]
            t = oi % CHUNK
            if t + sub > CHUNK:  # this index crosses a period boundary
                rec(oi, prefix + (i,), k + 1)
                i += 1
                continue
            # indices i..i+g-1 lie at table offsets t + r * step (r < g) without passing the period's end
            g = n[k] - i if step == 0 else min(n[k] - i, (CHUNK - sub - t) // step + 1)
            g = min(g, per)
            emit(("box", prefix, i, i + g, t, oi >> _SHIFT))
            i += g

    try:
        rec(offset, (), 0)
    except _TooMany:
        return None
    return tuple(out)


def _pieces_sum(view: torch.Tensor, items: tuple, n: tuple[int, ...], D: tuple[int, ...], mix: bool,
                table: torch.Tensor, ctab: torch.Tensor) -> torch.Tensor:
    """sum over the pieces of bits * k, as a 0-dim int32 (wrapping). The chunk keys are views of the
    device's chunk table (no host-to-device copy, which would wait for the device)."""
    sums = []
    for kind, prefix, lo, hi, t, q in items:
        vals = view[prefix + (slice(lo, hi),)]
        cvec = ctab[q]
        if kind == "slice":
            keys = table[t:t + hi - lo]
        elif kind == "rows":
            w, st = (hi - lo) // CHUNK, vals.stride(0)
            vals = vals.as_strided((w, CHUNK), (CHUNK * st, st), vals.storage_offset())
            keys = table.as_strided((w, CHUNK), (0, 1), 0)
            cvec = ctab[q:q + w]
        else:
            k = len(prefix)
            keys = table.as_strided((hi - lo,) + n[k + 1:], (D[k] % CHUNK,) + D[k + 1:], t)
            h = D[k] >> _SHIFT
            if h:
                cvec = ctab[q:q + (hi - lo - 1) * h + 1:h]
        PATHS[kind] += 1
        prod = (_mix(vals) if mix else vals) * keys  # int32 products, wrapping
        if cvec.dim() == 0:
            sums.append(prod.sum(dtype=torch.int32) * cvec)
        else:
            rows = prod.sum(dim=tuple(range(1, prod.dim())), dtype=torch.int32)
            sums.append((rows * cvec).sum(dtype=torch.int32))
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum(dtype=torch.int32)


def _gather_sum(view: torch.Tensor, offset: int, n: tuple[int, ...], D: tuple[int, ...], mix: bool,
                table: torch.Tensor, ctab: torch.Tensor) -> torch.Tensor:
    """The fallback: each element's destination index, its key gathered (K[i mod CHUNK] * c(i div CHUNK)),
    in blocks of the leading dim; a 0-dim int32 (wrapping)."""
    device = view.device
    m = len(n)
    rest = torch.zeros((), dtype=torch.int64, device=device)
    for d in range(1, m):
        shape = [1] * (m - 1)
        shape[d - 1] = n[d]
        rest = rest + (torch.arange(n[d], dtype=torch.int64, device=device) * D[d]).view(shape)
    rows = max(1, BLOCK // max(1, math.prod(n[1:])))
    acc = torch.zeros((), dtype=torch.int32, device=device)
    for a in range(0, n[0], rows):
        b = min(n[0], a + rows)
        index = (torch.arange(a, b, dtype=torch.int64, device=device) * D[0] + offset).view([-1] + [1] * (m - 1)) + rest
        keys = table[index & (CHUNK - 1)] * ctab[index >> _SHIFT]
        PATHS["gather"] += 1
        acc += ((_mix(view[a:b]) if mix else view[a:b]) * keys).sum(dtype=torch.int32)
    return acc


def _torch_checksum(values: torch.Tensor, offset: int, shape, strides, gather: bool = False) -> torch.Tensor:
    """The torch path: C of ``values`` at destination indices offset + sum(i_d * strides[d]), as a 0-dim
    int64 in [0, 2**32)."""
    device = values.device
    _check_wraps(device)
    return _torch_sum(values, offset, shape, strides, gather).to(torch.int64) & MASK


def _torch_sum(values: torch.Tensor, offset: int, shape, strides, gather: bool = False) -> torch.Tensor:
    if values.dim() == 0:
        values, shape, strides = values.reshape(1), (1,), (1,)
    bits = _bits(values)
    view, n, D = _canonical(bits, tuple(shape), tuple(strides))
    table = key_table(values.device)
    ctab = chunk_table(values.device, ((_span(offset, n, D) - 1) >> _SHIFT) + 1)
    mix = bits.dtype == torch.int32
    items = None if gather else _plan(offset, n, D, 16 + math.prod(n) // (1 << 15), BLOCK)
    if items is None:
        return _gather_sum(view, offset, n, D, mix, table, ctab)
    return _pieces_sum(view, items, n, D, mix, table, ctab)


# ---- fail closed where int32 arithmetic does not wrap ----

_WRAPS: dict[str, str] = {}  # device -> "" (wraps) or what differed


def _reference(values: torch.Tensor, index: torch.Tensor) -> int:
    """C by its definition in Python integers (small tensors): values and their destination indices."""
    flat = values.reshape(-1).cpu()
    if flat.element_size() == 2:
        bits = flat.view(torch.int16).tolist()
    else:
        bits = [(w ^ ((w & MASK) >> 16)) for w in flat.view(torch.int32).tolist()]
    idx = index.reshape(-1).tolist()
    table = key_table(torch.device("cpu"))[torch.tensor(idx, dtype=torch.int64) % CHUNK].tolist()
    return sum(b * K * chunk_key(i >> _SHIFT) for b, K, i in zip(bits, table, idx)) & MASK


def _dest_index(shape, strides, offset: int) -> torch.Tensor:
    """Every element's destination index (int64, on the host): small views only (the probe, tests)."""
    index = torch.full((), offset, dtype=torch.int64)
    for d, (n, st) in enumerate(zip(shape, strides)):
        index = index + (torch.arange(n, dtype=torch.int64) * st).view([n] + [1] * (len(shape) - d - 1))
    return index.expand(tuple(shape))


def _probe(device: torch.device) -> str:
    """Run the torch path on small tensors whose int32 products and sums overflow (extreme 2- and 4-byte
    values, boxes in several chunks, each piece kind and the gather) on ``device``; return what differs
    from Python's exact result modulo 2**32 ("" where nothing does)."""
    g = torch.Generator().manual_seed(37)
    meta = torch.empty(3, CHUNK, device="meta")
    cases = []
    for itype, lo, hi, ftype in ((torch.int16, -(1 << 15), 1 << 15, torch.bfloat16),
                                 (torch.int32, -(1 << 31), 1 << 31, torch.float32)):
        w = torch.randint(lo, hi, (3, 1100), generator=g, dtype=torch.int64)
        w[:, :2] = torch.tensor([lo, hi - 1])
        vals = w.to(itype).view(ftype)
        cases += [("receive", vals, None), ("rows in 3 chunks", vals, meta[:, CHUNK - 1100:]),
                  ("a row across a chunk boundary", vals[1], meta.view(-1)[CHUNK - 500:CHUNK + 600]),
                  ("a transposed box", vals[:, :1000].t(), meta[:, 7:1007].t())]
    bad = []
    for what, vals, dest in cases:
        shape = tuple(vals.shape)
        off, strides = (0, _contiguous_strides(shape)) if dest is None else (dest.storage_offset(), dest.stride())
        want = _reference(vals.contiguous(), _dest_index(shape, strides, off).contiguous())
        x = vals.to(device)
        for path in ("pieces", "gather"):
            try:
                got = int(_torch_sum(x, off, shape, strides, gather=path == "gather")) & MASK
            except Exception as e:  # noqa: BLE001 - an op the device lacks for int32 is a refusal too
                bad.append(f"{what} ({x.dtype}, {path}): {type(e).__name__}: {e}")
                continue
            if got != want:
                bad.append(f"{what} ({x.dtype}, {path}): {got:#010x}, exact {want:#010x}")
    return "; ".join(bad)


def _check_wraps(device: torch.device) -> None:
    """Once per device: the torch path's int32 arithmetic wraps modulo 2**32 there, or
    FingerprintArithmeticError (every later call too)."""
    dev = str(device)
    if dev not in _WRAPS:
        _WRAPS[dev] = _probe(device)
    if _WRAPS[dev]:
        raise FingerprintArithmeticError(
            f"weight fingerprint: on {dev} the int32 multiply and sum the checksum relies on do not give the "
            f"exact result modulo 2**32 ({_WRAPS[dev]}), so every checksum computed there could be wrong. "
            "Switch the check off on this device (actor_rollout_ref.rollout.recipe.fingerprint_every=0), or "
            "run it where int32 arithmetic wraps")


def tensor_checksum(t: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """C(t) over t's own flat row-major index, as a 0-dim int64 in [0, 2**32) (no host sync). ``impl``:
    "auto" (the fused kernel where it applies, else torch), "torch", "gather" or "triton" (tests)."""
    shape = tuple(t.shape)
    strides = _contiguous_strides(shape)
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    if _use_fused(t, impl, 0, strides):
        return _fused_checksum(t, strides, 0)
    return _torch_checksum(t, 0, shape, strides, gather=impl == "gather")


def view_checksum(values: torch.Tensor, dest: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """sum(bits(values) * k(flat index in the destination)) mod 2**32, where ``dest`` is a view (of the
    same shape as ``values``) into a meta tensor of the destination's shape: its storage offset and
    strides give each element's flat index there. ``impl`` as in tensor_checksum."""
    if tuple(values.shape) != tuple(dest.shape):
        raise ValueError(f"weight fingerprint: values {tuple(values.shape)} vs destination {tuple(dest.shape)}")
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=values.device)
    offset, strides = dest.storage_offset(), tuple(dest.stride())
    if _use_fused(values, impl, offset, strides):
        return _fused_checksum(values, strides, offset)
    return _torch_checksum(values, offset, tuple(values.shape), strides, gather=impl == "gather")


# ---- the fused kernel (CUDA, Triton): the same integers in one pass ----

_FUSED_DIMS = 4


def _use_fused(values: torch.Tensor, impl: str, offset: int = 0, strides=None) -> bool:
    """Whether ``values`` at these destination indices (default: its own flat index) take the fused kernel."""
    if impl in ("torch", "gather"):
        return False
    strides = _contiguous_strides(tuple(values.shape)) if strides is None else strides
    ok = (values.element_size() == 2 and values.dim() <= _FUSED_DIMS and values.numel() < (1 << 31)
          and _span(offset, values.shape, strides) <= (_MAX_CHUNKS << _SHIFT))
    if impl == "triton":
        if not ok or _fused_kernel() is None:
            raise ValueError(f"weight fingerprint: the fused kernel does not apply to {values.dtype} "
                             f"{tuple(values.shape)} here (Triton {'missing' if _fused_kernel() is None else 'present'})")
        return True
    if impl != "auto":
        raise ValueError(f"weight fingerprint: impl {impl!r} is not auto, torch, gather or triton")
    return ok and values.device.type == "cuda" and values.numel() >= (1 << 16) and _fused_kernel() is not None


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


def _fused_checksum(values: torch.Tensor, strides, offset: int) -> torch.Tensor:
    """The checksum of ``values`` at the flat destination indices ``offset + sum(i_d * strides[d])``,
    through the fused kernel: per-program sums modulo 2**32 (uint32 products, added in int64), added in
    int64 (fewer than 2**31 elements: below 2**63), then taken modulo 2**32."""
    assert _SHIFT == 22 and CHUNK == 4194304  # the constants the kernel spells out
    triton, kern = _fused_kernel()
    ctab = chunk_table(values.device, ((_span(offset, values.shape, strides) - 1) >> _SHIFT) + 1)
    shape, src, dst = list(values.shape), list(values.stride()), list(strides)
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
    kern[(programs,)](values.view(torch.int16), key_table(values.device), ctab, partials, inner, n_blk, shape[1],
                      shape[2], *src, *dst, offset, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return partials.sum() & MASK


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
    expected = expected & MASK  # the int64 sum of values in [0, 2**32), modulo 2**32
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

