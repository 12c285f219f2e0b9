"""Seeded per-slice values: any box computed alone equals the same box of the full tensor."""

import torch

from verl_patches.reshard.values import box_values


def test_box_equals_slice_of_full_and_is_deterministic():
    shape = (6, 10, 7)
    full = box_values("w", shape, [(0, 6), (0, 10), (0, 7)], seed=3, step=1, dtype=torch.float32)
    box = [(2, 5), (4, 9), (1, 7)]
    part = box_values("w", shape, box, seed=3, step=1, dtype=torch.float32)
    assert torch.equal(part, full[2:5, 4:9, 1:7])
    assert torch.equal(part, box_values("w", shape, box, seed=3, step=1, dtype=torch.float32))


def test_name_seed_and_step_change_values():
    args = dict(shape=(64, 64), box=[(0, 64), (0, 64)], dtype=torch.float32)
    base = box_values("a", seed=0, step=0, **args)
    for other in (box_values("b", seed=0, step=0, **args), box_values("a", seed=1, step=0, **args),
                  box_values("a", seed=0, step=1, **args)):
        assert (other != base).float().mean() > 0.99


def test_large_index_space_beyond_32_bits_and_chunking():
    # A 671B-sized expert stack has more than 2**32 elements: indices above must not alias.
    shape = (256, 2048, 7168)
    lo = box_values("e", shape, [(0, 1), (0, 1), (0, 64)], seed=0, step=0, dtype=torch.float32)
    hi_row = (1 << 32) // (2048 * 7168)  # the row where flat indices pass 2**32
    hi = box_values("e", shape, [(hi_row, hi_row + 1), (0, 1), (0, 64)], seed=0, step=0, dtype=torch.float32)
    assert not torch.equal(lo, hi)
    # More rows than one hashing chunk: chunked result equals row-by-row results.
    big = box_values("e", (600, 8000), [(0, 600), (0, 8000)], seed=0, step=0, dtype=torch.bfloat16)
    row = box_values("e", (600, 8000), [(599, 600), (0, 8000)], seed=0, step=0, dtype=torch.bfloat16)
    assert torch.equal(big[599:600], row)
    assert float(big.float().abs().max()) <= 0.0505 and float(big.float().std()) > 0.02
