"""Rank functions for the TensorCache distributed tests (module level: run_distributed spawns)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl_patches.tensor_cache import TensorCache, generation_rows, megatron_dp_rows, relayout


def step_batch(batch: int, prompt: int, response: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The full batch a generation step produces, with row-specific random content in several dtypes."""
    g = torch.Generator().manual_seed(seed)
    seq = prompt + response
    return {
        "input_ids": torch.randint(0, 2**40, (batch, seq), generator=g, dtype=torch.int64),
        "attention_mask": torch.randint(0, 2, (batch, seq), generator=g, dtype=torch.int64),
        "responses": torch.randint(0, 2**31, (batch, response), generator=g, dtype=torch.int64),
        "ref_log_prob": torch.randn(batch, response, generator=g, dtype=torch.float32),
        # bf16 and bool: bytes must travel unchanged, NaN payloads included.
        "scores_bf16": torch.randn(batch, response, generator=g).to(torch.bfloat16),
        "flags": torch.randint(0, 2, (batch,), generator=g, dtype=torch.int64).bool(),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def megatron_relayout(rank: int, world: int, tp: int, pp: int, batch: int) -> dict:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        full = step_batch(batch, 6, 10)
        full["scores_bf16"][0, 0] = float("nan")
        gen_rows = generation_rows(batch, world, rank)
        mine = {k: v[gen_rows].clone() for k, v in full.items()}
        wanted = megatron_dp_rows(batch, dp_size, dp_rank)

        cache = TensorCache()
        cache.begin("step-1")
        cache.put(mine, gen_rows)
        stats = cache.relayout(wanted)
        got = cache.get(full)
        exact = all(torch.equal(_bits(got[k]), _bits(full[k][wanted])) and got[k].dtype == full[k].dtype for k in full)

        # Reference -> update: same layout, and the claim "unchanged" runs no collective at all.
        before = {k: v for k, v in got.items()}
        same = cache.relayout(wanted, unchanged=True)
        untouched = all(cache.get([k])[k] is before[k] for k in full)
        # Without the claim the planner finds every row local: no all-to-all either.
        again_out, again = relayout(cache.get(full), wanted, wanted)
        return {
            "dp_rank": dp_rank, "dp_size": dp_size,
            "mp_group": dist.get_process_group_ranks(ps.get_model_parallel_group()),
            "exact": exact, "stats": stats, "same": same, "untouched": untouched,
            "again": again, "again_exact": all(torch.equal(_bits(again_out[k]), _bits(full[k][wanted])) for k in full),
        }
    finally:
        ps.destroy_model_parallel()


def permuted_relayout(rank: int, world: int, batch: int, seed: int) -> dict:
    """Generation layout -> an arbitrary order split over 2 DP chunks (what batch balancing makes)."""
    full = step_batch(batch, 3, 5, seed)
    order = torch.randperm(batch, generator=torch.Generator().manual_seed(seed))
    held = generation_rows(batch, world, rank)
    dp_size = 2
    per = batch // dp_size
    dp_rank = rank % dp_size
    wanted = order[dp_rank * per:(dp_rank + 1) * per]
    out, stats = relayout({k: v[held] for k, v in full.items()}, held, wanted)
    return {"exact": all(torch.equal(_bits(out[k]), _bits(full[k][wanted])) for k in full), "stats": stats}


def all_checks(rank: int, world: int, tp: int, pp: int, batch: int) -> dict:
    """Every distributed check in one spawn of ``world`` ranks (starting processes dominates)."""
    return {"megatron": megatron_relayout(rank, world, tp, pp, batch),
            "permuted": permuted_relayout(rank, world, batch, 5),
            "mismatch": mismatched_rows(rank, world)}


def mismatched_rows(rank: int, world: int) -> str:
    t = torch.zeros(4, 3 if rank == 0 else 2)
    try:
        relayout({"x": t}, torch.arange(rank * 4, rank * 4 + 4), torch.arange(4))
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"
