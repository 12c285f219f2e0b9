"""The weight fingerprint's fused kernel (CUDA, Triton): verl_patches/reshard/checksum.py's checksum of
2-byte values at their destination indices in one pass. Imported only where Triton is (checksum.py's
_fused_kernel); its constants are checksum.py's (CHUNK = 2**22 keys; the chunk keys come as a table).
"""

import triton
import triton.language as tl


@triton.jit
def fingerprint_partials(x, table, chunk_keys, out, n_inner, n_blk, s1, s2, a0, a1, a2, a3, d0, d1, d2, d3, doff,
                         BLOCK: tl.constexpr):
    # One program: BLOCK elements of one row of the innermost (source-contiguous) dimension.
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_blk
    blk = pid - row * n_blk
    i2 = row % s2
    r = row // s2
    i1 = r % s1
    i0 = r // s1
    j = blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = j < n_inner
    b = tl.load(x + (i0 * a0 + i1 * a1 + i2 * a2) + j * a3, mask=m, other=0).to(tl.int32)  # int16, sign-extended
    d = (doff + i0 * d0 + i1 * d1 + i2 * d2) + j * d3
    key = tl.load(table + (d & 4194303), mask=m, other=0)  # K[d mod 2**22]
    ck = tl.load(chunk_keys + (d >> 22), mask=m, other=0)  # c(d div 2**22)
    # k = K * c and bits * k modulo 2**32: unsigned 32-bit products, which wrap by definition.
    k = key.to(tl.uint32, bitcast=True) * ck.to(tl.uint32, bitcast=True)
    p = b.to(tl.uint32, bitcast=True) * k
    # The program's sum of BLOCK (<= 4096) values below 2**32 in int64 (zero-extended), then modulo 2**32.
    s = tl.sum(p.to(tl.int64), axis=0)
    tl.store(out + pid, s - ((s >> 32) << 32))
