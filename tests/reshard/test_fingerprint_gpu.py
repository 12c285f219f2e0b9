"""The weight fingerprint on a GPU gives the CPU's integers bit for bit (skips without CUDA): the
checksum is integer arithmetic modulo 2**32, so a device and the host must agree exactly, for whole
parameters and for boxes at their destination offsets, on every path (the fused Triton kernel, the
torch path and its gather fallback)."""

from __future__ import annotations

import pytest
import torch

from verl_patches.reshard import checksum
from verl_patches.reshard.checksum import CHUNK, tensor_checksum, view_checksum

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_int32_wraps_on_the_device():
    """The per-device probe: the torch path's int32 products and sums, overflowing, equal Python's exact
    result modulo 2**32 on this GPU."""
    assert checksum._probe(torch.device("cuda")) == ""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_equals_host(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, CHUNK // 2 + 5, generator=g).to(dtype)
    y = x.cuda()
    want = int(tensor_checksum(x))
    for impl in ("auto", "torch", "gather"):
        assert int(tensor_checksum(y.reshape(-1), impl=impl)) == want, impl
    meta = torch.empty(x.shape[1], x.shape[0], device="meta").t()
    want = int(view_checksum(x, meta))
    for impl in ("auto", "torch", "gather"):
        assert int(view_checksum(y, meta, impl=impl)) == want, impl


def test_fused_kernel_equals_the_torch_path_on_the_device():
    """The fused Triton kernel (auto on CUDA for 2-byte values), the torch path (the NPU's) and its gather
    give the host's integers, on a parameter past two key periods and on boxes at offsets: transposed
    expert boxes, rows in three chunks, a row across a chunk boundary."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2 * CHUNK + 12345, generator=g).to(torch.bfloat16)
    y = x.cuda()
    want = int(tensor_checksum(x))
    for impl in ("triton", "torch", "gather"):
        assert int(tensor_checksum(y, impl=impl)) == want, impl
    meta = torch.empty(8, 2048, 7168, device="meta")  # vLLM's [E, I, H] w2 stack; Megatron holds [E, H, I]
    big = torch.empty(3, CHUNK, device="meta")
    cases = [(torch.randn(4, 7168, 2048, generator=g).to(torch.bfloat16), meta[2:6].transpose(1, 2)),
             (torch.randn(3, 70000, generator=g).to(torch.bfloat16), big[:, CHUNK - 70000:]),
             (torch.randn(90000, generator=g).to(torch.float16), big.view(-1)[CHUNK - 500:CHUNK + 89500])]
    for values, dest in cases:
        want = int(view_checksum(values, dest))
        dev = values.cuda()
        for impl in ("triton", "torch", "gather"):
            assert int(view_checksum(dev, dest, impl=impl)) == want, (tuple(values.shape), impl)
