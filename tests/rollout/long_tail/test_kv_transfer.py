"""The moved requests' KV rows as buffers over a process group (verl_patches/rollout/long_tail/kv_transfer.py), on
the host: gloo ranks, the same code NCCL / HCCL run (test_kv_transfer_gpu.py runs NCCL where there are
GPUs). Single process: packing, the layout checks, the payload walk. Four gloo ranks: random moves,
received rows equal to the sent ones bit for bit, errors named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from verl_patches.launch.local_ranks import run_distributed
from verl_patches.rollout.long_tail import kv_transfer
from verl_patches.rollout.long_tail.kv_transfer import TransferError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import the body by name
from kv_transfer_ranks import LAYERS, errors_rank, exchange_rank, plan  # noqa: E402

WORLD = 4


def test_pack_and_unpack_round_trip_bit_exact_one_buffer_per_dtype():
    g = torch.Generator().manual_seed(0)
    bf = [torch.randn(n, 8, generator=g).to(torch.bfloat16) for n in (3, 1, 5)]
    other = [torch.randn(2, 4, generator=g), torch.arange(6).view(2, 3), torch.randn(4, 6, generator=g)[:, ::2]]
    tensors = [bf[0], other[0], bf[1], other[1], bf[2], other[2]]  # mixed dtypes, one not contiguous
    buffers, layout = kv_transfer.pack(tensors, torch.device("cpu"))
    assert [b.dtype for b in buffers] == [torch.bfloat16, torch.float32, torch.int64]
    assert [b.numel() for b in buffers] == layout["sizes"] == [72, 8 + 12, 6]
    out = kv_transfer.unpack(buffers, layout)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(tensors, out))
    # views of the received buffers, not copies
    assert all(o.untyped_storage().data_ptr() == buffers[0].untyped_storage().data_ptr() for o in out[0:5:2])


def test_a_layout_that_disagrees_with_the_buffers_is_named():
    buffers, layout = kv_transfer.pack([torch.ones(4, 2, dtype=torch.bfloat16)] * 2, torch.device("cpu"))
    with pytest.raises(TransferError, match=r"rank 1 from rank 0: KV buffer 0 is \(15,\) torch.bfloat16; the layout "
                                            r"says \(16,\)"):
        kv_transfer.unpack([buffers[0][:15]], layout, "rank 1 from rank 0: ")
    with pytest.raises(TransferError, match=r"KV buffer sizes \[17\] \(elements\) disagree with the slots, which "
                                            r"fill \[16\]"):
        kv_transfer.unpack(buffers, {**layout, "sizes": [17]})
    with pytest.raises(TransferError, match="KV slot 1 starts at element 9 of buffer 0; the slots before it end at 8"):
        kv_transfer.check_layout({**layout, "slots": [layout["slots"][0], (0, 9, (4, 2))]})
    with pytest.raises(TransferError, match="KV slot 0 names buffer 3 of 1"):
        kv_transfer.check_layout({**layout, "slots": [(3, 0, (4, 2))]})
    with pytest.raises(TransferError, match=r"KV buffer 0 is \(16,\) torch.float32"):
        kv_transfer.unpack([buffers[0].float()], layout)
    with pytest.raises(TransferError, match=r"KV tensor 1 \(2,\) is on meta, not on cpu, the device of the KV "
                                            "process group"):
        kv_transfer.pack([torch.ones(2), torch.ones(2, device="meta")], torch.device("cpu"))


def test_only_the_kv_entry_is_split_out_and_filled_back():
    """Both engines' KV layouts: vLLM's move ({"num_tokens", "rows"}) and the CPU stand-in's per-layer
    (key, value) tuples; tensors elsewhere in the payload stay in the pickled part."""
    gen = torch.Generator().manual_seed(1).get_state()
    rows = [torch.ones(3, 4), torch.zeros(3, 4)]
    rest, tensors = kv_transfer.split_payload({"generator": gen, "kv": {"num_tokens": 3, "rows": rows}}, first=5)
    assert rest["kv"] == {"num_tokens": 3, "rows": [kv_transfer.Slot(5), kv_transfer.Slot(6)]}
    assert rest["generator"] is gen and tensors == rows
    back = kv_transfer.fill_payload(rest, [None] * 5 + tensors)
    assert back["kv"]["rows"][0] is rows[0] and back["kv"]["num_tokens"] == 3
    kv = [(torch.ones(1, 2, 3), torch.ones(1, 2, 3)), (torch.ones(1, 2, 3), torch.ones(1, 2, 3))]
    rest, tensors = kv_transfer.split_payload({"out": [1], "kv": kv})
    assert rest["kv"] == [(kv_transfer.Slot(0), kv_transfer.Slot(1)), (kv_transfer.Slot(2), kv_transfer.Slot(3))]
    assert isinstance(rest["kv"][0], tuple) and len(tensors) == 4
    assert kv_transfer.split_payload(("tokens", "reason")) == (("tokens", "reason"), [])  # no KV: as is
    with pytest.raises(TransferError, match="KV slot 2 of a payload; the buffers hold 2 tensors"):
        kv_transfer.fill_payload({"kv": [kv_transfer.Slot(2)]}, tensors[:2])


def test_the_plan_has_a_rank_that_sends_and_receives_and_several_requests_per_pair():
    moves = plan(WORLD, 0)
    assert all(m.src != m.dst for m in moves)
    pairs = {(m.src, m.dst) for m in moves}
    assert all(sum(1 for m in moves if (m.src, m.dst) == p) >= 2 for p in pairs)
    assert {m.src for m in moves} & {m.dst for m in moves}


@pytest.mark.slow
def test_four_gloo_ranks_receive_every_moved_requests_rows_bit_for_bit():
    outs = run_distributed(exchange_rank, WORLD, "gloo", 0, timeout=120)
    moves = plan(WORLD, 0)
    for rank, out in enumerate(outs):
        want = sorted(m.request for m in moves if m.dst == rank)
        assert sorted(out["received"]) == want and want
        for rid, got in out["received"].items():
            assert got == {"exact": True, "devices": ["cpu"], "dtypes": ["torch.bfloat16"], "rest": True}, (rank, rid)
        assert out["storages"] == 1  # views of the one buffer received (one sender per rank here)
        assert out["sent"] > sum(2 * LAYERS * 576 for m in moves if m.src == rank)  # KV bytes counted


@pytest.mark.slow
def test_bad_transfers_are_named_on_every_rank():
    outs = run_distributed(errors_rank, WORLD, timeout=120)
    for rank, out in enumerate(outs):
        first = [m.request for m in plan(WORLD, 1) if m.src == rank][0]
        assert out["missing"] == f"rank {rank} is to send request {first} but does not hold it"
        assert "is on meta, not on cpu, the device of the KV process group" in out["device"], out
        assert "the KV process group was not prepared" in out["unprepared"], out
