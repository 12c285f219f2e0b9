"""The recipe's Hydra configs composed with the real verl 0.4.1 config tree, and the layout checker.

Layouts and the main hyperparameters of both runs are checked here, mutations show each check can fail;
every setting of the reference's two runs is compared row by row in test_parity.py (docs/RECIPE.md,
"Hyperparameter parity"), with nothing skipped.
"""

import dataclasses
import json

import pytest
from omegaconf import OmegaConf

from verl_patches.checks import recipe_config as RC

MODEL_JSON = RC.DEFAULT_MODEL_CONFIG
# configs/model/deepseek_v3.json belongs to the reshard work; the facts the layout needs
# are DeepSeek-V3's published ones, used when that file is not there yet.
FALLBACK_MODEL = {"num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256,
                  "max_position_embeddings": 163840, "num_nextn_predict_layers": 0,
                  "rope_scaling": {"type": "yarn", "factor": 40}}
CKPT = ["actor_rollout_ref.actor.megatron.dist_checkpointing_path=/ckpt/dsv3"]


@pytest.fixture(scope="module")
def model():
    return RC.load_model_config(MODEL_JSON) if MODEL_JSON.is_file() else dict(FALLBACK_MODEL)


@pytest.fixture(scope="module")
def random_init():
    return RC.compose("deepseekv3_256die_random_init")


@pytest.fixture(scope="module")
def true_weight():
    return RC.compose("deepseekv3_256die_true_weight", CKPT)


def test_inherits_verl_tree(random_init):
    # Keys only verl's ppo_megatron_trainer defines are present: the defaults list resolved through pkg://.
    assert random_init.critic.cliprange_value == 0.5
    assert random_init.ray_init.num_cpus is None
    assert set(random_init.keys()) == {"data", "actor_rollout_ref", "critic", "reward_model",
                                       "custom_reward_function", "algorithm", "trainer", "ray_init"}


@pytest.mark.parametrize("name", RC.RUN_CONFIGS)
def test_reference_hyperparameters(name, random_init, true_weight):
    cfg = random_init if name.endswith("random_init") else true_weight
    a = cfg.actor_rollout_ref
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.trainer.total_training_steps == 100
    assert a.actor.optim.lr == 1e-6 and a.actor.optim.lr_decay_style == "constant" and a.actor.optim.clip_grad == 1.0
    assert cfg.data.train_batch_size == a.actor.ppo_mini_batch_size == 512
    assert a.rollout.n == 16
    assert (a.rollout.temperature, a.rollout.top_p, a.rollout.top_k) == (0.9, 0.9, 50)
    assert a.actor.use_kl_loss is True and a.actor.kl_loss_type == "low_var_kl" and a.actor.kl_loss_coef == 0.001
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (1024, 3072)
    assert a.actor.ppo_micro_batch_size_per_gpu == 1
    assert a.rollout.log_prob_micro_batch_size_per_gpu == 4
    assert a.ref.log_prob_micro_batch_size_per_gpu == 8
    assert a.actor.recompute_old_log_prob is False
    assert a.rollout.max_num_batched_tokens == 1024 and a.rollout.enable_chunked_prefill is True
    assert a.rollout.ignore_eos is name.endswith("random_init")
    # One reward route: the registered patch on verl's default scorer, not a custom function.
    assert cfg.custom_reward_function.path is None


@pytest.mark.parametrize("name, dp, inst, ep", [("deepseekv3_256die_random_init", 128, 1, 256),
                                                ("deepseekv3_256die_true_weight", 64, 2, 128)])
def test_layout_arithmetic(name, dp, inst, ep, model, random_init, true_weight):
    cfg = random_init if name.endswith("random_init") else true_weight
    rep = RC.validate(cfg, model)
    assert rep.errors == []
    lay = rep.layout
    assert lay["world"] == 256 == cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    t = lay["train"]
    assert (t["tp"], t["pp"], t["ep"], t["etp"]) == (4, 8, 32, 1)
    assert t["tp"] * t["pp"] * t["dp"] == 256 and t["dp"] == 8
    assert sum(t["num_layer_list"]) == model["num_hidden_layers"] == 61
    assert model["n_routed_experts"] % t["expert_group"] == 0 and t["experts_per_rank"] == 8
    r = lay["rollout"]
    assert (r["tp"], r["dp"], r["instances"], r["ep"]) == (2, dp, inst, ep)
    assert r["dp"] * r["tp"] * r["instances"] == 256


def test_true_weight_reads_the_checkpoint_for_actor_and_ref(true_weight):
    m = true_weight.actor_rollout_ref
    assert m.actor.megatron.use_dist_checkpointing and m.ref.megatron.use_dist_checkpointing
    assert m.ref.megatron.dist_checkpointing_path == "/ckpt/dsv3"


def test_true_weight_without_checkpoint_is_an_error(model):
    rep = RC.validate(RC.compose("deepseekv3_256die_true_weight"), model)
    assert any("dist_checkpointing_path is empty" in e and "DIST_CKPT_PATH" in e for e in rep.errors)


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.rollout.recipe.megatron.num_layer_list=[7,7,8,8,8,8,8,8]", "sums to 62"),
    ("actor_rollout_ref.rollout.recipe.megatron.num_layer_list=[8,8,8,8,8,8,13]", "has 7 stages"),
    ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3", "not divisible by TP4 x PP3"),
    ("actor_rollout_ref.actor.megatron.expert_model_parallel_size=3", "do not divide over the expert group"),
    ("actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2", "expert_tensor_parallel_size must be 1"),
    ("actor_rollout_ref.rollout.recipe.vllm_dp.dp_size=96", "world size is 256"),
    ("actor_rollout_ref.rollout.recipe.reshard_method=gather", "reshard_method must be one of"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=256", "one optimizer step per batch"),
    ("actor_rollout_ref.rollout.free_cache_engine=True", "free_cache_engine=False"),
    ("trainer.nnodes=15", "world size"),
    ("actor_rollout_ref.rollout.recipe.fixed_routing=yes", "fixed_routing must be true or false"),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True", "YaRN RoPE"),
    ("actor_rollout_ref.rollout.recipe.devices_per_card=3", "is not whole cards of 3 device(s)"),
    ("actor_rollout_ref.rollout.recipe.devices_per_card=two", "devices_per_card must be an integer"),
])
def test_each_layout_rule_can_fail(override, message, model):
    rep = RC.validate(RC.compose("deepseekv3_256die_random_init", [override]), model)
    assert any(message in e for e in rep.errors), rep.errors


DYNAMIC = ["actor_rollout_ref.actor.use_dynamic_bsz=True"]


def test_dynamic_batch_sizes_validate_with_a_budget_of_one_sequence(model):
    # prompt 1024 + response 3072: the smallest budget verl's dynamic split accepts. The fixed micro batch
    # size no longer counts (verl ignores it with use_dynamic_bsz): an odd one is not an error then.
    ok = DYNAMIC + ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"]
    assert RC.validate(RC.compose("deepseekv3_256die_random_init", ok), model).errors == []
    fixed = RC.validate(RC.compose("deepseekv3_256die_random_init", ok[2:]), model)
    assert any("not divisible by actor DP8 x micro 3" in e for e in fixed.errors), fixed.errors


def test_dynamic_batch_budgets_below_one_sequence_are_refused_naming_each_key(model):
    # The reference's and the rollout's log-prob budgets follow the actor's in verl's YAML, so all three
    # are too small; verl would assert in rearrange_micro_batches at the first step.
    rep = RC.validate(RC.compose("deepseekv3_256die_random_init",
                                 DYNAMIC + ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4095"]), model)
    for key in ("actor.ppo_max_token_len_per_gpu", "ref.log_prob_max_token_len_per_gpu",
                "rollout.log_prob_max_token_len_per_gpu"):
        assert any(f"actor_rollout_ref.{key}=4095" in e and "= 4096" in e and "at least 4096" in e
                   for e in rep.errors), (key, rep.errors)
    # Only the one whose switch is on.
    rep = RC.validate(RC.compose("deepseekv3_256die_random_init",
                                 ["actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
                                  "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=100"]), model)
    assert [e for e in rep.errors if "max_token_len" in e] == [
        e for e in rep.errors if "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=100" in e], rep.errors
    assert len([e for e in rep.errors if "max_token_len" in e]) == 1, rep.errors


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.use_dynamic_bsz=yes", "actor_rollout_ref.actor.use_dynamic_bsz must be true or false"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096.5", "ppo_max_token_len_per_gpu must be a positive integer"),
])
def test_dynamic_batch_settings_of_the_wrong_type_are_named(override, message, model):
    rep = RC.validate(RC.compose("deepseekv3_256die_random_init", DYNAMIC + [override]), model)
    assert len([e for e in rep.errors if message in e]) == 1, rep.errors  # said once, by name


def test_verl_strictness_new_keys_need_plus():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        RC.compose("deepseekv3_256die_random_init", ["actor_rollout_ref.rollout.no_such_key=1"])
    cfg = RC.compose("deepseekv3_256die_random_init", ["+actor_rollout_ref.rollout.recipe.extra=1"])
    assert cfg.actor_rollout_ref.rollout.recipe.extra == 1


def test_recipe_section_keys(random_init):
    rec = OmegaConf.to_container(random_init.actor_rollout_ref.rollout.recipe)
    assert set(rec) == {"reshard_method", "reshard_bucket_mb", "tensor_cache", "dp_sync_on_device", "offload",
                        "rollout_torch_compile", "fixed_routing", "device_memory_gib", "host_memory_gib", "vllm_dp",
                        "megatron", "metrics_file",
                        "tensorboard_dir", "devices_per_card", "fingerprint_every", "rebalance",
                        "rebalance_min_graph_size_drop", "rebalance_max_imbalance", "rebalance_cpu_stagger",
                        "overlap_grad_reduce", "overlap_param_gather", "profile"}
    # Profiling is off in the shipped configs; turned on, its traces go under the run's checkpoint directory.
    profile = random_init.actor_rollout_ref.rollout.recipe.profile
    assert list(profile.stages) == [] and profile.dir == f"{random_init.trainer.default_local_dir}/profiles"
    # verl 0.4.1's own tree has no recipe section and no recompute_old_log_prob: both are ours.
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module("verl.trainer.config", version_base=None):
        upstream = compose("ppo_megatron_trainer")
    assert "recipe" not in upstream.actor_rollout_ref.rollout
    assert "recompute_old_log_prob" not in upstream.actor_rollout_ref.actor


def test_transformer_overrides_are_megatron_fields(random_init):
    # verl passes override_transformer_config into MLATransformerConfig(**kwargs): unknown names would fail there.
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    keys = set(random_init.actor_rollout_ref.actor.megatron.override_transformer_config)
    assert keys and keys <= fields, keys - fields


def test_engine_kwargs_reach_vllm_and_vllm_ascend(random_init):
    from vllm.engine.arg_utils import EngineArgs

    kw = OmegaConf.to_container(random_init.actor_rollout_ref.rollout.engine_kwargs.vllm, resolve=True)
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    set_keys = {k for k, v in kw.items() if v is not None}
    assert set_keys <= fields, set_keys - fields
    from types import SimpleNamespace

    from vllm_ascend.ascend_config import AscendConfig

    ac = AscendConfig(SimpleNamespace(additional_config=kw["additional_config"]))
    tg = ac.torchair_graph_config
    assert tg.enabled and tg.enable_multistream_mla and tg.enable_multistream_moe and not tg.enable_kv_nz
    assert tg.graph_batch_sizes == [2, 8, 16, 32, 64] and not tg.use_cached_graph
    assert tg.enable_view_optimize is False
    assert ac.ascend_scheduler_config.enabled is True


def test_cli_reports_errors_and_success(capsys, tmp_path):
    assert RC.main(["--config-name", "deepseekv3_256die_random_init", "--model-config", str(tmp_path / "none.json")]) == 1
    assert "model config not found" in capsys.readouterr().err
    mj = tmp_path / "model.json"
    mj.write_text(json.dumps(FALLBACK_MODEL))
    assert RC.main(["--config-name", "deepseekv3_256die_true_weight", "--model-config", str(mj), *CKPT]) == 0
    out = capsys.readouterr().out
    assert "composed and validated" in out and '"world": 256' in out
    assert RC.main(["--config-name", "deepseekv3_256die_true_weight", "--model-config", str(mj), *CKPT,
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"]) == 1
    assert "RayPPOTrainer._validate_config rejects" in capsys.readouterr().err
    assert RC.main(["--config-name", "no_such_config", "--model-config", str(mj)]) == 1
    assert "config composition failed" in capsys.readouterr().err


@pytest.mark.parametrize("name", RC.RUN_CONFIGS)
def test_verl_trainer_accepts_the_config(name):
    # verl's own RayPPOTrainer._validate_config (it reads only config, use_critic and use_reference_policy).
    from types import SimpleNamespace

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    cfg = RC.compose(name, CKPT)
    RayPPOTrainer._validate_config(SimpleNamespace(config=cfg, use_critic=False, use_reference_policy=True))
    bad = RC.compose(name, [*CKPT, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])
    with pytest.raises(AssertionError, match="must be divisible"):
        RayPPOTrainer._validate_config(SimpleNamespace(config=bad, use_critic=False, use_reference_policy=True))


GPU_RUNS = ("deepseekv3_128gpu_random_init", "deepseekv3_128gpu_true_weight")


@pytest.mark.parametrize("name", GPU_RUNS)
def test_the_nvidia_layout_validates_on_16_nodes_of_h200(name, model):
    cfg = RC.compose(name, CKPT)
    rep = RC.validate(cfg, model)
    assert rep.errors == [] and cfg.trainer.device == "cuda"
    lay = rep.layout
    assert (lay["world"], lay["nnodes"], lay["devices_per_node"]) == (128, 16, 8)
    t, r = lay["train"], lay["rollout"]
    assert (t["tp"], t["pp"], t["ep"], t["etp"], t["dp"], t["experts_per_rank"]) == (8, 8, 16, 1, 2, 16)
    assert (r["tp"], r["dp"], r["instances"], r["ep"], r["experts_per_rank"]) == (8, 16, 1, 128, 2)
    if "memory" in lay:  # the full DeepSeek-V3 config (configs/model/deepseek_v3.json) has the sizes
        assert lay["memory"]["device_memory_gib"] == 139 and 90 < lay["memory"]["training_state_gib"] < 139
        # The reshard's two 512 MiB buckets are counted at the switch, beside the training params and the
        # rollout weights (the grads released and the optimizer offloaded before it).
        mem = lay["memory"]
        assert mem["reshard_buffers_gib"] == 1.0
        assert mem["switch_peak_gib"] == pytest.approx(mem["params_gib"] + mem["rollout_weights_gib"] + 1.0, abs=0.1)
    # The bucket from the measured curve on NVIDIA (configs/deepseekv3_128gpu_common.yaml); the dies keep 256.
    assert cfg.actor_rollout_ref.rollout.recipe.reshard_bucket_mb == 512
    assert RC.compose("deepseekv3_256die_random_init").actor_rollout_ref.rollout.recipe.reshard_bucket_mb == 256
    # What only Ascend has is off: no MindSpeed kernels, no vLLM-Ascend options.
    rec = cfg.actor_rollout_ref.rollout
    assert rec.engine_kwargs.vllm.additional_config is None and not rec.recipe.megatron.swap_optimizer
    assert RC.verl_validate(cfg) is None


@pytest.mark.parametrize("override, message", [
    ("trainer.nnodes=1", "is not divisible by TP8 x PP8"),
    ("actor_rollout_ref.rollout.recipe.device_memory_gib=79", "exceeds actor_rollout_ref.rollout.recipe.device_memory_gib=79"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=0.05", "rollout weights"),
])
def test_the_nvidia_layout_fails_by_name_on_one_node_and_on_h100(override, message, model):
    if "memory" in override or "utilization" in override:
        if not RC.DEFAULT_MODEL_CONFIG.is_file():
            pytest.skip("needs the full model config for the memory estimate")
    rep = RC.validate(RC.compose("deepseekv3_128gpu_random_init", [override]), model)
    assert any(message in e for e in rep.errors), rep.errors


H100_RUNS = ("deepseekv3_128gpu_h100_random_init", "deepseekv3_128gpu_h100_true_weight")


@pytest.mark.parametrize("name", H100_RUNS)
def test_the_h100_run_fits_80_gb_with_the_optimizer_on_the_host(name, model):
    """The H200 run config with deepseekv3_128gpu_h100_common.yaml on top: the same layout, the optimizer
    state on the host (megatron-core's HybridDeviceOptimizer), and the estimate within 79 GiB with headroom."""
    h100, h200 = RC.compose(name, CKPT), RC.compose(name.replace("_h100", ""), CKPT)
    rep = RC.validate(h100, model)
    assert rep.errors == [], rep.errors
    assert RC.verl_validate(h100) is None
    optim = h100.actor_rollout_ref.actor.optim
    assert optim.optimizer_cpu_offload is True and optim.optimizer_offload_fraction == 1.0
    assert optim.overlap_cpu_optimizer_d2h_h2d is False
    # Everything but the optimizer's place, the memory sizes and the run's name is the H200 run's.
    from omegaconf import OmegaConf

    # Unresolved: paths that interpolate the experiment name compare as the same interpolation.
    a, b = OmegaConf.to_container(h100, resolve=False), OmegaConf.to_container(h200, resolve=False)
    for c in (a, b):
        for key in ("optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d"):
            c["actor_rollout_ref"]["actor"]["optim"].pop(key, None)
        for key in ("device_memory_gib", "host_memory_gib"):
            c["actor_rollout_ref"]["rollout"]["recipe"].pop(key)
        c["trainer"].pop("experiment_name")
    assert a == b
    assert RC.validate(h200, model).layout["train"] == rep.layout["train"]
    if "memory" not in rep.layout:
        return
    mem = rep.layout["memory"]
    assert mem["device_memory_gib"] == 79 and mem["optimizer_host_fraction"] == 1.0
    # BF16 params + FP32 grads only: about 33 GiB, 46 GiB of headroom for activations (docs/NVIDIA.md).
    assert 30 < mem["training_state_gib"] < 35 and 79 - mem["training_state_gib"] > 40
    # Host: 16 bytes a parameter shard (fp32 master, two moments, pinned fp32 grad copy) plus the switch's
    # copies of the training and reference params, 8 GPUs a node, within the node's 1700 GiB.
    assert abs(mem["host_optimizer_gib"] - mem["optimizer_gib"] * 16 / 12) < 0.1
    assert 800 < mem["host_per_node_gib"] < 1700 and mem["host_memory_gib"] == 1700


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.optim.optimizer_offload_fraction=0.1",
     "exceeds actor_rollout_ref.rollout.recipe.device_memory_gib=79"),
    ("actor_rollout_ref.rollout.recipe.host_memory_gib=512", "exceeds actor_rollout_ref.rollout.recipe.host_memory_gib=512"),
    ("actor_rollout_ref.actor.optim.optimizer_offload_fraction=0", "must be a number in (0, 1]"),
    ("actor_rollout_ref.actor.optim.optimizer_cpu_offload=false", "optimizer_cpu_offload is not true"),
    ("actor_rollout_ref.rollout.recipe.megatron.swap_optimizer=true", "cannot combine with"),
])
def test_the_h100_run_fails_by_name(override, message, model):
    if ("memory" in message or "exceeds" in message) and not RC.DEFAULT_MODEL_CONFIG.is_file():
        pytest.skip("needs the full model config for the memory estimate")
    rep = RC.validate(RC.compose("deepseekv3_128gpu_h100_random_init", [override]), model)
    assert any(message in e for e in rep.errors), rep.errors


def test_the_switch_peak_counts_the_reshard_buckets_and_fails_by_name(model):
    """The direct reshard's buckets in flight (recipe.reshard_bucket_mb) stand beside the training params and the
    rollout weights at the switch: a bucket too large for the device is refused naming the key; the baselines'
    buffers are not estimated, and the report says so."""
    if not RC.DEFAULT_MODEL_CONFIG.is_file():
        pytest.skip("needs the full model config for the memory estimate")
    recipe = "actor_rollout_ref.rollout.recipe"
    # The 256-die layout's rollout shard (20.7 GiB) is the larger part there: 28 GiB holds the training state
    # (18.4) and the switch with two 256 MiB buckets (27.3), not with two 4 GiB buckets (6.1 + 20.7 + 8).
    small = [f"{recipe}.device_memory_gib=28", "actor_rollout_ref.rollout.gpu_memory_utilization=0.9"]
    fits = RC.validate(RC.compose("deepseekv3_256die_random_init", small), model)
    assert fits.errors == [] and fits.layout["memory"]["reshard_buffers_gib"] == 0.5, fits.errors
    rep = RC.validate(RC.compose("deepseekv3_256die_random_init", [*small, f"{recipe}.reshard_bucket_mb=4096"]), model)
    assert any("the switch's reshard holds 34.8 GiB" in e and f"{recipe}.reshard_bucket_mb" in e for e in rep.errors), rep.errors
    upstream = RC.validate(RC.compose("deepseekv3_256die_random_init", [*small, f"{recipe}.reshard_bucket_mb=4096",
                                                                      f"{recipe}.reshard_method=upstream"]), model)
    assert upstream.errors == [] and upstream.layout["memory"]["reshard_buffers_gib"] == 0
    assert any("reshard_method=upstream: its transfer buffers are not" in n for n in upstream.notes), upstream.notes


def test_the_estimate_counts_the_buckets_the_executor_keeps_in_flight():
    import inspect

    from verl_patches.checks.recipe_memory import RESHARD_BUCKETS_IN_FLIGHT
    from verl_patches.reshard import direct

    default = inspect.signature(direct.execute_direct).parameters["in_flight"].default
    assert RESHARD_BUCKETS_IN_FLIGHT == default == 2


def test_graph_mode_is_the_nvidia_default_and_eager_an_explicit_override(model):
    for name in GPU_RUNS + H100_RUNS:
        assert RC.compose(name, CKPT).actor_rollout_ref.rollout.enforce_eager is False, name
    eager = RC.compose("deepseekv3_128gpu_random_init", ["actor_rollout_ref.rollout.enforce_eager=True"])
    assert eager.actor_rollout_ref.rollout.enforce_eager is True and RC.validate(eager, model).errors == []


def test_the_memory_estimate_counts_deepseek_v3():
    from verl_patches.checks.recipe_memory import estimate, model_params

    cfg = RC.load_model_config(RC.DEFAULT_MODEL_CONFIG)
    assert 670e9 < model_params(cfg).total < 672e9  # DeepSeek-V3's published 671B
    npu = estimate(cfg, world=256, tp=4, pp=8, expert_group=32, layer_list=[7, 7, 8, 8, 8, 8, 8, 7], rollout_tp=2,
                   rollout_ep=256)
    # About 23 GB of rollout shard per die (docs/DESIGN.md section 2), 20.7 GiB.
    assert 20 < npu.rollout_weights < 22 and 49 < npu.training_state < 52
    assert estimate(cfg, world=256, tp=4, pp=8, expert_group=32, layer_list=None, rollout_tp=2, rollout_ep=256,
                    optimizer_on_host=True).training_state < npu.training_state
    gpu = dict(world=128, tp=8, pp=8, expert_group=16, layer_list=[7, 7, 8, 8, 8, 8, 8, 7], rollout_tp=8,
               rollout_ep=128)
    dev, host, half = (estimate(cfg, **gpu, host_fraction=f, host_grad_copy=True) for f in (0.0, 1.0, 0.5))
    # docs/NVIDIA.md's table: 10.9 + 21.9 + 64.3 = 97.1 GiB on the device; the host share moves out whole.
    assert (round(dev.params, 1), round(dev.grads, 1), round(dev.optimizer, 1)) == (10.9, 21.9, 64.3)
    assert round(dev.training_state, 1) == 97.1 and dev.host_optimizer == 0
    assert abs(host.training_state - (dev.params + dev.grads)) < 1e-9 and host.optimizer_on_host
    assert abs(half.device_optimizer - dev.optimizer / 2) < 1e-9
    assert abs(host.host_optimizer - dev.optimizer * 16 / 12) < 1e-9  # + the pinned fp32 grad copies
    with pytest.raises(ValueError, match="host_fraction must be in"):
        estimate(cfg, **gpu, host_fraction=1.5)


def test_a_fingerprint_switched_off_is_said(model):
    """Issue 29: a setting that weakens a check is reported by the dry run (recipe_config's warning), not silent."""
    rep = RC.validate(RC.compose("deepseekv3_256die_random_init", ["actor_rollout_ref.rollout.recipe.fingerprint_every=0"]),
                      model)
    assert not rep.errors, rep.errors
    assert rep.warnings == ["actor_rollout_ref.rollout.recipe.fingerprint_every=0 switches the weight fingerprint check "
                            "off: rollout weights that differ from what training sent would go unnoticed (the recipe "
                            "checks every switch)"]
    assert RC.validate(RC.compose("deepseekv3_256die_random_init"), model).warnings == []


@pytest.mark.parametrize("override, needle", [
    ("+trainer.totl_training_steps=2", "trainer.totl_training_steps: unknown key"),
    ("+data.max_promt_length=8", "data.max_promt_length: unknown key"),
    ("+actor_rollout_ref.actor.optim.lr_warmup_step=3", "actor_rollout_ref.actor.optim.lr_warmup_step: unknown key"),
])
def test_a_key_added_with_plus_that_nobody_reads_is_named(model, override, needle):
    """Issue 29: Hydra accepts any '+'-added key and verl ignores it, so a misspelt key changed nothing,
    silently. The check names it (and the key it most likely meant)."""
    rep = RC.validate(RC.compose("deepseekv3_256die_random_init", [override]), model)
    assert any(needle in e and "did you mean" in e for e in rep.errors), rep.errors


def test_free_form_sections_take_any_key(model):
    """verl hands override_* and *kwargs mappings on as they are: any key there is the user's."""
    for override in ("+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=False",
                     "+actor_rollout_ref.model.override_config.foo=1"):
        rep = RC.validate(RC.compose("deepseekv3_256die_random_init", [override]), model)
        assert not [e for e in rep.errors if "unknown key" in e], (override, rep.errors)
