"""FP8 block quantisation (verl_patches/reshard/fp8_block.py) against a reference written here from the published
format: block amax and both divisions in numpy float32 (IEEE, round to nearest even), e4m3fn rounding by a search
of the 256 bit patterns (no torch cast), compared bit for bit; the round trip through tools/fp8_to_bf16's dequantize
within the format's error bound; refusals by name; block_splits on sharded layouts.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from verl_patches.reshard import fp8_block
from verl_patches.reshard.fp8_block import (BlockSplitError, NonFiniteWeightError, block_splits, check_block_aligned,
                                            quantize_block_fp8)
from verl_patches.tools import fp8_to_bf16

BF16_MAX = float(torch.finfo(torch.bfloat16).max)  # (2 - 2**-7) * 2**127 = 3.3895e38
BF16_TINY = 2.0 ** -133  # the smallest bf16 subnormal


# ---- the reference, from the format's definition ----

def _e4m3fn_value(bits: int) -> float:
    """The value of an e4m3fn bit pattern: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinity,
    S.1111.111 is NaN, exponent 0 holds the subnormals m * 2**-9."""
    sign = -1.0 if bits & 0x80 else 1.0
    e, m = (bits >> 3) & 0xF, bits & 0x7
    if e == 15 and m == 7:
        return float("nan")
    return sign * (m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


TABLE = np.array([_e4m3fn_value(b) for b in range(256)])
POS = TABLE[:0x7F]  # patterns 0x00..0x7E: the non-negative finite values, increasing with the pattern
assert np.all(np.diff(POS) > 0) and POS[-1] == 448.0 and np.isnan(TABLE[0x7F]) and np.isnan(TABLE[0xFF])


def ref_e4m3fn(q: np.ndarray) -> np.ndarray:
    """Bit patterns (uint8) of float32 ``q`` rounded to the nearest e4m3fn value, ties to the even pattern (its low
    bit is the mantissa's), the sign kept (negative zero too)."""
    mag = np.abs(q.astype(np.float64))
    assert mag.max(initial=0) < 464, "a quotient past 464: the definition promises none"
    hi = np.clip(np.searchsorted(POS, mag), 1, len(POS) - 1)  # POS[hi - 1] < mag <= POS[hi], or the ends
    lo = hi - 1
    d_lo, d_hi = mag - POS[lo], POS[hi] - mag
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return (np.where(up, hi, lo) | np.where(np.signbit(q), 0x80, 0)).astype(np.uint8)


def ref_quantize(w: torch.Tensor, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3fn bits, float32 scale_inv) of ``w`` ([.., N, K]) by the published definition, in numpy float32."""
    x = w.float().numpy()  # bf16 -> float32 is exact
    *lead, n, k = x.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = np.zeros((*lead, nb * block, kb * block), np.float32)
    padded[..., :n, :k] = x
    blocks = padded.reshape(*lead, nb, block, kb, block)
    amax = np.abs(blocks).max(axis=(-3, -1))
    with np.errstate(under="ignore"):
        scale = np.maximum(amax / np.float32(448), np.float32(2.0 ** -145))
        scale = np.where(amax == 0, np.float32(1.0), scale).astype(np.float32)
        q = blocks / scale[..., :, None, :, None]
    assert q.dtype == np.float32 and scale.dtype == np.float32
    bits = ref_e4m3fn(q).reshape(*lead, nb * block, kb * block)[..., :n, :k]
    return bits, scale


def assert_bits_equal(w: torch.Tensor, block: int = 128, **kw):
    q, s = quantize_block_fp8(w, block=block, **kw)
    want_q, want_s = ref_quantize(w.cpu(), block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.dtype == torch.float32
    got_q, got_s = q.cpu().view(torch.uint8).numpy(), s.cpu().view(torch.int32).numpy()
    assert got_s.shape == want_s.shape
    bad = np.argwhere(got_s != want_s.view(np.int32))
    assert not len(bad), f"scale_inv differs at {len(bad)} blocks, first {tuple(bad[0])}: " \
        f"{got_s.view(np.float32)[tuple(bad[0])]!r} vs {want_s[tuple(bad[0])]!r}"
    bad = np.argwhere(got_q != want_q)
    assert not len(bad), f"fp8 differs at {len(bad)} elements, first {tuple(bad[0])}: " \
        f"{got_q[tuple(bad[0])]:#04x} vs {want_q[tuple(bad[0])]:#04x} (w = {w[tuple(bad[0])].item()!r})"
    return q, s


# ---- the cases (tests/reshard/test_fp8_block_gpu.py runs them on the fused kernel) ----

def random_weight(shape, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Weight-like values: normal, rows of different scale, heavy-tailed outliers."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02 * torch.exp(torch.randn(shape[:-1] + (1,), generator=g) * 0.5)
    outliers = torch.rand(shape, generator=g) < 1e-3
    return torch.where(outliers, w * 50, w).to(dtype)


RANDOM_SHAPES = [(129, 300), (1, 1), (127, 129), (256, 7168), (3, 257, 130)]


def special_blocks() -> torch.Tensor:
    """A [256, 384] bf16 weight, one 128 x 128 block per case."""
    g = torch.Generator().manual_seed(7)

    def normal(std: float) -> torch.Tensor:
        return (torch.randn(128, 128, generator=g) * std).bfloat16().float()

    w = torch.zeros(256, 384)
    blk = [[w[r:r + 128, c:c + 128] for c in (0, 128, 256)] for r in (0, 128)]
    # (0, 0): all zero, a quarter of them negative zeros.
    blk[0][0][::4] = -0.0
    # (0, 1): bf16 subnormals only (k * 2**-133, k < 128): a subnormal float32 scale.
    blk[0][1].copy_(torch.randint(-127, 128, (128, 128), generator=g) * BF16_TINY)
    # (0, 2): the largest finite bf16 values beside ordinary ones.
    blk[0][2].copy_(normal(1.0))
    blk[0][2][0, :4] = torch.tensor([BF16_MAX, -BF16_MAX, BF16_MAX, 1.0])
    # (1, 0): amax 448 * 3, every value 3 * an e4m3fn value: scale 3.0 and an exact round trip.
    finite = torch.tensor(TABLE[np.isfinite(TABLE)], dtype=torch.float32)
    blk[1][0].copy_((finite[torch.randint(0, len(finite), (128, 128), generator=g)] * 3))
    blk[1][0][0, 0] = 448 * 3
    # (1, 1): amax 448 (scale 1.0), every value halfway between two neighbouring e4m3fn values, both signs, the
    # subnormal ones (2**-10, 3 * 2**-10, ...) included: bf16 holds these midpoints exactly.
    mids = torch.tensor((POS[1:] + POS[:-1]) / 2, dtype=torch.float32)
    picks = mids[torch.randint(0, len(mids), (128, 128), generator=g)]
    blk[1][1].copy_(picks * torch.where(torch.rand(128, 128, generator=g) < 0.5, -1.0, 1.0))
    blk[1][1][0, 0] = 448.0
    # (1, 2): one outlier over tiny values, most below e4m3's subnormals, negative zeros, bf16 subnormals.
    blk[1][2].copy_(normal(1e-3))
    blk[1][2][0, 0] = 100.0
    blk[1][2][1, :8] = torch.tensor([-0.0, BF16_TINY, -BF16_TINY, 2.0 ** -120, -2.0 ** -100, 0.0, -0.0, 2.0 ** -127])
    out = w.to(torch.bfloat16)
    assert torch.equal(out.float(), w), "every value chosen is a bf16 value (the midpoints above must stay exact)"
    return out


def tiny_scales_fp32() -> torch.Tensor:
    """float32 [M, 1] of subnormal magnitudes k * 2**-149, quantised with block 1: every k below 2**16 and a sample
    up to 2**23 (where amax / 448 rounds to few subnormal steps and SCALE_MIN decides)."""
    k = np.concatenate([np.arange(1, 1 << 16), np.arange(1 << 16, 1 << 23, 97)]).astype(np.float64)
    sign = np.where(np.arange(len(k)) % 3 == 0, -1.0, 1.0)
    return torch.from_numpy((sign * k * 2.0 ** -149).astype(np.float32)).reshape(-1, 1)


# ---- bit for bit against the reference ----

@pytest.mark.parametrize("shape", RANDOM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_random_shapes_equal_the_reference_bit_for_bit(shape):
    assert_bits_equal(random_weight(shape, seed=sum(shape)))


def test_special_blocks_equal_the_reference_bit_for_bit():
    w = special_blocks()
    q, s = assert_bits_equal(w)
    bits = q.view(torch.uint8)
    assert s[0, 0].item() == 1.0 and set(bits[:128, :128].unique().tolist()) == {0x00, 0x80}  # signed zeros kept
    assert 0 < s[0, 1].item() < torch.finfo(torch.float32).tiny  # a subnormal scale, kept
    assert s[1, 0].item() == 3.0 and s[1, 1].item() == 1.0
    # The ties went both ways (to the even pattern): rounding away from zero alone, or toward it, would fail here.
    tie_q = bits[128:, 128:256].to(torch.int64) & 0x7F
    assert (tie_q % 2 == 0).all()
    assert torch.equal(fp8_to_bf16.dequantize(q[128:, :128], s[1:, :1]), w[128:, :128])  # 448 * k: exact


def test_the_rounding_probe_holds_every_case_and_rounds_as_the_reference():
    """The block the fused kernel's native cast is probed on (fp8_block.rounding_probe): scale exactly 1, every
    e4m3fn value and every tie between neighbours with both signs; the torch path rounds it as the reference."""
    probe = fp8_block.rounding_probe("cpu")
    q, s = assert_bits_equal(probe)
    assert float(s) == 1.0
    codes = set(q.view(torch.uint8).flatten().tolist())
    assert codes >= set(range(0, 0x7F)) | set(range(0x80, 0xFF)), "every finite e4m3fn pattern, both signs"
    ties = probe.new_tensor([0.5 * (2.0 ** -9), 1.0625, 1.1875, 432.0])  # ties to even: 0, 1, 1.25, 448
    assert all(bool((probe == t).any()) for t in ties)


def test_fp32_blocks_with_tiny_amax_stay_finite_and_equal_the_reference():
    """The SCALE_MIN clamp: fp32 amax values of a few subnormal steps, where amax / 448 rounds coarsely: without it,
    k < 224 steps gives scale 0 (w / 0 = inf) and k in (464, 672) scale 1 step, a quotient above 464 (NaN)."""
    w = tiny_scales_fp32()
    q, s = assert_bits_equal(w, block=1)
    assert not torch.isnan(q.float()).any()
    assert (s >= 2.0 ** -145).all()
    # bf16 blocks never reach the clamp: the smallest bf16 amax gives 146 subnormal steps.
    _, s16 = quantize_block_fp8(torch.tensor([[BF16_TINY]], dtype=torch.bfloat16))
    assert s16.view(torch.int32).item() == 146 and 146 * 2.0 ** -149 > 2.0 ** -145


def test_torch_cast_rounds_to_448_up_to_464_then_gives_nan():
    """What the module's docstring says of torch's cast (non-saturating): why no quotient may pass 464."""
    x = torch.tensor([448.0, 449.0, 463.9, 464.0, 464.01, 479.0, 480.0, 1e6, -464.0, -470.0])
    got = x.to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert got == [0x7E, 0x7E, 0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0x7F, 0xFE, 0xFF]


# ---- the round trip, within the format's bound ----

# DeepSeek-V3's weights cut to CPU size with their K and their block layout (kv_a_proj_with_mqa's 576 rows: 4.5
# blocks), the experts stacked as the rollout holds them: [real shape] -> what is quantised here.
CHECKPOINT_SHAPES = {
    "q_a_proj [1536, 7168]": (256, 7168),
    "q_b_proj [24576, 1536]": (384, 1536),
    "kv_a_proj_with_mqa [576, 7168]": (576, 1024),
    "kv_b_proj [32768, 512]": (512, 512),
    "o_proj [7168, 16384]": (256, 1024),
    "experts w13 [E, 4096, 7168]": (2, 256, 7168),
    "experts w2 [E, 7168, 2048]": (2, 256, 2048),
}


@pytest.mark.parametrize("what", list(CHECKPOINT_SHAPES))
def test_round_trip_within_the_formats_bound(what):
    """Per element, with s the block's scale_inv and f = fp8 * s (exact in float64):
        |f - w| <= max(2**-4 |w|, 2**-10 s)
    e4m3's 4-bit significand rounds a normal quotient (>= 2**-6) within half a unit, 2**-4 relative; a quotient
    among its subnormals (steps of 2**-9) within 2**-10 absolute, that is 2**-10 s. The float32 division adds
    2**-24 relative (a factor 1 + 2**-20 covers it). tools/fp8_to_bf16.dequantize then rounds f to bf16 (a product
    in float32, 2**-24, then 2**-8 relative; 2**-134 absolute among bf16 subnormals). Over a block, 2**-4 |w| is at
    most amax / 16 and 2**-10 s about amax / 458752."""
    w = random_weight(CHECKPOINT_SHAPES[what], seed=len(what))
    q, s = quantize_block_fp8(w, name=what)
    ws, qs, ss = (w, q, s) if w.dim() == 3 else (w[None], q[None], s[None])
    worst = 0.0
    for wi, qi, si in zip(ws, qs, ss):
        n, k = wi.shape
        s_el = si.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        w64 = wi.double()
        bound = torch.maximum(2.0 ** -4 * w64.abs(), 2.0 ** -10 * s_el)
        err = (qi.double() * s_el - w64).abs()
        assert (err <= bound * (1 + 2.0 ** -20)).all(), f"{what}: {(err / bound).max().item()} of the bound"
        worst = max(worst, (err / bound).max().item())
        back = fp8_to_bf16.dequantize(qi, si, name=what).double()
        assert ((back - w64).abs() <= bound * (1 + 2.0 ** -8 + 2.0 ** -20)
                + (2.0 ** -8 + 2.0 ** -20) * w64.abs() + 2.0 ** -134).all()
    assert worst > 0.9, f"{what}: the bound is loose here (worst {worst}): the derivation is off"


# ---- refusals ----

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused_by_name_and_block(bad):
    w = random_weight((3, 257, 130), seed=3)
    w[1, 200, 129] = bad
    w[2, 5, 5] = bad
    with pytest.raises(NonFiniteWeightError) as e:
        quantize_block_fp8(w, name="layers.3.mlp.experts.w13")
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "layers.3.mlp.experts.w13" in msg
    assert "block (1, 1, 1)" in msg and "[1, 128:256, 128:130]" in msg and "in 2 of its 18" in msg
    assert ("2 NaN and 0 infinite" if bad != bad else "0 NaN and 2 infinite") in msg and "holding 1 of them" in msg


def test_other_dtypes_shapes_backends_and_blocks_are_refused_by_name():
    w = torch.zeros(4, 4, dtype=torch.bfloat16)
    for bad, kw, says in [(w.half(), {}, "bfloat16 or float32"), (w[0], {}, "[N, K] or stacked"),
                          (w[None, None], {}, "[N, K] or stacked"), (w, {"backend": "cuda"}, "not one of"),
                          (w, {"block": 0}, "positive int"), (w, {"backend": "triton"}, "needs a CUDA tensor")]:
        with pytest.raises(ValueError, match=re.escape(says)) as e:
            quantize_block_fp8(bad, name="model.embed", **kw)
        assert "model.embed" in str(e.value)
    assert not fp8_block.fused_available("cpu")


def test_block_is_the_checkpoint_tools_and_an_empty_weight_has_empty_blocks():
    assert fp8_block.BLOCK == fp8_to_bf16.BLOCK == 128
    q, s = quantize_block_fp8(torch.zeros(0, 300))
    assert q.shape == (0, 300) and s.shape == (0, 3)


# ---- layouts: a shard's scales are a slice of the whole tensor's iff no cut falls inside a block ----

def test_block_splits_finds_the_cuts_inside_blocks():
    assert block_splits(4096, [512] * 8) == [] == block_splits(576, [576])
    assert block_splits(4096, [(0, 2048), (2048, 4096)]) == []
    assert block_splits(7168, [7168 // 3, 7168 // 3, 7168 - 2 * (7168 // 3)]) == [2389, 4778]
    assert block_splits(576, [(0, 288), (288, 576)]) == [288]
    assert block_splits(200, [(0, 200)]) == []  # the end of the dimension is no cut
    with pytest.raises(ValueError, match="do not add up"):
        block_splits(4096, [2048, 1024])
    with pytest.raises(ValueError, match="not inside"):
        block_splits(100, [(0, 120)])


def test_an_aligned_shard_quantises_to_a_slice_and_a_cut_block_does_not():
    w = random_weight((512, 384), seed=11)
    w[250, 7] = 3.0  # an outlier in rows 240..255: a shard ending at row 240 leaves it out of block 1
    q, s = quantize_block_fp8(w)
    for shards in ([256, 256], [128, 384]):
        assert block_splits(512, shards) == []
        a = shards[0]
        for part, rows in ((w[:a], slice(0, a)), (w[a:], slice(a, 512))):
            pq, ps = quantize_block_fp8(part)
            assert torch.equal(pq.view(torch.uint8), q[rows].view(torch.uint8))
            assert torch.equal(ps, s[rows.start // 128:-(-rows.stop // 128)])
    assert block_splits(512, [240, 272]) == [240]
    pq, ps = quantize_block_fp8(w[:240])
    assert ps[1, 0] < s[1, 0]  # rows 128..239 on their own: a smaller amax, a scale that is no slice
    with pytest.raises(BlockSplitError) as e:
        check_block_aligned("model.layers.0.self_attn.q_b_proj.weight", 0, 512, [240, 272], "rollout tp=2")
    msg = str(e.value)
    assert "q_b_proj" in msg and "rollout tp=2" in msg and "at 240" in msg and "[128, 256)" in msg
    check_block_aligned("model.layers.0.self_attn.q_b_proj.weight", 0, 512, [256, 256], "rollout tp=2")


# ---- the fused kernel compiles without flush-to-zero (its bits are tests/reshard/test_fp8_block_gpu.py's) ----

def test_the_fused_kernel_keeps_subnormals_in_its_ptx():
    """Compiled for sm_90 here, with no GPU: IEEE division (div.rn.f32) and no .ftz instruction, which would flush
    the subnormal scales and quotients that the definition keeps (tl.div_rn gives div.rn.ftz.f32 in Triton 3.1)."""
    triton = pytest.importorskip("triton", reason="Triton is not installed (CPU-only or NPU builds)")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) != (3, 1):
        pytest.skip(f"the compile call is Triton 3.1's (the lock's); Triton {triton.__version__} here "
                    "(tests/reshard/test_fp8_block_gpu.py checks the PTX of the kernel it runs)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from verl_patches.reshard.fp8_block_kernel import quantize_blocks

    for dtype in ("*bf16", "*fp32"):
        sig = {"x": dtype, "q": "*u8", "scale": "*fp32", "bad": "*i32", "n": "i32", "k": "i32", "sx_e": "i64",
               "sx_n": "i64", "sx_k": "i64", "n_kblk": "i32", "scale_min": "fp32"}
        for native in (True, False):
            src = ASTSource(fn=quantize_blocks, signature=sig,
                            constants={"BLOCK": 128, "ROWS": 32, "NATIVE_CAST": native})
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
            assert "div.rn.f32" in ptx and ".ftz" not in ptx, sorted(set(re.findall(r"\S+\.ftz\S*", ptx)))


def test_quantize_many_equals_each_alone_and_names_the_first_non_finite_weight():
    weights = {f"layers.{i}.w": random_weight(shape, seed=i) for i, shape in enumerate(RANDOM_SHAPES)}
    many = fp8_block.quantize_many(weights)
    assert list(many) == list(weights)
    for n, w in weights.items():
        q, s = quantize_block_fp8(w)
        assert torch.equal(many[n][0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(many[n][1], s)
    weights["layers.2.w"][0, 0] = float("nan")
    with pytest.raises(NonFiniteWeightError, match=r"^layers\.2\.w: 1 NaN"):
        fp8_block.quantize_many(weights)


def test_a_planned_quantizer_reuses_its_outputs_and_follows_its_inputs():
    """BlockQuantizer: the same output tensors at every call, holding the inputs' values as they are at the call."""
    weights = {"a": random_weight((130, 256), seed=1), "b": random_weight((2, 64, 128), seed=2)}
    quant = fp8_block.BlockQuantizer(weights)
    first = quant()
    weights["a"].mul_(2)
    again = quant()
    q, s = quantize_block_fp8(weights["a"])
    assert torch.equal(again["a"][0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(again["a"][1], s)
    assert first["b"][1].shape == (2, 1, 1)
