"""FP8 block quantisation on a GPU (skips without CUDA): the fused Triton kernel gives the torch path's bits, and the
torch path on the GPU gives the host's, on DeepSeek-V3's per-GPU shapes at the 128-GPU rollout layout (TP8, two
experts a GPU) and on tests/reshard/test_fp8_block.py's edge cases, whose reference is checked here too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.reshard.test_fp8_block import (RANDOM_SHAPES, assert_bits_equal, random_weight, special_blocks,
                                          tiny_scales_fp32)
from verl_patches.reshard import fp8_block
from verl_patches.reshard.fp8_block import NonFiniteWeightError, quantize_block_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# The rollout's per-GPU shard at configs/deepseekv3_128gpu_common.yaml (TP8, EP128: 256 / 128 = 2 experts a GPU).
GPU_SHAPES = {
    "experts w13": (2, 4096, 7168), "experts w2": (2, 7168, 2048), "q_a_proj": (1536, 7168),
    "q_b_proj": (24576 // 8, 1536), "kv_a_proj_with_mqa": (576, 7168), "kv_b_proj": (32768 // 8, 512),
    "o_proj": (7168, 16384 // 8),
}


def _bits(q, s):
    return q.view(torch.uint8).cpu(), s.view(torch.int32).cpu()


def _same(w: torch.Tensor, what: str, block: int = 128):
    fq, fs = _bits(*quantize_block_fp8(w, block=block, name=what, backend="triton"))
    tq, ts = _bits(*quantize_block_fp8(w, block=block, name=what, backend="torch"))
    assert torch.equal(fs, ts), f"{what}: scales differ at {int((fs != ts).sum())} blocks"
    assert torch.equal(fq, tq), f"{what}: fp8 differs at {int((fq != tq).sum())} of {fq.numel()} elements"
    return fq, fs


def test_auto_takes_the_fused_kernel_on_cuda():
    assert fp8_block.fused_available("cuda"), "Triton did not import: the fused path cannot be tested"
    assert fp8_block._use_fused(torch.zeros(1, 1, device="cuda"), 128, "auto", "w")


@pytest.mark.parametrize("what", list(GPU_SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_equals_torch_on_the_device_and_on_the_host(what, dtype):
    w = random_weight(GPU_SHAPES[what], seed=len(what), dtype=dtype)
    fq, fs = _same(w.cuda(), what)
    hq, hs = _bits(*quantize_block_fp8(w, name=what))
    assert torch.equal(fs, hs) and torch.equal(fq, hq), f"{what}: the GPU differs from the host"


@pytest.mark.parametrize("shape", RANDOM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_ragged_shapes_equal_the_reference_on_both_paths(shape):
    w = random_weight(shape, seed=sum(shape)).cuda()
    for backend in ("triton", "torch"):
        assert_bits_equal(w, backend=backend)


def test_edge_cases_equal_the_reference_on_both_paths():
    """Zero blocks with negative zeros, bf16 subnormals (a subnormal scale), the largest bf16 values, 448 * k,
    exact ties between e4m3 values, values below e4m3's subnormals: a flush-to-zero or a second rounding fails."""
    w = special_blocks().cuda()
    for backend in ("triton", "torch"):
        assert_bits_equal(w, backend=backend)
    _same(w.t(), "a transposed view (strided reads)")


def test_fp32_blocks_with_tiny_amax_on_both_paths():
    """test_fp8_block's SCALE_MIN case in 16 x 16 blocks (the fused kernel's smallest): block b's amax is k_b float32
    subnormal steps, its other values smaller."""
    amax = tiny_scales_fp32().reshape(-1)
    keep = np.r_[0:32767, 32767:len(amax):7]
    amax = amax[torch.from_numpy(keep)]
    g = torch.Generator().manual_seed(5)
    w = amax[:, None, None] * torch.rand(len(amax), 16, 16, generator=g)
    w[:, 0, 0] = amax
    w = w.reshape(-1, 16).cuda()
    fq, _ = _same(w, "fp32 tiny blocks", block=16)
    assert not torch.isnan(fq.view(torch.float8_e4m3fn).float()).any()
    assert_bits_equal(w[:4096], block=16, backend="triton")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_both_paths_refuse_non_finite_values_by_name_on_the_device(bad, backend):
    w = random_weight((3, 257, 130), seed=3).cuda()
    w[1, 200, 129] = bad
    with pytest.raises(NonFiniteWeightError, match=r"layers\.3\.w13: .* the first is block \(1, 1, 1\)"):
        quantize_block_fp8(w, name="layers.3.w13", backend=backend)


def test_the_compiled_kernel_divides_in_ieee_and_flushes_nothing():
    w = torch.ones(128, 128, device="cuda", dtype=torch.bfloat16)
    _, kern = fp8_block._kernel()
    q = torch.empty(1, 128, 128, dtype=torch.uint8, device="cuda")
    s = torch.empty(1, 1, 1, dtype=torch.float32, device="cuda")
    bad = torch.empty(1, 1, 1, dtype=torch.int32, device="cuda")
    for native in (True, False):
        ptx = fp8_block.launch(kern, w.unsqueeze(0), q, s, bad, 128, native_cast=native).asm["ptx"]
        assert "div.rn.f32" in ptx and ".ftz" not in ptx, native


def test_the_native_cast_is_probed_and_both_encodings_give_the_definition_s_bits():
    """The kernel's two e4m3 encodings (Triton's cast where the probe finds it exact, integer arithmetic elsewhere)
    against the torch path on the probe block, which holds every rounding case; the probe says which this GPU uses."""
    probe = fp8_block.rounding_probe("cuda")
    want, _ = quantize_block_fp8(probe, backend="torch")
    _, kern = fp8_block._kernel()
    for native in (True, False):
        q = torch.empty(1, 128, 128, dtype=torch.uint8, device="cuda")
        s = torch.empty(1, 1, 1, dtype=torch.float32, device="cuda")
        bad = torch.empty(1, 1, 1, dtype=torch.int32, device="cuda")
        fp8_block.launch(kern, probe.unsqueeze(0), q, s, bad, 128, native_cast=native)
        same = torch.equal(q[0], want.view(torch.uint8))
        assert same or (native and not fp8_block._native_cast_exact(probe.device)), native
    print("native cast exact on this GPU:", fp8_block._native_cast_exact(probe.device))


def test_quantize_many_on_the_device_checks_once_and_names_the_first_non_finite_weight():
    # The ragged shapes take one launch each; the rest (aligned, K a multiple of 16: ragged N included) the grouped
    # kernel, float32 in a group of its own.
    shapes = RANDOM_SHAPES + [(2, 200, 256), (129, 7168), (1, 16)]
    weights = {f"layers.{i}.w": random_weight(shape, seed=i).cuda() for i, shape in enumerate(shapes)}
    weights["fp32.w"] = random_weight((300, 512), seed=9, dtype=torch.float32).cuda()
    assert sum(fp8_block._groupable(w) for w in weights.values()) >= 5
    many = fp8_block.quantize_many(weights, backend="triton")
    for n, w in weights.items():
        q, s = quantize_block_fp8(w, backend="torch")
        assert torch.equal(many[n][0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(many[n][1], s), n
    weights["layers.3.w"][0, 0] = float("inf")
    weights["layers.4.w"][0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteWeightError, match=r"^layers\.3\.w: 0 NaN and 1 infinite"):
        fp8_block.quantize_many(weights, backend="triton")


def test_a_planned_quantizer_on_the_device_keeps_its_outputs_and_follows_moved_inputs():
    weights = {f"w{i}": random_weight((2, 256, 512), seed=i).cuda() for i in range(3)}
    quant = fp8_block.BlockQuantizer(weights, backend="triton")
    out = quant()
    ptrs = {n: out[n][0].data_ptr() for n in out}
    weights["w1"] = random_weight((2, 256, 512), seed=7).cuda()  # a new storage: the table row follows it
    quant.weights["w1"] = weights["w1"]
    out = quant()
    for n, w in weights.items():
        q, s = quantize_block_fp8(w, backend="torch")
        assert torch.equal(out[n][0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(out[n][1], s), n
        assert out[n][0].data_ptr() == ptrs[n]
