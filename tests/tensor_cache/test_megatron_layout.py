"""Generation layout -> the Megatron DP layout built by real megatron-core parallel_state on gloo,
moved by one all_to_all_single, bit-exact; matching layouts move nothing."""

import pytest

import tc_workers  # noqa: F401  (tests/tensor_cache is put on sys.path below)

from verl_patches.launch.local_ranks import run_distributed

# Multi-process or Ray: the slow tier (README: fast tier = -m 'not slow').
pytestmark = pytest.mark.slow


WORLD, TP, PP, BATCH = 8, 2, 2, 32


@pytest.fixture(scope="module")
def results():
    return run_distributed(tc_workers.all_checks, WORLD, TP, PP, BATCH, timeout=300)


@pytest.mark.slow
def test_generation_to_megatron_tp2_pp2_dp2_is_bit_exact(results):
    world, tp, pp, batch = WORLD, TP, PP, BATCH
    res = [r["megatron"] for r in results]
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
def test_permuted_layout_and_row_size_mismatch(results):
    assert all(r["permuted"]["exact"] and r["permuted"]["stats"].exchanged for r in results)
    msgs = [r["mismatch"] for r in results]
    assert all("pack rows of different byte sizes" in m and "rank 0: 12" in m and "rank 1: 8" in m for m in msgs)
