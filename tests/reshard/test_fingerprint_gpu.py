"""The weight fingerprint on a GPU gives the CPU's integers bit for bit (skips without CUDA): the
checksum is integer arithmetic, so a device and the host must agree exactly, for whole parameters
and for boxes at their destination offsets."""

from __future__ import annotations

import pytest
import torch

from verl_patches.reshard.checksum import CHUNK, tensor_checksum, view_checksum

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_equals_host(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, CHUNK // 2 + 5, generator=g).to(dtype)
    y = x.cuda()
    assert int(tensor_checksum(x)) == int(tensor_checksum(y.reshape(-1)))
    meta = torch.empty(x.shape[1], x.shape[0], device="meta").t()
    assert int(view_checksum(x, meta)) == int(view_checksum(y, meta))


def test_fused_kernel_equals_the_torch_path_on_the_device():
    """The fused Triton kernel (auto on CUDA for 2-byte values) and the torch path (the NPU's) give the
    host's integers, on a parameter past two key periods and on transposed expert boxes at offsets."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2 * CHUNK + 12345, generator=g).to(torch.bfloat16)
    y = x.cuda()
    want = int(tensor_checksum(x))
    assert int(tensor_checksum(y, impl="triton")) == want == int(tensor_checksum(y, impl="torch"))
    meta = torch.empty(8, 2048, 7168, device="meta")  # vLLM's [E, I, H] w2 stack; Megatron holds [E, H, I]
    stack = torch.randn(4, 7168, 2048, generator=g).to(torch.bfloat16)
    dest = meta[2:6].transpose(1, 2)
    want = int(view_checksum(stack, dest))
    dev = stack.cuda()
    assert int(view_checksum(dev, dest, impl="triton")) == want == int(view_checksum(dev, dest, impl="torch"))
