"""FP8 block-wise quantisation of a weight update (issue 46): BF16 or FP32 weights to DeepSeek-V3's released format,
float8_e4m3fn values and one float32 ``weight_scale_inv`` per 128 x 128 block, on any device (the torch path) or fused.

The format is the one verl_patches/tools/fp8_to_bf16.py reads back (``dequantize``: value = fp8 * scale_inv of its
block; BLOCK is the same 128). For a block B of W (edge blocks hold the elements present, fewer than 128 x 128):

    amax      = max |w| over B, in float32 (the upcast of a bf16 value is exact; abs and max are exact)
    scale_inv = 1.0                                  if amax == 0 (an all-zero block, signed zeros included)
                max(amax / 448, SCALE_MIN)           otherwise; "/" is IEEE float32 division rounded to nearest even
    fp8       = e4m3fn(w / scale_inv)                "/" the same IEEE float32 division, per element

e4m3fn(q) rounds the float32 q to the nearest e4m3fn value (1 sign, 4 exponent bits with bias 7, 3 mantissa bits,
subnormals m * 2**-9, largest finite 448, no infinity), ties to the even mantissa, keeping the sign of q (so -0.0 and
small negatives give 0x80). That is torch's cast to float8_e4m3fn below 464; torch does not saturate: from just
above 464 (448's tie with 480, which would be the NaN pattern) it gives NaN (0x7F / 0xFF). This definition never
gets there: with scale_inv >= SCALE_MIN = 2**-145 = 16 float32 subnormal steps, scale_inv is amax / 448 to within a
relative 1/32, so |w / scale_inv| <= 448 * 32 / 31 < 463 (and <= 448 * (1 + 2**-23) once scale_inv is normal, any
amax >= 448 * 2**-126). SCALE_MIN matters only for FP32 inputs whose block amax is below about 1e-41: a bf16 value
is at least 2**-133, so a bf16 block's amax / 448 rounds to at least 146 subnormal steps and is never clamped.

The zero block's 1.0: any positive scale dequantises the block to exact zeros; 1.0 is exact, keeps 1 / scale_inv
finite for kernels that take the reciprocal, and is not a subnormal a flush-to-zero kernel would turn into 0. (The
released checkpoint's own zero blocks, if any, were not read here. DeepGEMM's per_block_cast_to_fp8 test helper
clamps amax to 1e-4, which gives a zero block 1e-4 / 448 and moves every block below 1e-4 too; this definition keeps
amax / 448 for every non-zero bf16 block.)
Refused, before anything is returned, with the tensor's name: a NaN or an infinity anywhere (NonFiniteWeightError,
naming the first such block in row-major block order and the counts: a quantised NaN would be silent corruption),
dtypes other than bfloat16 and float32, and shapes other than [N, K] and stacked experts [E, N, K] (blocked per
expert). block_splits / check_block_aligned tell whether a sharded layout cuts a block (each shard's scales are then
not a slice of the whole tensor's). The fused path (CUDA, Triton: fp8_block_kernel.py) gives the same bits.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

BLOCK = 128  # tools/fp8_to_bf16.BLOCK: DeepSeek-V3's weight_block_size [128, 128]
E4M3_MAX = 448.0
SCALE_MIN = 2.0 ** -145
_DTYPES = (torch.bfloat16, torch.float32)
BACKENDS = ("auto", "torch", "triton")


class NonFiniteWeightError(ValueError):
    """A weight to quantise holds NaN or +-inf; the message names the tensor, the first such block and the counts."""


class BlockSplitError(ValueError):
    """A layout cuts a quantisation block between shards; the message names the tensor, the dimension and the layout."""


def quantize_block_fp8(w: torch.Tensor, block: int = BLOCK, name: str = "weight",
                       backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [.., N, K] float8_e4m3fn, scale_inv [.., ceil(N/block), ceil(K/block)] float32) of ``w`` ([N, K] or
    [E, N, K], bfloat16 or float32), by the module's definition. ``backend``: "auto" (the fused kernel on CUDA where
    Triton imports and the block is a power of two, else torch), "torch" (every device's path) or "triton"."""
    if backend not in BACKENDS:
        raise ValueError(f"{name}: FP8 quantisation backend {backend!r} is not one of {BACKENDS}")
    if w.dtype not in _DTYPES:
        raise ValueError(f"{name}: FP8 quantisation takes bfloat16 or float32 weights, got {w.dtype}")
    if w.dim() not in (2, 3):
        raise ValueError(f"{name}: FP8 quantisation takes [N, K] or stacked experts [E, N, K], got shape "
                         f"{tuple(w.shape)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{name}: block must be a positive int, got {block!r}")
    *lead, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    if w.numel() == 0:
        return (torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device),
                torch.ones(*lead, nb, kb, dtype=torch.float32, device=w.device))
    if _use_fused(w, block, backend, name):
        return _fused(w, block, name)
    return _torch_path(w, block, name)


def _torch_path(w: torch.Tensor, block: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    # Zero padding leaves every edge block's amax that of the elements present (|w| >= 0).
    x = w if n == nb * block and k == kb * block else F.pad(w, (0, kb * block - k, 0, nb * block - n))
    x = x.reshape(*lead, nb, block, kb, block)
    # In the input dtype: abs and max are exact there, and a NaN or an inf reaches the block's amax (torch's amax
    # propagates NaN), so the finiteness check costs no pass of its own.
    amax = x.abs().amax(dim=(-3, -1)).float()
    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        raise _nonfinite(w, bad, block, name)
    # Both divisions by a tensor on w's device: CUDA's torch divides by a CPU scalar as a multiplication by its
    # reciprocal (not IEEE division, one bit off at times).
    scale = torch.div(amax, torch.full_like(amax, E4M3_MAX))
    scale = torch.where(amax == 0, torch.ones_like(scale), scale.clamp(min=SCALE_MIN))
    q = torch.div(x, scale[..., :, None, :, None]).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, nb * block, kb * block)
    if q.shape[-2:] != (n, k):
        q = q[..., :n, :k].contiguous()
    return q, scale


def _nonfinite(w: torch.Tensor, bad_blocks: torch.Tensor, block: int, name: str) -> NonFiniteWeightError:
    first = tuple(int(i) for i in bad_blocks.nonzero()[0])
    *e, i, j = first
    region = w[tuple(e)] if e else w
    region = region[i * block:(i + 1) * block, j * block:(j + 1) * block]
    in_block = int((~torch.isfinite(region)).sum())
    nan, inf = int(torch.isnan(w).sum()), int(torch.isinf(w).sum())
    return NonFiniteWeightError(
        f"{name}: {nan} NaN and {inf} infinite value(s) in {tuple(w.shape)} {w.dtype}, in {int(bad_blocks.sum())} "
        f"of its {bad_blocks.numel()} {block}x{block} blocks; the first is block {first} "
        f"(elements [{''.join(f'{x}, ' for x in e)}{i * block}:{i * block + region.shape[0]}, "
        f"{j * block}:{j * block + region.shape[1]}]), holding {in_block} of them; not quantised (FP8 would carry "
        f"them as NaN)")


# ---- the fused path (CUDA, Triton): the same bits in one pass ----

def _use_fused(w: torch.Tensor, block: int, backend: str, name: str) -> bool:
    if backend == "torch":
        return False
    # The grid is (column blocks, row blocks, experts): CUDA allows 65535 in its last two dimensions.
    grid_ok = -(-w.shape[-2] // block) <= 65535 and (w.dim() == 2 or w.shape[0] <= 65535)
    applies = w.device.type == "cuda" and block & (block - 1) == 0 and 16 <= block <= 256 and grid_ok
    if backend == "triton":
        if not applies or _kernel() is None:
            raise ValueError(f"{name}: the fused FP8 quantisation needs a CUDA tensor, Triton, a power-of-two "
                             f"block in [16, 256] and at most 65535 row blocks and experts; here: device {w.device}, "
                             f"block {block}, shape {tuple(w.shape)}, Triton "
                             f"{'missing' if _kernel() is None else 'present'}")
        return True
    return applies and _kernel() is not None


def fused_available(device: torch.device | str) -> bool:
    """Whether quantize_block_fp8(backend="auto") takes the fused kernel on ``device`` (at block 128)."""
    return torch.device(device).type == "cuda" and _kernel() is not None


@functools.lru_cache(maxsize=1)
def _kernel():
    # Lazy: Triton is optional (none on an NPU or a CPU-only build), and fp8_block_kernel defines its kernel with
    # Triton at its head (tests/test_import_graph.py, LAZY_OWN).
    try:
        import triton
        from verl_patches.reshard.fp8_block_kernel import quantize_blocks
    except Exception:  # noqa: BLE001 - no Triton (NPU, a CPU-only build): the torch path
        return None
    return triton, quantize_blocks


def _fused(w: torch.Tensor, block: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    nb, kb = -(-w.shape[-2] // block), -(-w.shape[-1] // block)
    bad = torch.empty(w.shape[:-2] + (nb, kb), dtype=torch.int32, device=w.device)
    q, scale = _fused_into(w, block, bad)
    if bool(bad.any()):
        raise _nonfinite(w, bad != 0, block, name)
    return q, scale


def _fused_into(w: torch.Tensor, block: int, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch; the blocks' non-finite counts land in ``bad`` (shape [.., nb, kb]) for the caller to check."""
    _, kern = _kernel()
    x = w if w.dim() == 3 else w.unsqueeze(0)
    e, n, k = x.shape
    nb, kb = -(-n // block), -(-k // block)
    q = torch.empty((e, n, k), dtype=torch.uint8, device=w.device)
    scale = torch.empty((e, nb, kb), dtype=torch.float32, device=w.device)
    launch(kern, x, q, scale, bad.view(e, nb, kb), block, native_cast=_native_cast_exact(w.device))
    return q.view(torch.float8_e4m3fn).reshape(w.shape), scale.reshape(w.shape[:-2] + (nb, kb))


def quantize_many(weights: Mapping[str, torch.Tensor], block: int = BLOCK,
                  backend: str = "auto") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``quantize_block_fp8`` of each named weight, refusing non-finite values as it does (naming the first such
    weight) before anything is returned: ``BlockQuantizer(weights, block, backend)()``."""
    return BlockQuantizer(weights, block, backend)()


class BlockQuantizer:
    """The FP8 quantisation of a fixed set of named weights, planned once and run at every switch (as the reshard
    plan is): the outputs and, on the fused path, the launch tables are built here; each call is one launch per
    input dtype (aligned tensors: ``_groupable``; any other takes a launch of its own) and one host synchronisation
    for the finiteness check of all of them. A switch quantises hundreds of tensors: on an H200, a launch and a
    check each, or rebuilding the tables each time, cost more than the kernels (docs/benchmarks.md). Where an
    input's storage moved since the last call, its table row is rebuilt; its outputs stay where they are.

    Example:
        quant = BlockQuantizer(train_weights)      # once
        fp8 = quant()                              # every switch: {name: (fp8, scale_inv)}, the same tensors
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], block: int = BLOCK, backend: str = "auto") -> None:
        self.weights, self.block, self.backend = dict(weights), block, backend
        self.fused = [n for n, w in self.weights.items() if w.numel() and w.dim() in (2, 3) and w.dtype in _DTYPES
                      and _use_fused(w, block, backend, n)]
        self.out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.flags: dict[str, torch.Tensor] = {}
        self.groups: list[dict[str, Any]] = []
        if not self.fused:
            return
        device = self.weights[self.fused[0]].device
        grids = {n: _grid(self.weights[n], block) for n in self.fused}
        self._flat = torch.zeros(sum(e * nb * kb for e, nb, kb in grids.values()), dtype=torch.int32, device=device)
        off = 0
        for n in self.fused:
            w, (e, nb, kb) = self.weights[n], grids[n]
            self.flags[n] = self._flat[off:off + e * nb * kb].view(w.shape[:-2] + (nb, kb))
            off += e * nb * kb
            q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=device)
            self.out[n] = (q, torch.empty(w.shape[:-2] + (nb, kb), dtype=torch.float32, device=device))
        for dtype in _DTYPES:
            names = [n for n in self.fused if self.weights[n].dtype == dtype and _groupable(self.weights[n])]
            if names:
                self.groups.append(self._group(names, grids))
        grouped = {n for g in self.groups for n in g["names"]}
        self.alone = [n for n in self.fused if n not in grouped]

    def _group(self, names: list[str], grids: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
        device = self.weights[names[0]].device
        starts = [0]
        for n in names:
            e, nb, kb = grids[n]
            starts.append(starts[-1] + e * nb * kb)
        counts = torch.tensor([b - a for a, b in zip(starts, starts[1:])], device=device)
        owner = torch.repeat_interleave(torch.arange(len(names), dtype=torch.int32, device=device), counts,
                                        output_size=starts[-1])
        group = {"names": names, "starts": torch.tensor(starts, dtype=torch.int64, device=device), "owner": owner,
                 "blocks": starts[-1], "grids": grids, "ptrs": None}
        self._table(group)
        return group

    def _operands(self, n: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        w, (q, scale) = self.weights[n], self.out[n]
        x = w if w.dim() == 3 else w.unsqueeze(0)
        return x, q.view(torch.uint8).view(x.shape), scale.view(x.shape[0], *scale.shape[-2:]), self.flags[n]

    def _table(self, group: dict[str, Any]) -> None:
        """The launch table's rows (offsets in elements from the group's first tensors: the caching allocator aligns
        every block far beyond an element, and _groupable checks each input), rebuilt where an input moved."""
        ptrs = tuple(self.weights[n].data_ptr() for n in group["names"])
        if ptrs == group["ptrs"]:
            return
        ops = [self._operands(n) for n in group["names"]]
        bases = ops[0]
        rows = [[(t.data_ptr() - b.data_ptr()) // t.element_size() for t, b in zip(o, bases)]
                + [o[0].shape[1], o[0].shape[2], *o[0].stride(), group["grids"][n][2]]
                for n, o in zip(group["names"], ops)]
        group.update(meta=torch.tensor(rows, dtype=torch.int64).to(bases[0].device), bases=bases, ptrs=ptrs)

    def __call__(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Quantise every weight as it is now; NonFiniteWeightError (the first such weight named) before returning."""
        if self.fused:
            _, kern = _group_kernel()
            for group in self.groups:
                self._table(group)
                device = group["bases"][0].device
                kern[(group["blocks"],)](*group["bases"], group["meta"], group["owner"], group["starts"], SCALE_MIN,
                                         BLOCK=self.block, ROWS=min(FUSED_ROWS, self.block),
                                         NATIVE_CAST=_native_cast_exact(device), num_warps=FUSED_WARPS)
            _, kern = _kernel()
            for n in self.alone:
                x, q, scale, bad = self._operands(n)
                launch(kern, x, q, scale, bad.view(scale.shape), self.block,
                       native_cast=_native_cast_exact(x.device))
            if bool(self._flat.any()):
                first = next(n for n in self.fused if bool(self.flags[n].any()))
                raise _nonfinite(self.weights[first], self.flags[first] != 0, self.block, first)
        rest = {n: quantize_block_fp8(w, block=self.block, name=n,
                                      backend="torch" if self.backend == "auto" else self.backend)
                for n, w in self.weights.items() if n not in self.out}
        return {n: self.out[n] if n in self.out else rest[n] for n in self.weights}


def _groupable(w: torch.Tensor) -> bool:
    """What the grouped kernel assumes of a tensor: it starts 16 elements aligned, is contiguous in its last
    dimension, and K and the other strides are multiples of 16 elements (DeepSeek-V3's weights all are)."""
    x = w if w.dim() == 3 else w.unsqueeze(0)
    return x.data_ptr() % (16 * x.element_size()) == 0 and x.stride(2) == 1 and x.shape[2] % 16 == 0 \
        and x.stride(1) % 16 == 0 and (x.stride(0) % 16 == 0 or x.shape[0] == 1)


def _grid(w: torch.Tensor, block: int) -> tuple[int, int, int]:
    return (w.shape[0] if w.dim() == 3 else 1), -(-w.shape[-2] // block), -(-w.shape[-1] // block)


@functools.lru_cache(maxsize=1)
def _group_kernel():
    # Lazy, as _kernel: Triton is optional.
    from verl_patches.reshard.fp8_block_kernel import quantize_groups

    return _kernel()[0], quantize_groups


# Rows per pass of the fused kernel and its warps: the fastest of 8/16/32 rows x 4/8 warps on an H200 (0.79 of the
# copy rate on the expert shapes; docs/benchmarks.md).
FUSED_ROWS, FUSED_WARPS = 32, 8


def launch(kern, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bad: torch.Tensor, block: int,
           native_cast: bool) -> Any:
    """One launch of the fused kernel on x [E, N, K]; returns Triton's compiled-kernel handle."""
    e, n, k = x.shape
    kb = -(-k // block)
    return kern[(kb, -(-n // block), e)](x, q, scale, bad, n, k, *x.stride(), kb, SCALE_MIN, BLOCK=block,
                                         ROWS=min(FUSED_ROWS, block), NATIVE_CAST=native_cast,
                                         num_warps=FUSED_WARPS)


def rounding_probe(device: torch.device | str) -> torch.Tensor:
    """A float32 block whose amax is 448 (so the scale is exactly 1 and each quotient is the value itself) holding
    every e4m3fn value, every midpoint between two neighbours (the ties), one float32 step either side of each
    midpoint, the subnormal range's edges and both zeros: every way a float32 -> e4m3fn cast can round."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # the finite non-negative patterns, 0 .. 448
    vals = codes.view(torch.float8_e4m3fn).float()
    mids = (vals[:-1] + vals[1:]) / 2  # exact in float32
    near = torch.cat([mids.nextafter(torch.zeros_like(mids)), mids.nextafter(torch.full_like(mids, 1e9))])
    tiny = torch.tensor([2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11, 2.0 ** -149, 0.0])
    pos = torch.cat([torch.tensor([448.0]), vals, mids, near, tiny])
    flat = torch.cat([pos, -pos, torch.tensor([-0.0])])
    block = torch.zeros(BLOCK * BLOCK, dtype=torch.float32)
    block[:flat.numel()] = flat
    return block.view(BLOCK, BLOCK).to(device)


@functools.lru_cache(maxsize=None)
def _native_cast_exact(device: torch.device) -> bool:
    """Whether Triton's float32 -> e4m3fn cast on this device rounds as the definition does (to nearest, ties to
    even, subnormals kept), checked once per device on ``rounding_probe`` against the torch path; where it does not,
    the kernel encodes in integer arithmetic (the same bits, slower)."""
    _, kern = _kernel()
    x = rounding_probe(device).unsqueeze(0)
    want, _ = quantize_block_fp8(x[0], backend="torch")
    q = torch.empty(x.shape, dtype=torch.uint8, device=device)
    scale = torch.empty(1, 1, 1, dtype=torch.float32, device=device)
    bad = torch.empty(1, 1, 1, dtype=torch.int32, device=device)
    launch(kern, x, q, scale, bad, BLOCK, native_cast=True)
    return bool(torch.equal(q[0], want.view(torch.uint8))) and float(scale) == 1.0


# ---- layouts: does a sharding cut a block? ----

def block_splits(size: int, shards: Sequence[int] | Sequence[tuple[int, int]], block: int = BLOCK) -> list[int]:
    """The cut points of a dimension of ``size`` elements that fall inside a quantisation block (not a multiple of
    ``block``, not the end): empty when every shard's scales are a slice of the whole tensor's. ``shards`` are the
    shards' sizes in order (summing to ``size``) or their (start, stop) ranges."""
    if not shards:
        return []
    if all(isinstance(s, int) and not isinstance(s, bool) for s in shards):
        if any(s < 0 for s in shards) or sum(shards) != size:
            raise ValueError(f"shard sizes {list(shards)} do not add up to the dimension's {size}")
        cuts, at = set(), 0
        for s in shards:
            at += s
            cuts.add(at)
    else:
        cuts = set()
        for r in shards:
            a, b = r
            if not 0 <= a <= b <= size:
                raise ValueError(f"shard range {r} is not inside [0, {size}]")
            cuts.update((a, b))
    return sorted(c for c in cuts if 0 < c < size and c % block)


def check_block_aligned(name: str, dim: int, size: int, shards, layout: str, block: int = BLOCK) -> None:
    """Raise BlockSplitError naming ``name``, ``dim`` and ``layout`` when the shards cut a quantisation block."""
    cuts = block_splits(size, shards, block)
    if cuts:
        c = cuts[0]
        raise BlockSplitError(f"{name}: layout {layout} cuts dimension {dim} ({size} elements) at {c}, inside the "
                              f"{block}-element block [{c // block * block}, {min(size, (c // block + 1) * block)}) "
                              f"of its FP8 scales ({len(cuts)} cut(s) off the block grid: {cuts[:4]}); shard it on "
                              f"multiples of {block}")
