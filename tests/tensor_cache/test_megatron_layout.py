"""Generation layout -> the Megatron DP layout built by real megatron-core parallel_state on gloo,
moved by one all_to_all_single, bit-exact; matching layouts move nothing."""

import pytest

import tc_workers  # noqa: F401  (tests/tensor_cache is put on sys.path below)

from verl_patches.testing.dist import DistributedFailure, run_distributed


@pytest.mark.slow
def test_generation_to_megatron_tp2_pp2_dp2_is_bit_exact():
    world, tp, pp, batch = 8, 2, 2, 32
    res = run_distributed(tc_workers.megatron_relayout, world, tp, pp, batch, timeout=240)
    assert {r["dp_size"] for r in res} == {2}
    for rank, r in enumerate(res):
        # The ranks that hold one DP chunk are megatron's model-parallel group (t*p = 4 ranks).
        assert len(r["mp_group"]) == tp * pp and {res[m]["dp_rank"] for m in r["mp_group"]} == {r["dp_rank"]}
        assert r["exact"], f"rank {rank}: rows differ from the Megatron DP chunk"
        s = r["stats"]
        assert s.exchanged and s.rows_received == batch // 2
        # Each rank's generation block (batch/world rows) goes to the 4 ranks owning it.
        assert s.rows_sent == tp * pp * (batch // world)
        assert not r["same"].exchanged and r["untouched"]
        assert not r["again"].exchanged and r["again_exact"]


@pytest.mark.slow
def test_permuted_layout_and_row_size_mismatch():
    res = run_distributed(tc_workers.permuted_relayout, 4, 24, 5, timeout=120)
    assert all(r["exact"] and r["stats"].exchanged for r in res)
    msgs = run_distributed(tc_workers.mismatched_rows, 2, timeout=120)
    assert all("pack rows of different byte sizes" in m and "rank 0: 12" in m and "rank 1: 8" in m for m in msgs)
