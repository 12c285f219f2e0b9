"""The exchange planner without communication: who sends which rows, replicas, local copies, errors."""

import pytest
import torch

from verl_patches.tensor_cache import LayoutError, generation_rows, megatron_dp_rows, plan_exchange


def _simulate(held, wanted):
    """Run every rank's plan on in-memory data where row id i carries the value 1000 + i."""
    world = len(held)
    data = [torch.as_tensor(h, dtype=torch.int64) + 1000 for h in held]
    plans = [plan_exchange(held, wanted, r) for r in range(world)]
    out = []
    for r, plan in enumerate(plans):
        if not plan.needs_exchange:
            out.append(data[r][plan.local_positions])
            continue
        arrived = torch.cat([data[s][plans[s].send_positions[r]] for s in range(world)])
        assert arrived.numel() == sum(plan.recv_counts)
        res = torch.empty(len(wanted[r]), dtype=torch.int64)
        res[plan.recv_slots] = arrived
        out.append(res)
    return plans, out


def test_generation_to_megatron_blocks_keep_order():
    world, batch, dp = 8, 32, 2
    held = [generation_rows(batch, world, r) for r in range(world)]
    # Megatron TP2 PP2 DP2 with order tp-cp-ep-dp-pp: dp rank of global rank r is (r // 2) % 2.
    wanted = [megatron_dp_rows(batch, dp, (r // 2) % 2) for r in range(world)]
    plans, out = _simulate(held, wanted)
    for r in range(world):
        assert torch.equal(out[r], wanted[r] + 1000)
        # Each generation block goes to the t*p = 4 ranks of the DP group that owns it, nowhere else.
        assert sum(1 for c in plans[r].send_counts if c) == 4
        assert sum(plans[r].send_counts) == 4 * (batch // world)


def test_matching_layouts_need_no_exchange_on_any_rank():
    world, batch = 4, 16
    held = [megatron_dp_rows(batch, 2, r % 2) for r in range(world)]
    plans, out = _simulate(held, held)
    assert not any(p.needs_exchange for p in plans)
    assert all(torch.equal(out[r], held[r] + 1000) for r in range(world))


def test_subset_held_locally_is_a_local_copy():
    held = [torch.arange(0, 8), torch.arange(8, 16)]
    wanted = [torch.tensor([7, 1, 3]), torch.tensor([8])]
    plans, out = _simulate(held, wanted)
    assert not plans[0].needs_exchange and torch.equal(out[0], torch.tensor([1007, 1001, 1003]))


def test_replicated_source_prefers_self_and_spreads_the_rest():
    # Rows 0..3 replicated on ranks 0 and 1; rank 2 and 3 want all of them.
    held = [torch.arange(4), torch.arange(4), torch.arange(4, 6), torch.arange(6, 8)]
    wanted = [torch.arange(4), torch.arange(4), torch.arange(4), torch.arange(4)]
    plans, out = _simulate(held, wanted)
    assert all(torch.equal(out[r], torch.arange(4) + 1000) for r in range(4))
    # Rank 0 and 1 copy locally; rank 2 reads replica 2 % 2 = 0, rank 3 reads replica 1.
    assert plans[0].send_counts == (4, 0, 4, 0) and plans[1].send_counts == (0, 4, 0, 4)


def test_permutation_from_batch_balancing():
    world, batch = 4, 24
    g = torch.Generator().manual_seed(3)
    order = torch.randperm(batch, generator=g)
    held = [generation_rows(batch, world, r) for r in range(world)]
    wanted = [order[(r % 2) * 12:(r % 2 + 1) * 12] for r in range(world)]
    _, out = _simulate(held, wanted)
    assert all(torch.equal(out[r], wanted[r] + 1000) for r in range(world))


def test_errors_name_the_problem():
    with pytest.raises(LayoutError, match="does not split into 3 equal chunks"):
        generation_rows(10, 3, 0)
    with pytest.raises(LayoutError, match="does not split into 4 equal DP chunks"):
        megatron_dp_rows(10, 4, 1)
    with pytest.raises(LayoutError, match=r"rank 1 wants rows \[9\] that no rank holds"):
        plan_exchange([torch.arange(4), torch.arange(4, 8)], [torch.arange(4), torch.tensor([9])], 0)
    with pytest.raises(LayoutError, match="rank 0 holds some rows twice"):
        plan_exchange([torch.tensor([1, 1]), torch.arange(2)], [torch.arange(1), torch.arange(1)], 0)
    with pytest.raises(LayoutError, match="held rows given for 2 ranks but wanted rows for 1"):
        plan_exchange([torch.arange(1), torch.arange(1)], [torch.arange(1)], 0)
