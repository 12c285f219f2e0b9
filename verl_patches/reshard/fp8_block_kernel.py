"""FP8 block quantisation's fused kernel (CUDA, Triton): verl_patches/reshard/fp8_block.py's definition in one pass,
one program per block. Imported only where Triton is (fp8_block._kernel); SCALE_MIN comes as an argument.
"""

import triton
import triton.language as tl

_FLT_MAX = tl.constexpr(3.4028234663852886e38)  # float32 max: above it is only inf


@triton.jit
def _div_rn(a, b):
    # PTX div.rn.f32: IEEE division rounded to nearest even, subnormals kept. Triton's "/" on float32 is approximate,
    # and tl.div_rn lowers to div.rn.ftz.f32 (Triton 3.1), which flushes the subnormals this format must keep.
    return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def quantize_blocks(x, q, scale, bad, n, k, sx_e, sx_n, sx_k, n_kblk, scale_min, BLOCK: tl.constexpr):
    # Program (kb, nb, e): block (nb, kb) of expert e of x [E, N, K] (any strides); q is [E, N, K] uint8 (the
    # e4m3fn bits), scale and bad [E, ceil(N/BLOCK), ceil(K/BLOCK)].
    pk = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    rows = pn.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    cols = pk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = (rows[:, None] < n) & (cols[None, :] < k)
    w = tl.load(x + e * sx_e + rows[:, None] * sx_n + cols[None, :] * sx_k, mask=m, other=0.0).to(tl.float32)
    a = tl.abs(w)
    # Counted apart from the max: how a max reduction treats NaN is the compiler's choice.
    nonfinite = tl.sum(tl.sum(((a != a) | (a > _FLT_MAX)).to(tl.int32), axis=1), axis=0)
    amax = tl.max(tl.max(a, axis=1), axis=0)
    s = tl.maximum(_div_rn(amax, 448.0), scale_min)
    s = tl.where(amax == 0.0, 1.0, s)
    v = _div_rn(w, s)
    # e4m3fn rounding in integer arithmetic rather than Triton's cast, whose lowering (direct, or through float16
    # with a second rounding) has varied between Triton versions and GPUs. |v| < 464 (fp8_block's docstring).
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal e4m3 (|v| >= 2**-6): drop 20 of float32's 23 mantissa bits, round half to even, rebias 127 -> 7 (a
    # carry out of the mantissa moves into the exponent, as it should).
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal e4m3 (m * 2**-9, m = 0..8; 8 is the smallest normal's pattern): |v| * 2**9 is exact, and adding
    # 2**23 rounds it to an integer, half to even, which lands in the low mantissa bits.
    sub = (tl.abs(v) * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) & 0xF
    enc = tl.where(mag >= (121 << 23), normal, sub) | sign
    tl.store(q + (e * n + rows[:, None]) * k + cols[None, :], enc.to(tl.uint8), mask=m)
    blk = (e * tl.num_programs(1) + pn) * n_kblk + pk
    tl.store(scale + blk, s)
    tl.store(bad + blk, nonfinite)
