"""The reshard's device copies: dst.copy_(src), except transposing copies on CUDA, which go
through a tiled Triton kernel; every method (direct and both baselines) uses the same copies.

Why: torch's generic strided copy reads a transposed bf16 view at a fraction of memory
bandwidth, and Megatron's grouped-GEMM expert weights are transposed relative to vLLM's, so
most bytes of a MoE model take this path. Without Triton (CPU, Ascend) it is plain copy_.
"""

from __future__ import annotations

import functools

import torch

from verl_patches.base import env as overlay_env

# Below this many elements the launch overhead dominates: plain copy_.
_MIN_ELEMS = 1 << 16


@functools.lru_cache(maxsize=1)
def _kernel():
    if not overlay_env.get("VERL_PATCHES_RESHARD_TRITON"):  # the typed table's reader (a bad value names it)
        return None
    try:
        # Lazy: Triton is optional (none on a CPU or an NPU): plain copies without it.
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton (CPU, NPU): plain copies
        return None

    @triton.jit
    def transpose_copy(src, dst, R, C, s_b, s_r, s_c, d_b, d_r, d_c,
                       BR: tl.constexpr, BC: tl.constexpr):
        b = tl.program_id(2).to(tl.int64)
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        c = (tl.program_id(1) * BC + tl.arange(0, BC)).to(tl.int64)
        mask = (r[:, None] < R) & (c[None, :] < C)
        x = tl.load(src + b * s_b + r[:, None] * s_r + c[None, :] * s_c, mask=mask)
        tl.store(dst + b * d_b + r[:, None] * d_r + c[None, :] * d_c, x, mask=mask)

    return triton, transpose_copy


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for same-shape views; a transposing copy (src's second-to-last dim is
    the contiguous one, dst's last) of a CUDA tensor uses the tiled kernel."""
    if (dst.device.type != "cuda" or src.dtype != dst.dtype or src.dim() not in (2, 3)
            or src.numel() < _MIN_ELEMS or src.stride(-2) != 1 or src.stride(-1) == 1
            or dst.stride(-1) != 1 or src.shape != dst.shape):
        dst.copy_(src)
        return
    k = _kernel()
    if k is None:
        dst.copy_(src)
        return
    triton, kern = k
    s3 = src if src.dim() == 3 else src.unsqueeze(0)
    d3 = dst if dst.dim() == 3 else dst.unsqueeze(0)
    B, R, C = s3.shape
    BR, BC = 64, 64
    grid = (triton.cdiv(R, BR), triton.cdiv(C, BC), B)
    kern[grid](s3, d3, R, C, s3.stride(0), s3.stride(1), s3.stride(2), d3.stride(0), d3.stride(1),
               d3.stride(2), BR=BR, BC=BC, num_warps=4)
