"""The moved requests' KV rows device to device over NCCL (verl_patches/rollout/long_tail/kv_transfer.py), two
ranks, one GPU each: the random moves of test_kv_transfer.py with the rows on the GPUs arrive bit for
bit, as tensors on the destination's GPU (views of the received device buffer: no host copy), and a
timed line (bytes, seconds, GB/s), for information only.

Skipped without two GPUs. Needs torch with CUDA and this repository only: no vLLM, Ray or
megatron-core (the ranks are spawned, not forked from the test suite's preloading forkserver).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from verl_patches.launch.local_ranks import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import the body by name
from kv_transfer_ranks import LAYERS, exchange_rank, plan, timed_rank  # noqa: E402

WORLD = 2
ENV = {"NCCL_NVLS_ENABLE": "0"}

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
                                reason=f"needs {WORLD} CUDA GPUs")


@pytest.fixture(autouse=True)
def _spawn(monkeypatch):
    monkeypatch.setenv("VERL_PATCHES_RANK_START", "spawn")  # fresh interpreters: no vLLM / megatron preload
    monkeypatch.delenv("VERL_PATCHES_DEVICE", raising=False)  # the facade resolves cuda


def test_nccl_two_ranks_receive_every_moved_requests_rows_bit_for_bit_on_their_gpu():
    moves = plan(WORLD, 0)  # what exchange_rank plans on every rank
    outs = run_distributed(exchange_rank, WORLD, "nccl", 0, backend="nccl", env=ENV, timeout=240)
    for rank, out in enumerate(outs):
        assert out["device"] == f"cuda:{rank}"
        want = sorted(m.request for m in moves if m.dst == rank)
        assert sorted(out["received"]) == want and want
        for rid, got in out["received"].items():
            assert got == {"exact": True, "devices": [f"cuda:{rank}"], "dtypes": ["torch.bfloat16"], "rest": True}, \
                (rank, rid, got)
        assert out["storages"] == 1  # views of the one buffer received (one sender per rank here)
        assert out["sent"] > sum(2 * LAYERS * 576 for m in moves if m.src == rank)


def test_nccl_transfer_time_for_information():
    tokens = 8192
    outs = run_distributed(timed_rank, WORLD, "nccl", tokens, 5, backend="nccl", env=ENV, timeout=240)
    nbytes, seconds = outs[1]["bytes"], max(o["seconds"] for o in outs)
    assert nbytes == 61 * tokens * 576 * 2
    print(f"\nkv_transfer over NCCL, rank 0 -> rank 1, one request of {tokens} tokens x 61 layers (bf16 MLA rows): "
          f"{nbytes} bytes in {seconds:.6f} s = {nbytes / seconds / 1e9:.2f} GB/s "
          f"(fastest of 5, metadata over gloo included; {torch.cuda.get_device_name(0)})")
