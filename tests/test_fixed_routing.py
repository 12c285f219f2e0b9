"""recipe.fixed_routing: the balanced assignment, and the three router patches it switches.

Real upstream code: megatron-core 0.12.1's TopKRouter (built on CPU; torch.cuda.current_device answers
"cpu", a declared stand-in, because the router moves its weight to the current CUDA device) and vLLM
0.9.1's FusedMoE.select_experts (through its custom-routing branch: the default top-k is a CUDA kernel
the CPU build lacks). vLLM-Ascend's AscendFusedMoE needs torch_npu, so its wrapper is checked on a
declared stand-in with the upstream signature from the record's fingerprint.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.core.test_call_shapes import standin_from_signature
from verl_patches.train import fixed_routing as fr
from verl_patches.checks import recipe_config as RC
from verl_patches.core import apply as ap
from verl_patches.patches.megatron import patch_core_transformer_moe_router as mrouter
from verl_patches.patches.vllm import patch_model_executor_layers_fused_moe_layer as vmoe
from verl_patches.patches.vllm_ascend import patch_ops_fused_moe as amoe


@pytest.fixture
def switch(monkeypatch):
    monkeypatch.setenv(fr.ENV, "0")  # recorded, so the variable's earlier state comes back afterwards
    yield fr.configure


def test_balanced_ids_are_distinct_per_token_and_even_per_expert():
    ids = fr.balanced_expert_ids(64, 8, 256)  # one decode batch per rank of the reference rollout
    assert ids.shape == (64, 8) and all(len(set(r.tolist())) == 8 for r in ids)
    assert torch.bincount(ids.flatten(), minlength=256).tolist() == [2] * 256
    uneven = torch.bincount(fr.balanced_expert_ids(10, 3, 8).flatten(), minlength=8)
    assert int(uneven.max() - uneven.min()) <= 1
    with pytest.raises(fr.FixedRoutingError, match="top_k <= num_experts"):
        fr.balanced_expert_ids(4, 9, 8)


FLAG = "actor_rollout_ref.rollout.recipe.fixed_routing"


def test_the_switch_comes_from_the_run_config_and_rejects_non_booleans(switch):
    cfg = RC.compose("deepseekv3_256die_random_init")
    assert fr.configure_from_worker_config(cfg.actor_rollout_ref) is True and fr.enabled()
    cfg = RC.compose("deepseekv3_256die_random_init", [f"{FLAG}=False"])
    assert fr.configure_from_worker_config(cfg.actor_rollout_ref) is False and not fr.enabled()
    with pytest.raises(fr.FixedRoutingError, match="true or false"):
        switch("yes")


@pytest.mark.parametrize("name, on", [("deepseekv3_256die_random_init", True), ("deepseekv3_128gpu_random_init", True),
                                      ("deepseekv3_256die_true_weight", False), ("deepseekv3_128gpu_true_weight", False)])
def test_on_in_the_random_init_runs_and_off_with_real_weights(name, on):
    # The reference timed its random-init run (250 TPS/card) with the experts forced balanced; with
    # real weights the routing is what is trained (docs/RECIPE.md, "Fixed routing").
    from verl_patches.config import settings

    cfg = RC.compose(name)
    assert settings.from_trainer(cfg).fixed_routing is on
    assert bool(cfg.actor_rollout_ref.actor.load_weight) is not on


def test_the_checker_accepts_it_for_random_init_and_refuses_it_with_real_weights():
    model = RC.load_model_config(RC.DEFAULT_MODEL_CONFIG)
    on = [f"{FLAG}=True"]
    assert RC.validate(RC.compose("deepseekv3_256die_random_init"), model).errors == []
    errors = RC.validate(RC.compose("deepseekv3_256die_true_weight",
                                    [*on, "actor_rollout_ref.actor.megatron.dist_checkpointing_path=/c"]), model).errors
    assert any("fixed_routing=True with actor/ref.load_weight=True" in e for e in errors), errors


def _router(monkeypatch, dispatcher="alltoall"):
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # stand-in, see the module docstring
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=16,
                            moe_router_topk=4, moe_router_score_function="sigmoid",
                            moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                            moe_router_load_balancing_type="none", moe_token_dispatcher_type=dispatcher,
                            use_cpu_initialization=True, add_bias_linear=False)
    torch.manual_seed(0)
    return TopKRouter(cfg)


def test_megatron_router_routes_balanced_only_when_switched_on(monkeypatch, switch):
    router = _router(monkeypatch)
    x = torch.randn(8, 4, 16)  # [seq, batch, hidden]: 32 tokens x top-4 over 16 experts = 8 each
    upstream_probs, upstream_map = router(x)
    ap.apply_all(mrouter.PATCHES)
    try:
        switch(False)
        probs, rmap = router(x)
        assert torch.equal(probs, upstream_probs) and torch.equal(rmap, upstream_map)
        switch(True)
        probs, rmap = router(x)
        assert rmap.sum(dim=0).tolist() == [8] * 16 and rmap.sum(dim=1).tolist() == [4] * 32
        assert not torch.equal(rmap, upstream_map)
        assert torch.equal(probs != 0, rmap)
        torch.testing.assert_close(probs.sum(dim=1), torch.full((32,), 2.5))
        probs.sum().backward()  # the router still learns through the scores it kept
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    finally:
        ap.undo([p.id for p in mrouter.PATCHES])


def test_megatron_router_refuses_the_sequence_gathering_dispatcher(monkeypatch, switch):
    router = _router(monkeypatch, dispatcher="alltoall_seq")
    ap.apply_all(mrouter.PATCHES)
    try:
        switch(True)
        with pytest.raises(fr.FixedRoutingError, match="not alltoall_seq"):
            router.routing(torch.randn(8, 16))
    finally:
        ap.undo([p.id for p in mrouter.PATCHES])


def test_vllm_select_experts_routes_balanced_only_when_switched_on(switch):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    def topk_routing(hidden_states, gating_output, topk, renormalize):
        w, i = torch.topk(torch.softmax(gating_output, dim=-1), topk, dim=-1)
        return w, i.to(torch.int32)

    logits = torch.randn(16, 8)
    logits[:, 0] += 100  # the router's choice: expert 0 for every token
    call = dict(hidden_states=torch.randn(16, 4), router_logits=logits, top_k=2, use_grouped_topk=False,
                renormalize=True, custom_routing_function=topk_routing)
    w_up, ids_up = FusedMoE.select_experts(**call)
    ap.apply_all(vmoe.PATCHES)
    try:
        switch(False)
        w, ids = FusedMoE.select_experts(**call)
        assert torch.equal(ids, ids_up) and torch.equal(w, w_up)
        switch(True)
        w, ids = FusedMoE.select_experts(**call)
        assert ids.dtype == ids_up.dtype and torch.equal(w, w_up)
        assert torch.bincount(ids.flatten().long(), minlength=8).tolist() == [4] * 8
    finally:
        ap.undo([p.id for p in vmoe.PATCHES])


def test_vllm_ascend_forward_gets_its_own_force_balance_flag(switch):
    (p,) = amoe.PATCHES
    seen = []
    stand_in = standin_from_signature(p.fingerprint.signature)  # declared stand-in: upstream's signature

    def record(self, hidden_states, router_logits, is_prefill, enable_force_load_balance=False, top_k=None,
               shared_experts=None, gate=None, _metadata_for_padding=None):
        seen.append(enable_force_load_balance)

    record.__signature__ = inspect.signature(stand_in)
    forward = amoe.wrap_forward(record)
    switch(False)
    forward("layer", "h", "logits", False)
    forward("layer", "h", "logits", True, enable_force_load_balance=False)
    forward("layer", "h", "logits", False, False, 8)
    switch(True)
    forward("layer", "h", "logits", False)
    forward("layer", "h", "logits", True, enable_force_load_balance=False)
    forward("layer", "h", "logits", False, False, 8)
    assert seen == [False, False, False, True, True, True]
