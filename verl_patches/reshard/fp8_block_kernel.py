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
def _e4m3_bits(v):
    # e4m3fn rounding in integer arithmetic, for where Triton's cast does not round as the definition does (its
    # lowering, direct or through float16 with a second rounding, has varied between Triton versions and GPUs; the
    # caller probes it once per device: fp8_block._native_cast_exact). |v| < 464 (fp8_block's docstring).
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal e4m3 (|v| >= 2**-6): drop 20 of float32's 23 mantissa bits, round half to even, rebias 127 -> 7 (a
    # carry out of the mantissa moves into the exponent, as it should).
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal e4m3 (m * 2**-9, m = 0..8; 8 is the smallest normal's pattern): |v| * 2**9 is exact, and adding
    # 2**23 rounds it to an integer, half to even, which lands in the low mantissa bits.
    sub = (tl.abs(v) * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) & 0xF
    return (tl.where(mag >= (121 << 23), normal, sub) | sign).to(tl.uint8)


@triton.jit
def _quantize_block(x, q, scale, bad, n, k, sx_e, sx_n, sx_k, e, pn, pk, blk, scale_min, BLOCK: tl.constexpr,
                    ROWS: tl.constexpr, NATIVE_CAST: tl.constexpr):
    # Block (pn, pk) of expert e of x [E, N, K] (any strides) into q (its [E, N, K] uint8 e4m3fn bits, contiguous)
    # and scale[blk], its non-finite count into bad[blk]. Two passes over the block, ROWS rows at a time: the amax,
    # then the quotients (the second pass reads the block again, from L2): a whole 128 x 128 float32 tile in
    # registers spills, and ran at a third of the copy rate on an H200 (docs/benchmarks.md).
    cols = pk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    in_k = cols[None, :] < k
    peak = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    count = tl.zeros((ROWS, BLOCK), dtype=tl.int32)
    for r0 in range(0, BLOCK, ROWS):
        rows = pn * BLOCK + r0 + tl.arange(0, ROWS).to(tl.int64)
        m = (rows[:, None] < n) & in_k
        a = tl.abs(tl.load(x + e * sx_e + rows[:, None] * sx_n + cols[None, :] * sx_k, mask=m, other=0.0)
                   .to(tl.float32))
        # Counted apart from the max: how a max reduction treats NaN is the compiler's choice.
        count += ((a != a) | (a > _FLT_MAX)).to(tl.int32)
        peak = tl.maximum(peak, a)
    amax = tl.max(tl.max(peak, axis=1), axis=0)
    nonfinite = tl.sum(tl.sum(count, axis=1), axis=0)
    s = tl.maximum(_div_rn(amax, 448.0), scale_min)
    s = tl.where(amax == 0.0, 1.0, s)
    for r0 in range(0, BLOCK, ROWS):
        rows = pn * BLOCK + r0 + tl.arange(0, ROWS).to(tl.int64)
        m = (rows[:, None] < n) & in_k
        w = tl.load(x + e * sx_e + rows[:, None] * sx_n + cols[None, :] * sx_k, mask=m, other=0.0).to(tl.float32)
        v = _div_rn(w, s)
        if NATIVE_CAST:
            enc = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            enc = _e4m3_bits(v)
        tl.store(q + (e * n + rows[:, None]) * k + cols[None, :], enc, mask=m)
    tl.store(scale + blk, s)
    tl.store(bad + blk, nonfinite)


@triton.jit
def quantize_blocks(x, q, scale, bad, n, k, sx_e, sx_n, sx_k, n_kblk, scale_min, BLOCK: tl.constexpr,
                    ROWS: tl.constexpr, NATIVE_CAST: tl.constexpr):
    # One tensor, program (kb, nb, e): block (nb, kb) of expert e; scale and bad are [E, ceil(N/BLOCK), n_kblk].
    pk = tl.program_id(0).to(tl.int64)
    pn = tl.program_id(1).to(tl.int64)
    e = tl.program_id(2).to(tl.int64)
    blk = (e * tl.num_programs(1) + pn) * n_kblk + pk
    _quantize_block(x, q, scale, bad, n, k, sx_e, sx_n, sx_k, e, pn, pk, blk, scale_min, BLOCK, ROWS, NATIVE_CAST)


# The columns of quantize_groups' table, one row per tensor (int64): where x, q, scale and bad start, in elements
# from the bases the launch passes (the group's first tensors: plain pointer arithmetic, no integer-to-pointer
# cast), then n, k, x's three strides and its column blocks.
META = ("x", "q", "scale", "bad", "n", "k", "sx_e", "sx_n", "sx_k", "n_kblk")


@triton.jit
def quantize_groups(x_base, q_base, scale_base, bad_base, meta, owner, starts, scale_min, BLOCK: tl.constexpr,
                    ROWS: tl.constexpr, NATIVE_CAST: tl.constexpr):
    # Many tensors of one dtype in one launch (a switch quantises hundreds; one launch each cost more than the
    # kernels on an H200): program p is block p - starts[t] of tensor t = owner[p], its row of meta (META) giving
    # the tensor's offsets, sizes and row stride. Every tensor of a group starts 16 elements aligned, is contiguous in
    # its last dimension, and its K and strides are multiples of 16 (fp8_block._groupable), so the loads and stores
    # vectorise as the one-tensor kernel's do when Triton sees
    # stride 1 (loaded from memory, the stride would be unknown and every access a scalar one: a tenth of the
    # copy rate on an H200).
    p = tl.program_id(0).to(tl.int64)
    t = tl.load(owner + p).to(tl.int64)
    row = meta + t * 10
    n = tl.load(row + 4)
    k = tl.multiple_of(tl.load(row + 5), 16)
    n_kblk = tl.load(row + 9)
    local = p - tl.load(starts + t)
    per_expert = ((n + BLOCK - 1) // BLOCK) * n_kblk
    e = local // per_expert
    pn = (local % per_expert) // n_kblk
    pk = local % n_kblk
    _quantize_block(x_base + tl.multiple_of(tl.load(row), 16), q_base + tl.multiple_of(tl.load(row + 1), 16),
                    scale_base + tl.load(row + 2),
                    bad_base + tl.load(row + 3), n, k, tl.multiple_of(tl.load(row + 6), 16),
                    tl.multiple_of(tl.load(row + 7), 16), 1, e, pn, pk, local, scale_min, BLOCK, ROWS, NATIVE_CAST)
