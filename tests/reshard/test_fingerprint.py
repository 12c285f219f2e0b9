"""The weight fingerprint (verl_patches/reshard/checksum.py): exact, order free, position sensitive; every
piece of the torch path and its gather fallback equal the definition, written here in Python integers; a
device whose int32 arithmetic does not wrap is refused; and on 8 gloo processes over the reshard's layouts,
it accepts the ground-truth rollout shards and every method's output, and names the rank and parameter of
a flipped element or a transposed expert."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from verl_patches.launch.local_ranks import run_distributed
from verl_patches.reshard import checksum
from verl_patches.reshard.checksum import (CHUNK, MASK, FingerprintArithmeticError, FingerprintTable, key_table,
                                           tensor_checksum, view_checksum)
from verl_patches.rigs.testing.fingerprint_check import check_fingerprints
from verl_patches.rigs.testing.selfcheck import make_plan

MODEL = json.loads((Path(__file__).resolve().parents[2] / "configs/model/tiny_deepseek_v3.json").read_text())
M32 = 1 << 32


def _c(q: int) -> int:
    """The chunk key, from the definition: ((q * 0x9E3779B1 + 0x7F4A7C15) mod 2**32) | 1."""
    return ((q * 0x9E3779B1 + 0x7F4A7C15) % M32) | 1


def _bits(values: torch.Tensor) -> list[int]:
    """bits() from the definition: 2-byte values as signed int16; 4-byte words w as w ^ (w >>> 16)."""
    flat = values.contiguous().reshape(-1)
    if flat.element_size() == 2:
        return flat.view(torch.int16).tolist()
    return [(w % M32) ^ ((w % M32) >> 16) for w in flat.view(torch.int32).tolist()]


def _index(dest: torch.Tensor) -> list[int]:
    """Each element's flat index in the destination (a view of a meta tensor), row-major over the view."""
    idx = [dest.storage_offset()]
    for n, st in zip(dest.shape, dest.stride()):
        idx = [i + j * st for i in idx for j in range(n)]
    return idx


def _definition(values: torch.Tensor, index: list[int]) -> int:
    """C = sum_i bits_i * K[i mod 2**22] * c(i div 2**22) mod 2**32, element by element in Python integers."""
    K = key_table(torch.device("cpu"))
    keys = K[torch.tensor(index, dtype=torch.int64) % CHUNK].tolist()
    return sum(b * k * _c(i // CHUNK) for b, k, i in zip(_bits(values), keys, index)) % M32


def _definition_np(values: torch.Tensor, index: np.ndarray) -> int:
    """The same for large 2-byte tensors, vectorised in numpy's uint64 (arithmetic modulo 2**64, so exact
    modulo 2**32)."""
    b = values.contiguous().reshape(-1).view(torch.int16).numpy().astype(np.int64).astype(np.uint64)
    k = key_table(torch.device("cpu")).numpy().astype(np.int64).astype(np.uint64)[index % CHUNK]
    q = (index // CHUNK).astype(np.uint64)
    c = ((q * np.uint64(0x9E3779B1) + np.uint64(0x7F4A7C15)) & np.uint64(MASK)) | np.uint64(1)
    return int((b * k * c).sum() & np.uint64(MASK))


def test_keys_are_odd_32_bit_and_drawn_once():
    K = key_table(torch.device("cpu"))
    assert K.dtype == torch.int32 and K.numel() == CHUNK and bool((K & 1).all())
    assert K.min() < -(1 << 30) and K.max() > (1 << 30)  # the whole 32-bit range, not small keys
    assert key_table(torch.device("cpu")) is K
    assert all(checksum.chunk_key(q) == _c(q) for q in (0, 1, 2, 511, 4096, (1 << 20) - 1))
    assert checksum.chunk_table(torch.device("cpu"), 5000)[:5000].tolist() == \
        [_c(q) - M32 if _c(q) >> 31 else _c(q) for q in range(5000)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_checksum_is_the_definition(dtype):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(37, 53, generator=g).to(dtype)
    t.view(-1)[:2] = torch.tensor([float("-inf"), float("nan")], dtype=dtype)  # the extreme bit patterns
    want = _definition(t, list(range(t.numel())))
    assert int(tensor_checksum(t)) == want == int(tensor_checksum(t, impl="gather"))
    meta = torch.empty(t.shape, device="meta")
    assert int(view_checksum(t, meta)) == want == int(view_checksum(t, meta, impl="gather"))
    one = t[3, 4]  # a 0-dim value
    assert int(view_checksum(one, meta[3, 4])) == _definition(one, [3 * 53 + 4])


def _cases():
    """(what, values, destination view, the piece kinds it must use): small values at destination offsets
    past and across key periods (a meta tensor costs no memory)."""
    g = torch.Generator().manual_seed(5)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    big = torch.empty(3, CHUNK, device="meta")
    cube = torch.empty(4, 1500, 2100, device="meta")
    odd = torch.empty(200, 2, CHUNK + 1, device="meta")
    return [
        ("rows of three chunks, one as_strided view and a chunk key per row", r(3, 1100),
         big[:, CHUNK - 1100:], {"box"}),
        ("a transposed box in a larger destination (Megatron -> vLLM experts)", r(3, 150, 300).permute(0, 2, 1),
         cube[1:4, 1300:1450, 100:400].permute(0, 2, 1), {"box"}),
        ("the same, fp32", r(3, 150, 40, dtype=torch.float32).permute(0, 2, 1),
         cube[1:4, 1300:1450, 60:100].permute(0, 2, 1), {"box"}),
        ("one row across a chunk boundary: split", r(1100), big.view(-1)[CHUNK - 500:CHUNK + 600], {"slice"}),
        ("rows of a box that each cross a boundary: split rows", r(200, 70), cube[1, 400:600, 580:650],
         {"box", "slice"}),
        ("a column (no unit-stride dim)", r(1500), cube[2, :, 7], {"box"}),
        ("fragmented: the gather", r(2, 200, 3).permute(1, 0, 2), odd[:, :, CHUNK - 2:CHUNK + 1], {"gather"}),
    ]


@pytest.mark.parametrize("case", range(7))
def test_every_piece_kind_and_the_gather_are_the_definition(case):
    what, values, dest, kinds = _cases()[case]
    want = _definition(values, _index(dest))
    checksum._check_wraps(torch.device("cpu"))  # the per-device probe (it uses every kind) before counting
    before = dict(checksum.PATHS)
    assert int(view_checksum(values, dest)) == want, what
    used = {k for k in checksum.PATHS if checksum.PATHS[k] > before.get(k, 0)}
    assert used == kinds, (what, used)
    assert int(view_checksum(values, dest, impl="gather")) == want, what


def test_random_views_are_the_definition():
    # Random boxes of destinations up to a few key periods per dim (narrowed, permuted), values in their own
    # random layout, 2- and 4-byte: the pieces (or the gather they fall back to) and the gather give the
    # definition's integer.
    import random

    rng = random.Random(11)
    sizes = [1, 2, 3, 7, 50, 1000, 70000, CHUNK // 3, CHUNK + 3]
    for case in range(60):
        nd = rng.randint(1, 4)
        shape = [rng.choice(sizes) for _ in range(nd)]
        while math.prod(shape) > 3e11:
            shape[rng.randrange(nd)] = 3
        box = []
        for n in shape:
            length = rng.randint(1, min(n, 30))
            a = rng.randint(0, n - length)
            box.append(slice(a, a + length))
        order = list(range(nd))
        rng.shuffle(order)
        dest = torch.empty(shape, device="meta")[tuple(box)].permute(order)
        own = list(range(nd))
        rng.shuffle(own)
        dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
        values = torch.randn([dest.shape[d] for d in own]).to(dtype).permute([own.index(d) for d in range(nd)])
        want = _definition(values, _index(dest))
        assert int(view_checksum(values, dest)) == want == int(view_checksum(values, dest, impl="gather")), case


def test_whole_periods_of_a_row_and_a_tail():
    # A parameter of 2.3 key periods (the receive side: rows of whole periods, then a tail), values that reach
    # both ends of int16, and the same values as a box at an offset past the first period.
    n = 2 * CHUNK + 1234567
    g = torch.Generator().manual_seed(7)
    t = torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    t.view(torch.int16)[:64] = -(1 << 15)
    t.view(torch.int16)[64:128] = (1 << 15) - 1
    checksum._check_wraps(torch.device("cpu"))
    before = dict(checksum.PATHS)
    assert int(tensor_checksum(t)) == _definition_np(t, np.arange(n))
    assert checksum.PATHS["rows"] > before.get("rows", 0)
    meta = torch.empty(4 * CHUNK, device="meta")
    assert int(view_checksum(t, meta[CHUNK + 5:CHUNK + 5 + n])) == _definition_np(t, np.arange(n) + CHUNK + 5)


def test_chunks_past_the_key_period_count():
    # Two chunks holding the same values still add differently (c(q)).
    half = torch.randn(CHUNK).to(torch.bfloat16)
    both = torch.cat([half, half])
    assert int(tensor_checksum(both)) == _definition_np(both, np.arange(2 * CHUNK))
    assert int(tensor_checksum(both)) != int(tensor_checksum(half)) * 2 % M32


def test_boxes_at_their_destination_offsets_add_up_to_the_whole():
    # A [4, 6, 10] parameter written by three senders: two boxes through a transposing view
    # (as Megatron's expert weights reach vLLM's), one direct.
    full = torch.randn(4, 6, 10).to(torch.bfloat16)
    meta = torch.empty(full.shape, device="meta")
    logical = full.permute(0, 2, 1)  # the senders hold [4, 10, 6]
    dest = meta.permute(0, 2, 1)
    parts = [view_checksum(logical[:2, :, :3], dest[:2, :, :3]), view_checksum(logical[:2, :, 3:], dest[:2, :, 3:]),
             view_checksum(full[2:], meta[2:])]
    assert int(sum(parts)) % M32 == int(tensor_checksum(full))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_position_sensitive(dtype):
    g = torch.Generator().manual_seed(3)
    t = torch.randn(8, 16, generator=g).to(dtype)
    base = int(tensor_checksum(t))
    bits, width = (torch.int16, 16) if dtype == torch.bfloat16 else (torch.int32, 32)
    for pos in range(0, 128, 9):  # each bit of a few elements flipped alone: always seen
        for bit in range(width):
            flipped = t.clone()
            mask = (1 << bit) - (1 << width if bit == width - 1 else 0)  # the top bit as a negative value
            flipped.view(bits).view(-1)[pos] ^= mask
            assert int(tensor_checksum(flipped)) != base, (pos, bit)
    square = torch.randn(16, 16, generator=g).to(dtype)
    assert int(tensor_checksum(square.t().contiguous())) != int(tensor_checksum(square))
    # The vLLM-Ascend bug's shape: an expert stack transposed once more, read back in its own shape.
    w = torch.randn(2, 6, 4, generator=g).to(dtype)
    assert int(tensor_checksum(w.transpose(1, 2).contiguous().view(w.shape))) != int(tensor_checksum(w))
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert int(tensor_checksum(swapped)) != base
    experts = torch.randn(4, 6, 8, generator=g).to(dtype)
    assert int(tensor_checksum(experts[[1, 0, 2, 3]])) != int(tensor_checksum(experts))
    # A whole tensor negated (an even number of elements): every sign bit moves. With fp32 words taken
    # plainly modulo 2**32 this would sum to the same integer (2**31 times an even sum of odd keys).
    assert int(tensor_checksum(-t)) != base


def test_a_device_whose_int32_arithmetic_does_not_wrap_is_refused(monkeypatch):
    # Simulated: the torch path's sums pass through float32 (as a device without int32 reductions might),
    # which loses their low bits once they overflow: the per-device probe sees it and every call refuses.
    dev = torch.device("cpu")
    real = checksum._torch_sum
    monkeypatch.setattr(checksum, "_torch_sum", lambda *a, **k: real(*a, **k).to(torch.float32).to(torch.int32))
    monkeypatch.setattr(checksum, "_WRAPS", {})
    for call in (lambda: tensor_checksum(torch.randn(8).to(torch.bfloat16)),
                 lambda: view_checksum(torch.randn(4), torch.empty(4, device="meta"))):
        with pytest.raises(FingerprintArithmeticError, match=r"on cpu the int32 multiply and sum .* modulo 2\*\*32 "
                           r"\(receive \(torch.bfloat16, pieces\): .*fingerprint_every=0"):
            call()
    assert checksum._WRAPS["cpu"]  # probed once, remembered
    monkeypatch.setattr(checksum, "_torch_sum", real)
    monkeypatch.setattr(checksum, "_WRAPS", {})
    assert checksum._probe(dev) == "" and int(tensor_checksum(torch.zeros(3))) == 0


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
            for method in ("direct", "upstream", "alltoallv"):
                if method in r:
                    assert r[method] == r["truth"], (CASES[case], rank, method)
            for fault in ("flip", "transpose"):
                assert r[fault] is not None, f"{CASES[case]}: the {fault} on rank 5 went unnoticed on rank {rank}"
                message = r[fault][0]
                # Every rank stops with the same error, naming the step, rank 5 and the parameter.
                assert "step 3" in message and f"rollout rank 5, {named[fault]}:" in message, message
                assert message.count("rollout rank") == 1, message


def test_blocks_give_the_same_integer(monkeypatch):
    # Pieces of at most BLOCK elements: smaller blocks, more pieces, the same sum.
    x = torch.randn(5 * CHUNK + 123).to(torch.bfloat16)
    whole = int(tensor_checksum(x))
    rows = x[:5 * CHUNK // 1000 * 1000].view(-1, 1000)
    meta = torch.empty(rows.shape, device="meta")
    boxed = int(view_checksum(rows[:, 10:], meta[:, 10:]))
    monkeypatch.setattr(checksum, "BLOCK", 2 * CHUNK)
    assert int(tensor_checksum(x)) == whole == _definition_np(x, np.arange(x.numel()))
    assert int(view_checksum(rows[:, 10:], meta[:, 10:])) == boxed


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
