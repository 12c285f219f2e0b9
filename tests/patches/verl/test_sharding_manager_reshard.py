"""verl's real MegatronVLLMShardingManager entered with patch verl.sharding_manager.reshard: a real
megatron-core 0.12.1 actor (MLA + MoE) resharded straight into a real vLLM 0.9.1 DeepseekV3 model
on CPU equals vLLM's own load_weights of the same weights, MLA's derived tensors included, in the
switch schedule's order. Stand-ins (declared in verl_patches/rigs/testing/live_models.py and
binding_check.py): the engine wrapper around the vLLM model, the worker's generate_sequences wrapper
(the switch loop's begin and end of a rollout segment), and the few CUDA-only calls of the CPU build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_patches.rigs.testing.binding_check import sharding_manager_rank
from verl_patches.launch.local_ranks import run_distributed
from verl_patches.offload.schedule import our_steps

# Multi-process or Ray: the slow tier (README: fast tier = -m 'not slow').
pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[3] / "configs/model/tiny_deepseek_v3.json"
# What the engine stand-in and the training params' group record, in the switch loop's order.
RECORDED = {"alloc_rollout_weights": "wake_up:weights", "offload_train_params": "offload_train_params",
            "init_kv_cache": "wake_up:kv_cache", "generate": "generate", "release_rollout_weights": "sleep:1"}
SCHEDULE = [RECORDED[s.name] for s in our_steps() if s.name in RECORDED]
# The loop's steps this process has (only the training params are attached): a generation, then
# one again right after it (validation's repeat brings the params back first).
LOOP = ["reshard", "offload_train_params", "rollout_again", "reshard", "offload_train_params"]
CASES = [
    dict(grouped=True, method="direct", dtype="float32", patched=False),   # upstream __enter__
    dict(grouped=False, method="direct", dtype="float32"),                 # SequentialMLP experts
    dict(grouped=True, method="direct", dtype="bfloat16",                  # GroupedMLP (MindSpeed), fp32 expert bias,
         recipe={"reshard_bucket_mb": 1}),                                 # 1 MiB transfer buckets
    dict(grouped=True, method="alltoallv", dtype="float32"),                  # method B in the same binding
    dict(grouped=True, method="direct", dtype="float32", recipe={"megatron": {"num_layer_list": [3, 1]}}),
    dict(grouped=True, method="direct", dtype="bfloat16", ddp=True),      # megatron DDP + the real ActorMemory
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_dsv3")
    (d / "config.json").write_text(CONFIG.read_text())
    return run_distributed(sharding_manager_rank, 1, str(d), CASES, timeout=400)[0]


@pytest.mark.parametrize("case", [1, 2, 3, 5], ids=["sequential-direct-fp32", "grouped-direct-bf16",
                                                  "grouped-recipe-fp32", "ddp-actor-memory-bf16"])
def test_reshard_into_vllm_equals_vllms_own_load(results, case):
    r = results[case]
    assert r["error"] is None
    assert r["differ_before"] > 0  # the rollout model started with other weights
    assert r["mismatch"] == []
    assert r["mla_layers"] == json.loads(CONFIG.read_text())["num_hidden_layers"]
    assert r["mla_mismatch"] == []  # W_UK_T / W_UV recomputed from the new kv_b_proj
    # freed with the weights (what the recipe engine's offload does), back after the next switch
    assert r["mla_freed_bytes"] > 0 and r["mla_emptied"]
    assert r["mla_mismatch_after_release"] == []


def test_the_plan_takes_the_bucket_from_the_recipe_setting(results):
    """recipe.reshard_bucket_mb reaches the run's plan (the sharding manager's _build_session); absent, 256."""
    assert results[1]["error"] is None and results[1]["bucket_bytes"] == 256 << 20
    r = results[2]
    assert r["error"] is None and r["bucket_bytes"] == 1 << 20


def test_switch_schedule_order(results):
    # weights allocated, reshard, training params offloaded, then the KV cache; upstream's exit
    assert SCHEDULE == ["wake_up:weights", "offload_train_params", "wake_up:kv_cache", "generate", "sleep:1"]
    for case in (1, 2, 3):
        assert results[case]["events"][:5] == SCHEDULE
        assert results[case]["ledger_steps"] == LOOP


def test_without_the_patch_the_rollout_model_does_not_get_the_weights(results):
    r = results[0]
    assert r["mismatch"] or r["error"]
    # upstream's __enter__ wakes the weights and fails on the stand-in config before reaching any step
    assert r["events"][0] == "wake_up:weights" and "offload_train_params" not in r["events"]


def test_a_wrong_layer_list_is_refused_before_anything_moves(results):
    r = results[4]
    assert "num_layer_list" in (r["error"] or "")
    assert len(r["mismatch"]) == r["differ_before"]
    assert r["events"] == []  # nothing allocated, nothing offloaded


# The direct method here; B ("alltoallv") and A ("upstream") equal it bit for bit in
# tests/reshard/test_bitexact.py, and A runs through verl's trainer in tests/recipe/test_train_tiny.py.
@pytest.mark.parametrize("method", ["direct"])
def test_four_ranks_megatron_tp2_pp2_uneven_to_vllm_tp4_ep4(tmp_path, method):
    """Real megatron-core parallel state on 4 gloo ranks (TP2, PP2 with layers 3,1, experts over
    the TP x EP group) into a real vLLM TP4 / EP4 model on every rank; the layout facts each rank
    reads from its own storage (stage 1 has no dense layer) are agreed by all ranks."""
    from verl_patches.rigs.testing.binding_check import sharding_manager_multirank

    (tmp_path / "config.json").write_text(CONFIG.read_text())
    # recipe.reshard_bucket_mb 1: the plan's bucket is 1 MiB, and this layout's transfers (up to 0.6 MB
    # received per rank, fp32) take two buckets where the default 256 MiB takes one.
    res = run_distributed(sharding_manager_multirank, 4, str(tmp_path), {"tp": 2, "pp": 2, "layers": [3, 1]}, 4,
                          method, 1, timeout=400)
    for rank, r in enumerate(res):
        assert r["differ_before"] > 0 and r["mismatch"] == [] and r["mla_mismatch"] == [], (rank, r)
        assert r["local_layers"] == (["0", "1", "2"] if rank < 2 else ["0"]), (rank, r["local_layers"])
        assert r["events"][-5:] == SCHEDULE, r["events"]
        assert "layers=(3, 1)" in r["layout"] and "ep=1" in r["layout"], r["layout"]
        assert r["experts_checked"] == 3  # vLLM's expert_map on each MoE layer matches the plan
        assert r["bucket_bytes"] == 1 << 20 and r["buckets"] == 2, (rank, r["bucket_bytes"], r["buckets"])


def test_with_the_workers_actor_memory_the_training_params_leave_after_the_reshard(results):
    """The contract with patch verl.megatron_worker.offload_init: the manager reshards from the
    resident params of megatron's DDP buffers, then the real ActorMemory moves them to host."""
    r = results[5]
    assert r["error"] is None and r["mismatch"] == []
    assert r["train_params_offloaded"] and r["train_params_back_exact"]
    assert r["ledger_steps"] == ["attach:ActorMemory", *LOOP[:2], "check:in", "check:out", *LOOP[2:]]


def test_experts_placed_elsewhere_by_vllm_are_refused():
    """An expert map that is not vLLM's contiguous default (vLLM-Ascend's expert_map_path or
    dynamic EPLB) is refused by layer before anything is resharded."""
    import torch

    from verl_patches.reshard.binding import check_expert_placement
    from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
    from verl_patches.reshard.model import LayoutError, ModelConfig
    from verl_patches.reshard.placements import build_placements

    P = build_placements(ModelConfig.load(str(CONFIG)), TrainLayout.parse("tp=1,pp=1,ep=1"),
                         RolloutLayout(tp=1, dp=4))
    moe = torch.nn.Module()
    moe.w13_weight = torch.nn.Parameter(torch.empty(4, 1, 1))
    E = json.loads(CONFIG.read_text())["n_routed_experts"]
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    model.layers[1].mlp = torch.nn.Module()
    model.layers[1].mlp.experts = moe
    wrapper = torch.nn.Module()
    wrapper.model = model
    moe.expert_map = torch.tensor([-1] * 4 + [0, 1, 2, 3] + [-1] * (E - 8))  # rank 1: experts 4..7
    assert check_expert_placement(wrapper, P, 1) == 1
    moe.expert_map = torch.tensor([0, 1, 2, 3] + [-1] * (E - 4))  # rank 1 given experts 0..3
    with pytest.raises(LayoutError, match=r"model.layers.1.mlp.experts.*\[4, 8\)"):
        check_expert_placement(wrapper, P, 1)
