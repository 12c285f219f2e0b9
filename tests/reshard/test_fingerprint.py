"""The weight fingerprint (verl_patches/reshard/checksum.py): exact, order free, position sensitive; and
on 8 gloo processes over the reshard's layouts, it accepts the ground-truth rollout shards and every
method's output, and names the rank and parameter of a flipped element or a transposed expert."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from verl_patches.launch.local_ranks import run_distributed
from verl_patches.reshard.checksum import (CHUNK, MOD, FingerprintTable, _chunk_key, key_table, tensor_checksum,
                                           view_checksum)
from verl_patches.testing.fingerprint_check import check_fingerprints
from verl_patches.testing.selfcheck import make_plan

MODEL = json.loads((Path(__file__).resolve().parents[2] / "configs/model/tiny_deepseek_v3.json").read_text())


def _bits_sum(t: torch.Tensor) -> int:
    """The checksum written out in Python integers, element by element (the definition)."""
    flat = t.reshape(-1)
    bits = flat.view(torch.int16).tolist() if t.element_size() == 2 else [x % MOD for x in flat.view(torch.int32).tolist()]
    table = key_table(torch.device("cpu")).tolist()
    return sum(b * (table[i % CHUNK] + _chunk_key(i // CHUNK)) for i, b in enumerate(bits)) % MOD


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_checksum_is_the_definition_and_chunk_free(dtype):
    t = torch.randn(37, 53).to(dtype)
    want = _bits_sum(t)
    assert int(tensor_checksum(t)) == want
    meta = torch.empty(t.shape, device="meta")
    assert int(view_checksum(t, meta)) == want
    assert int(view_checksum(t, meta, rows_per_chunk=3)) == want


def test_chunks_past_the_key_period_count():
    # Two chunks of the key period holding the same values still add differently (c(q)).
    half = torch.randn(CHUNK).to(torch.bfloat16)
    both = torch.cat([half, half])
    bits = half.view(torch.int16).to(torch.int64)
    table = key_table(torch.device("cpu")).to(torch.int64)
    want = sum(int((bits * (table + _chunk_key(q))).sum()) for q in (0, 1)) % MOD
    assert int(tensor_checksum(both)) == want
    meta = torch.empty(both.shape, device="meta")
    assert int(view_checksum(both.view(2, CHUNK), meta.view(2, CHUNK))) == want


def test_boxes_at_their_destination_offsets_add_up_to_the_whole():
    # A [4, 6, 10] parameter written by three senders: two boxes through a transposing view
    # (as Megatron's expert weights reach vLLM's), one direct.
    full = torch.randn(4, 6, 10).to(torch.bfloat16)
    meta = torch.empty(full.shape, device="meta")
    logical = full.permute(0, 2, 1)  # the senders hold [4, 10, 6]
    dest = meta.permute(0, 2, 1)
    parts = [view_checksum(logical[:2, :, :3], dest[:2, :, :3]), view_checksum(logical[:2, :, 3:], dest[:2, :, 3:]),
             view_checksum(full[2:], meta[2:])]
    assert int(sum(parts)) % MOD == int(tensor_checksum(full))


def test_position_sensitive():
    t = torch.randn(8, 16).to(torch.bfloat16)
    base = int(tensor_checksum(t))
    flipped = t.clone()
    flipped.view(torch.int16)[3, 5] ^= 1  # the lowest mantissa bit of one element
    assert int(tensor_checksum(flipped)) != base
    square = torch.randn(16, 16).to(torch.bfloat16)
    assert int(tensor_checksum(square.t().contiguous())) != int(tensor_checksum(square))
    # The vLLM-Ascend bug's shape: an expert stack transposed once more, read back in its own shape.
    w = torch.randn(2, 6, 4).to(torch.bfloat16)
    assert int(tensor_checksum(w.transpose(1, 2).contiguous().view(w.shape))) != int(tensor_checksum(w))
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert int(tensor_checksum(swapped)) != base


def test_table_orders_every_rank_parameter_once():
    plan = make_plan(MODEL, "tp=2,pp=2,ep=2,layers=1,3", "tp=2,dp=4")
    table = FingerprintTable.of(plan)
    slots = {table.slot(r, n) for r in range(plan.world) for n in plan.placements.rollout_storage[r]}
    assert slots == set(range(table.size))
    assert FingerprintTable.of(plan) is table  # built once per plan


# (train, rollout, dtype, bucket bytes): the layouts of tests/reshard/test_bitexact.py that cover
# transposed experts, split MLA, TE-grouped experts, fp32 and replicated shared experts.
CASES = [
    ("tp=2,pp=2,ep=2,layers=1,3", "tp=4,dp=2", "bfloat16", 4096),
    ("tp=4,pp=2,ep=1,layers=3,1", "tp=1,dp=8", "float32", 4096),
    ("tp=2,pp=2,ep=2,layers=1,3,experts=te_grouped", "tp=2,dp=4", "bfloat16", 4096),
    ("tp=2,pp=2,ep=2,layers=2,2", "tp=4,dp=2,shared=replicated", "bfloat16", 4096),
]
W = 8


@pytest.mark.slow
def test_fingerprint_on_8_ranks_accepts_every_method_and_names_faults():
    plans = [make_plan(MODEL, t, r, dtype=d, bucket_bytes=b) for t, r, d, b in CASES]
    res = run_distributed(check_fingerprints, W, plans, timeout=280)
    for case, plan in enumerate(plans):
        named = {f: res[5][case][f][1] for f in ("flip", "transpose")}
        for rank in range(W):
            r = res[rank][case]
            assert r["truth"] == len(plan.placements.rollout_storage[rank]) > 0, (CASES[case], rank)
            for method in ("direct", "upstream", "recipe"):
                if method in r:
                    assert r[method] == r["truth"], (CASES[case], rank, method)
            for fault in ("flip", "transpose"):
                assert r[fault] is not None, f"{CASES[case]}: the {fault} on rank 5 went unnoticed on rank {rank}"
                message = r[fault][0]
                # Every rank stops with the same error, naming the step, rank 5 and the parameter.
                assert "step 3" in message and f"rollout rank 5, {named[fault]}:" in message, message
                assert message.count("rollout rank") == 1, message


def test_blocks_of_chunks_give_the_same_integer(monkeypatch):
    # Several launches of several key periods each, plus a tail: the same sum as one period at a time.
    from verl_patches.reshard import checksum

    x = torch.randn(5 * CHUNK + 123).to(torch.bfloat16)
    whole = int(tensor_checksum(x))
    monkeypatch.setattr(checksum, "BLOCK", 2 * CHUNK)
    assert int(tensor_checksum(x)) == whole
    meta = torch.empty(x.shape, device="meta")
    assert int(view_checksum(x, meta)) == whole
    assert int(view_checksum(x.view(-1, 1), meta.view(-1, 1), rows_per_chunk=CHUNK + 1)) == whole


def test_fault_specs_parse_or_name_the_problem(monkeypatch):
    from verl_patches.reshard import faults

    monkeypatch.setenv(faults.ENV, "flip,step=3,rank=1; transpose,step=3,rank=2,param=x.w13_weight")
    assert faults.configured() == [faults.Fault("flip", 3, 1), faults.Fault("transpose", 3, 2, "x.w13_weight")]
    for bad, said in (("flop,step=1,rank=0", "must be one of"), ("flip,step=a,rank=0", "step must be"),
                      ("flip,rank=0", "step=N is required"), ("flip,step=1,rank=0,rank=1", "each once")):
        with pytest.raises(faults.FaultSpecError, match=said) as e:
            faults.parse(bad)
        assert faults.ENV in str(e.value)
    monkeypatch.delenv(faults.ENV)
    assert faults.configured() == []


def test_injected_faults_change_exactly_the_named_parameter(monkeypatch):
    from verl_patches.reshard import faults

    roll = {"a.weight": torch.randn(4, 4).to(torch.bfloat16),
            "m.mlp.experts.w13_weight": torch.randn(2, 6, 4).to(torch.bfloat16)}
    before = {n: t.clone() for n, t in roll.items()}
    monkeypatch.setenv(faults.ENV, "flip,step=3,rank=1;transpose,step=3,rank=1")
    assert faults.inject_after_reshard(2, 1, roll) == [] and faults.inject_after_reshard(3, 0, roll) == []
    assert faults.inject_after_reshard(3, 1, roll) == ["a.weight", "m.mlp.experts.w13_weight"]
    for n in roll:
        assert not torch.equal(roll[n].view(torch.int16), before[n].view(torch.int16)), n
    assert (roll["a.weight"].view(torch.int16) != before["a.weight"].view(torch.int16)).sum() == 1


def _definition(t: torch.Tensor, dest_index: torch.Tensor) -> int:
    """The checksum by its definition, vectorised in int64 (2-byte values): sum(bits * k(index)) mod M."""
    bits = t.reshape(-1).view(torch.int16).to(torch.int64)
    i = dest_index.reshape(-1).to(torch.int64)
    keys = key_table(torch.device("cpu")).to(torch.int64)[i % CHUNK] + _chunk_key(i // CHUNK)
    return int((bits * keys).sum() % MOD)


def test_the_torch_path_is_the_definition_past_chunks_and_ragged():
    # 2.3 key periods (three chunks, the last partial), values that reach both ends of int16.
    n = 2 * CHUNK + 1234567
    g = torch.Generator().manual_seed(7)
    t = torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    t[:64] = torch.tensor(-(1 << 15), dtype=torch.int16).view(torch.bfloat16)  # the extremes, a whole int32 group
    t[64:128] = torch.tensor((1 << 15) - 1, dtype=torch.int16).view(torch.bfloat16)
    assert int(tensor_checksum(t, impl="torch")) == _definition(t, torch.arange(n))
    # Send side: a transposed [3, R, C] box at an offset of a larger destination, crossing chunk boundaries.
    meta = torch.empty(4, 1500, 2100, device="meta")
    dest = meta[1:4, :, 100:2100].permute(0, 2, 1)  # [3, 2000, 1500]
    values = torch.randn(3, 1500, 2000, generator=g).to(torch.bfloat16).permute(0, 2, 1)
    idx = torch.arange(meta.numel()).view(4, 1500, 2100)[1:4, :, 100:2100].permute(0, 2, 1)
    assert int(view_checksum(values, dest, impl="torch")) == _definition(values.contiguous(), idx.contiguous())


_TRITON_CHECK = r"""
import torch
from verl_patches.reshard.checksum import tensor_checksum, view_checksum, CHUNK
g = torch.Generator().manual_seed(11)
flat = torch.randn(3 * 65536 + 17, generator=g).to(torch.bfloat16)
assert int(tensor_checksum(flat, impl="triton")) == int(tensor_checksum(flat, impl="torch"))
meta = torch.empty(3, 1400, 2048, device="meta")  # 8.6 M elements: the chunk key changes inside the box
for values, dest in (
    (torch.randn(3, 2048, 1400, generator=g).to(torch.bfloat16).transpose(1, 2), meta),  # Megatron -> vLLM
    (torch.randn(2, 700, 1000, generator=g).to(torch.float16), meta[1:, 700:, 1000:2000]),
    (torch.randn(1000, 3, generator=g).to(torch.bfloat16), meta[2, :1000, 5:8]),
    (torch.randn(5, generator=g).to(torch.bfloat16), meta[2, 1399, 2040:2045]),
):
    a, b = int(view_checksum(values, dest, impl="triton")), int(view_checksum(values, dest, impl="torch"))
    assert a == b, (tuple(values.shape), a, b)
print("fused == torch")
"""


def test_the_fused_kernel_gives_the_torch_paths_integers():
    """The Triton kernel (CUDA's path) run by Triton's interpreter on the CPU: the same integers as the
    torch path on a flat tensor and on strided boxes at destination offsets that cross key periods.
    The GPU run of the same comparison: tests/reshard/test_fingerprint_gpu.py."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    r = subprocess.run([sys.executable, "-c", _TRITON_CHECK], capture_output=True, text=True, timeout=600, cwd=str(REPO),
                       env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO)))
    assert r.returncode == 0 and "fused == torch" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_a_sender_sums_each_replicated_box_once():
    from verl_patches.reshard.checksum import checked_bytes

    plan = make_plan(MODEL, "tp=2,pp=1,ep=1", "tp=1,dp=4")  # every rollout replica takes the same dense boxes
    for rank in range(len(plan.ranks)):
        shard, sent = checked_bytes(plan, rank)
        st = plan.ranks[rank]
        assert shard == st.shard_bytes and 0 < sent <= st.sent_bytes + st.local_bytes  # local copies are checked too
    assert sum(checked_bytes(plan, r)[1] for r in range(4)) < sum(s.sent_bytes + s.local_bytes for s in plan.ranks)
