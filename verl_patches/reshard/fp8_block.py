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
from typing import Sequence

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
    _, kern = _kernel()
    x = w if w.dim() == 3 else w.unsqueeze(0)
    e, n, k = x.shape
    nb, kb = -(-n // block), -(-k // block)
    q = torch.empty((e, n, k), dtype=torch.uint8, device=w.device)
    scale = torch.empty((e, nb, kb), dtype=torch.float32, device=w.device)
    bad = torch.empty((e, nb, kb), dtype=torch.int32, device=w.device)
    kern[(kb, nb, e)](x, q, scale, bad, n, k, *x.stride(), kb, SCALE_MIN, BLOCK=block, num_warps=8)
    bad = bad.reshape(w.shape[:-2] + (nb, kb))
    if bool(bad.any()):
        raise _nonfinite(w, bad != 0, block, name)
    return q.view(torch.float8_e4m3fn).reshape(w.shape), scale.reshape(w.shape[:-2] + (nb, kb))


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
