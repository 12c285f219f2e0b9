"""Compose the recipe's Hydra configs against the installed verl and check the 256-die layout arithmetic.

``python -m verl_patches.recipe_config --config-name NAME [--model-config F] [overrides...]``; exit 1 on errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_MODEL_CONFIG = CONFIG_DIR / "model" / "deepseek_v3.json"
RUN_CONFIGS = ("deepseekv3_256die_random_init", "deepseekv3_256die_true_weight")
RESHARD_METHODS = ("direct", "recipe", "upstream")
# The one section that holds the recipe's own keys (configs/README.md).
RECIPE_SECTION = "actor_rollout_ref.rollout.recipe"


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = (), config_dir: Path = CONFIG_DIR):
    """The config verl's main_ppo would see for ``--config-path config_dir --config-name config_name``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    # A previous compose in this process (tests) leaves Hydra initialised.
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    layout: dict[str, Any] = field(default_factory=dict)

    def check(self, ok: bool, msg: str) -> bool:
        if not ok:
            self.errors.append(msg)
        return ok


def load_model_config(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model config not found: {path}")
    cfg = json.loads(path.read_text())
    need = ("num_hidden_layers", "first_k_dense_replace", "n_routed_experts")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"{path}: model config lacks {missing}")
    return cfg


def find_model_config(cfg, explicit: Path | None = None) -> Path:
    """The model's config.json: explicit, else under actor_rollout_ref.model.path, else configs/model/."""
    if explicit:
        return Path(explicit)
    model_dir = Path(os.path.expanduser(str(cfg.actor_rollout_ref.model.path)))
    if (model_dir / "config.json").is_file():
        return model_dir / "config.json"
    return DEFAULT_MODEL_CONFIG


def _positive_int(rep: Report, name: str, value: Any) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    rep.check(ok, f"{name} must be a positive integer, got {value!r}")
    return value if ok else 1


def validate(cfg, model: dict) -> Report:
    """Every arithmetic and consistency rule the 256-die layout depends on; errors name the keys."""
    from omegaconf import OmegaConf

    rep = Report()
    arr = cfg.actor_rollout_ref
    recipe = OmegaConf.select(cfg, RECIPE_SECTION)
    if not rep.check(recipe is not None, f"{RECIPE_SECTION} is missing"):
        return rep
    missing = [k for k in ("vllm_dp.dp_size", "vllm_dp.instances") if OmegaConf.is_missing(recipe.vllm_dp, k.split(".")[1])]
    if not rep.check(not missing, f"{RECIPE_SECTION}: no value for {missing} (a run config sets them)"):
        return rep

    nnodes = _positive_int(rep, "trainer.nnodes", cfg.trainer.nnodes)
    per_node = _positive_int(rep, "trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node)
    world = nnodes * per_node
    layers = model["num_hidden_layers"]
    experts = model["n_routed_experts"]
    dense = model["first_k_dense_replace"]

    # Training layout (actor; the reference is co-located and must match it).
    m = arr.actor.megatron
    tp = _positive_int(rep, "actor.megatron.tensor_model_parallel_size", m.tensor_model_parallel_size)
    pp = _positive_int(rep, "actor.megatron.pipeline_model_parallel_size", m.pipeline_model_parallel_size)
    ep = _positive_int(rep, "actor.megatron.expert_model_parallel_size", m.expert_model_parallel_size)
    cp = _positive_int(rep, "actor.megatron.context_parallel_size", m.context_parallel_size)
    etp = m.expert_tensor_parallel_size if m.expert_tensor_parallel_size is not None else tp
    dp = world // (tp * pp * cp)
    rep.check(world % (tp * pp * cp) == 0, f"world size {world} is not divisible by TP{tp} x PP{pp} x CP{cp}")
    extend = bool(recipe.megatron.moe_tp_extend_ep)
    # Whole experts per rank (the reshard plan and vLLM's EP both move whole experts).
    rep.check(etp == 1, f"the recipe keeps whole experts per rank (no expert TP): expert_tensor_parallel_size "
                        f"must be 1, got {etp}")
    # MindSpeed's moe_tp_extend_ep folds TP into the expert group; megatron-core's EP alone is the group.
    expert_group = tp * ep if extend else ep
    rep.check(experts % expert_group == 0, f"{experts} routed experts do not divide over the expert group of {expert_group} ranks")
    rep.check((world // pp) % expert_group == 0,
              f"expert group of {expert_group} ranks does not divide the {world // pp} ranks of one pipeline stage")
    ref = arr.ref.megatron
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
        rep.check(ref[key] == m[key], f"ref.megatron.{key}={ref[key]} differs from actor's {m[key]} (co-located layout)")

    layer_list = list(recipe.megatron.num_layer_list or [])
    rep.check(len(layer_list) == pp, f"num_layer_list has {len(layer_list)} stages, PP is {pp}")
    rep.check(all(isinstance(n, int) and n >= 1 for n in layer_list), f"num_layer_list entries must be >= 1: {layer_list}")
    rep.check(sum(layer_list) == layers, f"num_layer_list {layer_list} sums to {sum(layer_list)}, the model has {layers} layers")

    # Rollout layout: instances x (DP x TP) = world; EP = DP x TP inside one instance.
    r = arr.rollout
    rtp = _positive_int(rep, "rollout.tensor_model_parallel_size", r.tensor_model_parallel_size)
    rdp = _positive_int(rep, "recipe.vllm_dp.dp_size", recipe.vllm_dp.dp_size)
    inst = _positive_int(rep, "recipe.vllm_dp.instances", recipe.vllm_dp.instances)
    rep.check(rdp * rtp * inst == world,
              f"rollout DP{rdp} x TP{rtp} x {inst} instance(s) = {rdp * rtp * inst}, world size is {world}")
    rep_ep = rdp * rtp
    rep.check(experts % rep_ep == 0, f"{experts} routed experts do not divide over rollout EP{rep_ep}")

    # Batch arithmetic verl's trainer relies on.
    bsz, n = cfg.data.train_batch_size, r.n
    mini, micro = arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size_per_gpu
    if dp:  # dp is 0 when the world is smaller than one TP x PP x CP group (reported above)
        rep.check((bsz * n) % (dp * micro) == 0, f"train batch {bsz} x n {n} not divisible by actor DP{dp} x micro {micro}")
    rep.check(bsz % mini == 0, f"train_batch_size {bsz} not divisible by ppo_mini_batch_size {mini}")
    if arr.actor.get("recompute_old_log_prob", True) is False:
        # old_log_prob = log_prob.detach() is exact only with one optimizer step per batch.
        rep.check(mini == bsz and arr.actor.ppo_epochs == 1,
                  "recompute_old_log_prob=False needs one optimizer step per batch: "
                  f"ppo_mini_batch_size ({mini}) == train_batch_size ({bsz}) and ppo_epochs == 1")
    rep.check(cfg.algorithm.adv_estimator == "grpo", f"algorithm.adv_estimator must be grpo, got {cfg.algorithm.adv_estimator}")

    # Fixed routing is a benchmark switch: with real weights it would train on routing the model never chose.
    fixed = recipe.get("fixed_routing", False)
    if rep.check(isinstance(fixed, bool), f"{RECIPE_SECTION}.fixed_routing must be true or false, got {fixed!r}") \
            and fixed:
        loaded = [w for w in ("actor", "ref") if arr[w].get("load_weight", False)]
        rep.check(not loaded, f"{RECIPE_SECTION}.fixed_routing=True with {'/'.join(loaded)}.load_weight=True: forced "
                              "routing is for random-init throughput runs only (turn one of them off)")

    # Engine constraints.
    rep.check(recipe.reshard_method in RESHARD_METHODS,
              f"{RECIPE_SECTION}.reshard_method must be one of {RESHARD_METHODS}, got {recipe.reshard_method!r}")
    rep.check(not (not r.enforce_eager and r.free_cache_engine),
              "rollout.enforce_eager=False (graph mode) needs rollout.free_cache_engine=False (verl asserts it)")
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    if "max_position_embeddings" in model:
        rep.check(max_len <= model["max_position_embeddings"],
                  f"prompt + response = {max_len} exceeds max_position_embeddings {model['max_position_embeddings']}")
    if r.enable_chunked_prefill and r.max_num_batched_tokens < max_len:
        rep.notes.append(
            f"rollout.max_num_batched_tokens={r.max_num_batched_tokens} < max_model_len {max_len} with chunked prefill: "
            "verl 0.4.1's vLLMRollout rejects this; the recipe's rollout patch must lift that check")
    rope = model.get("rope_scaling") or {}
    otc = arr.actor.megatron.override_transformer_config
    rep.check(not (rope.get("type") == "yarn" and otc.get("apply_rope_fusion", False)),
              "override_transformer_config.apply_rope_fusion=True with YaRN RoPE: megatron's MLA asserts it off "
              "(use recipe.megatron.use_fused_rotary_pos_emb on NPU)")
    if model.get("quantization_config"):
        rep.errors.append("model config has quantization_config: convert FP8 to BF16 first "
                          "(python -m verl_patches.tools.fp8_to_bf16) and drop it")
    nextn = OmegaConf.select(cfg, "actor_rollout_ref.model.override_config.model_config.num_nextn_predict_layers")
    rep.check(model.get("num_nextn_predict_layers", 0) == 0 or nextn == 0, "MTP must be off: num_nextn_predict_layers=0")
    for who in ("actor", "ref"):
        mm = arr[who].megatron
        if mm.use_dist_checkpointing:
            path = mm.dist_checkpointing_path
            rep.check(bool(path) and str(path).strip() != "",
                      f"{who}.megatron.use_dist_checkpointing=True but dist_checkpointing_path is empty (set DIST_CKPT_PATH)")

    memory = _check_memory(rep, cfg, recipe, model, world=world, tp=tp, pp=pp, expert_group=expert_group,
                           layer_list=layer_list, rollout_tp=rtp, rollout_ep=rep_ep)

    rep.layout = {
        "world": world, "nnodes": nnodes, "devices_per_node": per_node,
        "train": {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep, "etp": etp, "moe_tp_extend_ep": extend,
                  "expert_group": expert_group, "experts_per_rank": experts // expert_group if expert_group else None,
                  "num_layer_list": layer_list, "dense_layers": dense},
        "rollout": {"tp": rtp, "dp": rdp, "instances": inst, "ep": rep_ep, "experts_per_rank": experts // rep_ep},
        "model": {"layers": layers, "routed_experts": experts},
    }
    if memory:
        rep.layout["memory"] = memory
    return rep


MEMORY_KEYS = ("hidden_size", "num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank",
               "v_head_dim", "moe_intermediate_size", "intermediate_size", "vocab_size")


def _check_memory(rep: Report, cfg, recipe, model: dict, **layout) -> dict | None:
    """recipe.device_memory_gib set: the per-device training state and rollout weights must fit
    (verl_patches/recipe_memory.py). None when it is not set or the model config lacks the sizes."""
    device_gib = recipe.get("device_memory_gib", None)
    if device_gib is None or rep.errors:
        return None
    if not rep.check(isinstance(device_gib, (int, float)) and not isinstance(device_gib, bool) and device_gib > 0,
                     f"{RECIPE_SECTION}.device_memory_gib must be a positive number, got {device_gib!r}"):
        return None
    if any(k not in model for k in MEMORY_KEYS):
        rep.notes.append("memory not estimated: the model config lacks the layer sizes")
        return None
    from verl_patches.recipe_memory import estimate

    arr = cfg.actor_rollout_ref
    # MindSpeed's swap optimizer keeps Adam's state on the host between its uses (Ascend only).
    on_host = str(cfg.trainer.device) == "npu" and bool(recipe.megatron.get("swap_optimizer", False))
    est = estimate(model, optimizer_on_host=on_host, **layout)
    out = {**est.as_dict(), "device_memory_gib": device_gib}
    rep.check(est.training_state <= device_gib,
              f"training state {est.training_state:.1f} GiB per device (params {est.params:.1f} + grads {est.grads:.1f}"
              f"{'' if on_host else f' + optimizer {est.optimizer:.1f}'}) exceeds {RECIPE_SECTION}.device_memory_gib="
              f"{device_gib}: use more devices (a larger expert group or pipeline), or devices with more memory")
    share = float(arr.rollout.gpu_memory_utilization)
    rep.check(est.rollout_weights <= share * device_gib,
              f"rollout weights {est.rollout_weights:.1f} GiB per device exceed rollout.gpu_memory_utilization={share} "
              f"of {device_gib} GiB: raise the rollout TP or EP, or the memory share")
    if est.training_state > 0.85 * device_gib:
        rep.notes.append(f"training state {est.training_state:.1f} GiB is over 85% of {device_gib} GiB: activations "
                         "need the rest (keep full recompute)")
    return out


def verl_validate(cfg) -> str | None:
    """verl's own trainer-side checks (RayPPOTrainer._validate_config); the failure message, or None."""
    from types import SimpleNamespace

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    # It reads only these three attributes; GRPO has no critic and uses the reference policy (KL loss).
    probe = SimpleNamespace(config=cfg, use_critic=cfg.algorithm.adv_estimator == "gae",
                            use_reference_policy=bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward))
    try:
        RayPPOTrainer._validate_config(probe)
    except (AssertionError, ValueError) as e:
        return f"verl's RayPPOTrainer._validate_config rejects the config: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.recipe_config", description=__doc__)
    p.add_argument("--config-name", required=True, help=f"one of {RUN_CONFIGS}")
    p.add_argument("--config-dir", type=Path, default=CONFIG_DIR)
    p.add_argument("--model-config", type=Path, default=None, help="DeepSeek-V3 config.json (default: model.path, then configs/model/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved YAML")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as given to verl.trainer.main_ppo")
    args = p.parse_args(argv)
    try:
        from omegaconf import OmegaConf
    except ImportError as e:
        print(f"error: {e}: hydra-core is needed to compose the config (requirements.txt)", file=sys.stderr)
        return 1
    try:
        cfg = compose(args.config_name, args.overrides, args.config_dir)
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors are many types; report them all the same way
        print(f"config composition failed for {args.config_name}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.print_config:
        print(OmegaConf.to_yaml(OmegaConf.create(resolved)))
    model_path = find_model_config(cfg, args.model_config)
    try:
        model = load_model_config(model_path)
    except (FileNotFoundError, ValueError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rep = validate(cfg, model)
    verl_error = verl_validate(cfg)
    if verl_error:
        rep.errors.append(verl_error)
    print(f"model config: {model_path}")
    print("layout: " + json.dumps(rep.layout))
    for note in rep.notes:
        print(f"note: {note}")
    for err in rep.errors:
        print(f"error: {err}", file=sys.stderr)
    if rep.errors:
        print(f"{args.config_name}: {len(rep.errors)} layout/config error(s)", file=sys.stderr)
        return 1
    print(f"{args.config_name}: composed and validated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
