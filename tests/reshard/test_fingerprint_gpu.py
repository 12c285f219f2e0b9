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
