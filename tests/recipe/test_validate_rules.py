"""recipe_config.validate's rule groups, each on its own: a small config built for the one rule, the
error it names when the rule is broken and none when it holds (the whole validator runs on the shipped
configs in tests/recipe/test_configs.py)."""

from __future__ import annotations

from omegaconf import OmegaConf

from verl_patches.checks import recipe_config as rc

MODEL = {"num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 8}


def _cfg(tree: dict):
    return OmegaConf.create(tree)


def _recipe(section) -> dict:
    return {"actor_rollout_ref": {"rollout": {"recipe": section}}}


def test_recipe_section_rules():
    rep = rc.Report()
    assert rc.recipe_section_rules(rep, _cfg({})) is None and rep.errors == [f"{rc.RECIPE_SECTION} is missing"]
    rep = rc.Report()
    assert rc.recipe_section_rules(rep, _cfg(_recipe({"offload": "no"}))) == {"offload": "no"}
    assert rep.bad_values and rep.errors == [f"{rc.RECIPE_SECTION}.offload must be true or false, got the string "
                                             "'no' (write true or false without quotes)"]
    rep = rc.Report()
    assert rc.recipe_section_rules(rep, _cfg(_recipe({"vllm_dp": {"dp_size": "???"}}))) is None
    assert "no value for ['vllm_dp.dp_size']" in rep.errors[0]
    rep = rc.Report()
    assert rc.recipe_section_rules(rep, _cfg(_recipe({"vllm_dp": {"dp_size": 4}}))) == {"vllm_dp": {"dp_size": 4}}
    assert rep.errors == []


def test_setting_warnings():
    rep = rc.Report()
    rc.setting_warnings(rep, {"fingerprint_every": 10})
    assert rep.warnings == []
    rc.setting_warnings(rep, {"fingerprint_every": 0})
    assert len(rep.warnings) == 1 and "fingerprint_every=0" in rep.warnings[0] and rep.errors == []


def test_world_rules():
    rep = rc.Report()
    assert rc.world_rules(rep, _cfg({"trainer": {"nnodes": 2, "n_gpus_per_node": 8}})) == (2, 8, 16)
    assert rep.errors == []
    assert rc.world_rules(rep, _cfg({"trainer": {"nnodes": "2", "n_gpus_per_node": 8}})) == (None, 8, None)
    assert rep.errors == ["trainer.nnodes must be a positive integer, got '2' (a string: write the number without quotes)"]


def _train(tp=1, pp=2, ep=4, cp=1, ref_tp=None) -> dict:
    meg = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "expert_model_parallel_size": ep,
           "context_parallel_size": cp}
    return {"actor_rollout_ref": {"actor": {"megatron": meg},
                                  "ref": {"megatron": {**meg, "tensor_model_parallel_size": ref_tp or tp}}}}


def test_training_layout_rules():
    rmeg = rc._recipe_megatron({"megatron": {"num_layer_list": [2, 2]}})
    rep = rc.Report()
    train = rc.training_layout_rules(rep, _cfg(_train()), MODEL, rmeg, 8)
    assert rep.errors == [] and train["dp"] == 4 and train["expert_group"] == 4 and train["experts_per_rank"] == 2
    rep = rc.Report()
    rc.training_layout_rules(rep, _cfg(_train(ep=3, ref_tp=2)), MODEL, rc._recipe_megatron({}), 8)
    assert rep.errors == ["8 routed experts do not divide over the expert group of 3 ranks",
                          "expert group of 3 ranks does not divide the 4 ranks of one pipeline stage",
                          "ref.megatron.tensor_model_parallel_size=2 differs from actor's 1 (co-located layout)",
                          "num_layer_list has 0 stages, PP is 2",
                          "num_layer_list [] sums to 0, the model has 4 layers"]


def test_rollout_layout_rules():
    cfg = _cfg({"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 2}}})
    rep = rc.Report()
    out = rc.rollout_layout_rules(rep, cfg, {"vllm_dp": {"dp_size": 4}}, MODEL, 8)
    assert rep.errors == [] and out == {"tp": 2, "dp": 4, "instances": 1, "ep": 8, "experts_per_rank": 1}
    rc.rollout_layout_rules(rep, cfg, {"vllm_dp": {"dp_size": 2}}, MODEL, 8)
    assert rep.errors == ["rollout DP2 x TP2 x 1 instance(s) = 4, world size is 8"]


def _batch(**over) -> dict:
    actor = {"ppo_mini_batch_size": 4, "use_dynamic_bsz": False, "ppo_epochs": 1, "ppo_micro_batch_size_per_gpu": 1,
             "recompute_old_log_prob": True, **over}
    return {"data": {"train_batch_size": 8}, "algorithm": {"adv_estimator": "grpo"},
            "actor_rollout_ref": {"actor": actor, "rollout": {"n": 2}}}


def test_batch_rules():
    rep = rc.Report()
    rc.batch_rules(rep, _cfg(_batch()), 4)
    assert rep.errors == []
    rc.batch_rules(rep, _cfg(_batch(ppo_mini_batch_size=3, recompute_old_log_prob=False)), 4)
    assert rep.errors == ["train_batch_size 8 not divisible by ppo_mini_batch_size 3",
                          "recompute_old_log_prob=False needs one optimizer step per batch: "
                          "ppo_mini_batch_size (3) == train_batch_size (8) and ppo_epochs == 1"]


def test_fixed_routing_rules():
    cfg = _cfg({"actor_rollout_ref": {"actor": {"load_weight": True}, "ref": {"load_weight": False}}})
    rep = rc.Report()
    rc.fixed_routing_rules(rep, cfg, {})
    rc.fixed_routing_rules(rep, cfg, {"fixed_routing": False})
    assert rep.errors == []
    rc.fixed_routing_rules(rep, cfg, {"fixed_routing": True})
    assert rep.errors == [f"{rc.RECIPE_SECTION}.fixed_routing=True with actor.load_weight=True: forced routing is "
                          "for random-init throughput runs only (turn one of them off)"]


def test_engine_rules():
    def cfg(eager, free, device="cuda"):
        return _cfg({"trainer": {"device": device}, "actor_rollout_ref": {"rollout": {
            "enforce_eager": eager, "free_cache_engine": free, "enable_chunked_prefill": True}}})
    rep = rc.Report()
    rc.engine_rules(rep, cfg(False, False), {}, {})
    assert rep.errors == []
    rc.engine_rules(rep, cfg(False, True), {}, {})
    assert rep.errors == ["rollout.enforce_eager=False (graph mode) needs rollout.free_cache_engine=False (verl asserts it)"]
    rep = rc.Report()
    rc.engine_rules(rep, cfg("false", False), {}, {})
    assert rep.bad_values and rep.errors == ["actor_rollout_ref.rollout.enforce_eager must be true or false, got 'false'"]
    rep = rc.Report()
    rc.engine_rules(rep, cfg(False, False, "npu"), {}, {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"})
    assert len(rep.errors) == 1 and "expandable_segments" in rep.errors[0]


def test_length_rules():
    def cfg(budget):
        return _cfg({"data": {"max_prompt_length": 100, "max_response_length": 28},
                     "actor_rollout_ref": {"actor": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": budget},
                                           "rollout": {"max_num_batched_tokens": 64, "enable_chunked_prefill": True}}})
    rep = rc.Report()
    rc.length_rules(rep, cfg(128), {**MODEL, "max_position_embeddings": 128})
    assert rep.errors == [] and len(rep.notes) == 1 and "max_num_batched_tokens=64 < max_model_len 128" in rep.notes[0]
    rc.length_rules(rep, cfg(127), {**MODEL, "max_position_embeddings": 100})
    assert [e.split(" ")[0] for e in rep.errors] == ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=127", "prompt"]


def test_model_rules():
    cfg = _cfg({"actor_rollout_ref": {"actor": {"megatron": {"use_dist_checkpointing": True,
                                                             "dist_checkpointing_path": " "}},
                                      "model": {"override_config": {"model_config": {"num_nextn_predict_layers": 0}}}}})
    rep = rc.Report()
    rc.model_rules(rep, cfg, {**MODEL, "num_nextn_predict_layers": 1})
    assert rep.errors == ["actor.megatron.use_dist_checkpointing=True but dist_checkpointing_path is empty "
                          "(set DIST_CKPT_PATH)"]
    rep = rc.Report()
    rc.model_rules(rep, _cfg({}), {**MODEL, "quantization_config": {"quant_method": "fp8"}, "num_nextn_predict_layers": 1})
    assert [e.split(":")[0] for e in rep.errors] == ["model config has quantization_config", "MTP must be off"]


def test_card_rules():
    rep = rc.Report()
    rc.card_rules(rep, {"devices_per_card": 2}, 16, 2, 8)
    rc.card_rules(rep, {}, 16, 2, 8)
    assert rep.errors == []
    rc.card_rules(rep, {"devices_per_card": 3}, 16, 2, 8)
    assert rep.errors == [f"{rc.RECIPE_SECTION}.devices_per_card=3: the world size 16 (trainer.nnodes 2 x "
                          "trainer.n_gpus_per_node 8) is not whole cards of 3 device(s)"]


def test_profile_rules():
    def run(profile, world=4, total=12, recompute=True):
        rep = rc.Report()
        cfg = _cfg({"trainer": {"total_training_steps": total},
                    "actor_rollout_ref": {"actor": {"recompute_old_log_prob": recompute}}})
        rc.profile_rules(rep, cfg, {"profile": profile}, world)
        return rep

    on = {"stages": ["update"], "dir": "d"}
    assert run({"stages": [], "ranks": [9]}).errors == []  # off: nothing judged
    rep = run({**on, "ranks": [0, 4, 7]})
    assert rep.errors == [f"{rc.RECIPE_SECTION}.profile.ranks=[0, 4, 7]: the run has ranks 0..3 (trainer.nnodes x "
                          "trainer.n_gpus_per_node), not [4, 7]"]
    assert run({**on, "ranks": "all"}).errors == [] and run({**on, "ranks": [3]}).errors == []
    rep = run({**on, "steps": [13, 14]})
    assert rep.errors == [] and rep.warnings == [f"{rc.RECIPE_SECTION}.profile.steps=[13, 14] starts after "
                                                 "trainer.total_training_steps=12: no trace will be written"]
    assert run({**on, "steps": [12, 14]}).warnings == []
    rep = run({"stages": ["old_log_prob"], "dir": "d"}, recompute=False)
    assert len(rep.warnings) == 1 and "recompute_old_log_prob=False reuses the update's log-prob" in rep.warnings[0]
    assert run({"stages": ["old_log_prob"], "dir": "d"}).warnings == []
