"""Rank coordinates of the placements equal the groups megatron-core and vLLM build themselves
(8 gloo processes)."""

from __future__ import annotations

import pytest

from verl_patches.reshard.coords import rollout_coords, train_coords, vllm_expert_range
from verl_patches.reshard.layouts import RolloutLayout
from verl_patches.launch.local_ranks import run_distributed

from verl_patches.rigs.testing.groupcheck import upstream_groups

# Multi-process or Ray: the slow tier (README: fast tier = -m 'not slow').
pytestmark = pytest.mark.slow

W = 8
MCASES = [(2, 2, 2), (4, 2, 1), (1, 4, 2), (2, 1, 4), (1, 2, 4)]
VCASES = [(2, 2, 16), (4, 1, 16), (1, 4, 16), (2, 4, 12), (1, 8, 20)]  # (tp, dp, experts): dp x tp = world or half


@pytest.fixture(scope="module")
def groups():
    return run_distributed(upstream_groups, W, MCASES, VCASES, env={"VLLM_PLUGINS": "verl_patches"},
                           timeout=280)


def test_train_coords_match_megatron(groups):
    for i, (t, p, e) in enumerate(MCASES):
        tc = train_coords(t, p, e, W)
        for r in range(W):
            got = groups[r]["megatron"][i]
            assert sorted(got["tp"]) == sorted(next(g for g in tc.tp_groups if r in g)), (t, p, e, r)
            assert got["pp"] == next(g for g in tc.pp_groups if r in g), (t, p, e, r)
            assert got["dp"] == next(g for g in tc.dp_groups if r in g), (t, p, e, r)
            assert got["ep"] == next(g for g in tc.expert_groups if r in g), (t, p, e, r)
            assert (got["tp_rank"], got["pp_rank"], got["ep_rank"]) == (tc.tp_rank[r], tc.pp_rank[r],
                                                                       tc.expert_rank[r])
            # moe_tp_extend_ep: the expert group is the union of t*e/t whole TP groups
            ep = set(got["ep"])
            assert len(ep) == t * e
            assert all(set(g) <= ep or not (set(g) & ep) for g in tc.tp_groups)


def test_rollout_coords_match_vllm(groups):
    for i, (tp, dp, experts) in enumerate(VCASES):
        rl = RolloutLayout(tp=tp, dp=dp, instances=W // (tp * dp))
        rc = rollout_coords(rl)
        for r in range(W):
            got = groups[r]["vllm"][i]
            assert got["tp"] == next(g for g in rc.tp_groups if r in g), (tp, dp, r)
            assert got["dp"] == next(g for g in rc.dp_groups if r in g), (tp, dp, r)
            assert got["ep"] == next(g for g in rc.ep_groups if r in g), (tp, dp, r)
            assert got["ep_rank"] == rc.ep_rank[r] and got["tp_rank"] == rc.tp_rank[r]
            a, b = vllm_expert_range(experts, got["ep_size"], got["ep_rank"])
            assert got["experts"] == list(range(a, b)), (tp, dp, experts, r)
