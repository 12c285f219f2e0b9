"""Compose the recipe's Hydra configs against the installed verl and check the 256-die layout arithmetic.

``python -m verl_patches.checks.recipe_config --config-name NAME [--model-config F] [overrides...]``; exit 1 on errors.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

from verl_patches.config import settings, verl_keys
from verl_patches.checks.compose import CONFIG_DIR, DEFAULT_MODEL_CONFIG, compose, find_model_config, load_model_config  # noqa: F401
from verl_patches.reporting.findings import finish
from verl_patches.base.schema import PathArg, Text
from verl_patches.config.megatron_args import RecipeMegatronError, parse as parse_megatron
from verl_patches.config.optim_offload import OptimizerOffloadError, offload_settings
from verl_patches.checks.recipe_memory import RESHARD_BUCKETS_IN_FLIGHT, checkpoint_size, estimate
from verl_patches.checks.output_dirs import OutputDir, dir_problem
from verl_patches.checks.data_check import check_files, recipe_scorer
from verl_patches.rollout.graph_safe import alloc_conf_conflict
from verl_patches.train.checkpoint_commit import ASYNC_SAVE_WHY, RESUME_MODES, resume_path_problem

RUN_CONFIGS = ("deepseekv3_256die_random_init", "deepseekv3_256die_true_weight")
# The one section that holds the recipe's own keys (configs/README.md).
RECIPE_SECTION = settings.SECTION
R = "actor_rollout_ref.rollout"  # verl's rollout section


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # allowed settings that weaken a check
    layout: dict[str, Any] = field(default_factory=dict)
    # A value of the wrong type was found: checks written for well-typed configs (verl's) are skipped.
    bad_values: bool = False
    # verl's keys whose value verl_key_rules named: the later rules that read one say nothing more of it.
    named: set[str] = field(default_factory=set)

    def check(self, ok: bool, msg: str) -> bool:
        if not ok:
            self.errors.append(msg)
        return ok


def _positive_int(rep: Report, name: str, value: Any) -> int | None:
    """``value`` if it is an integer >= 1, else None with the error recorded (so later
    arithmetic on it is skipped instead of dividing by a stand-in)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if not ok and name not in rep.named:
        kind = " (a string: write the number without quotes)" if isinstance(value, str) else \
            (" (a float: write a whole number)" if isinstance(value, float) else "")
        rep.errors.append(f"{name} must be a positive integer, got {value!r}{kind}")
        rep.bad_values = True
    return value if ok else None


def _flag(rep: Report, name: str, value: Any) -> bool | None:
    """``value`` if it is true or false (None, unset, counts as verl's default False), else None with
    the error recorded."""
    if value is None:
        return False
    if not isinstance(value, bool):
        msg = f"{name} must be true or false, got {value!r}"
        if msg not in rep.errors:  # said once, however many rules read the key
            rep.errors.append(msg)
        rep.bad_values = True
        return None
    return value


# Dynamic batch sizes (verl's use_dynamic_bsz): the switch and its token budget per device, for the
# update and for the two log-prob forwards (verl's YAML interpolates the latter from the actor's).
DYNAMIC_BSZ_KEYS = (
    ("actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
    ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
)


def _check_token_budgets(rep: Report, cfg, max_len: int) -> None:
    """verl's rearrange_micro_batches asserts, at the first step, that a micro-batch's token budget
    (the per-device setting x context parallel) holds one whole padded sequence (prompt + response);
    the budget must be a whole number. Said here, before anything starts, naming the keys."""
    cp = _select(cfg, "actor_rollout_ref.actor.megatron.context_parallel_size")
    cp = cp if isinstance(cp, int) and not isinstance(cp, bool) and cp >= 1 else 1
    for switch, budget_key in DYNAMIC_BSZ_KEYS:
        if not _flag(rep, switch, _select(cfg, switch)):
            continue
        budget = _positive_int(rep, budget_key, _select(cfg, budget_key))
        if budget is not None:
            rep.check(budget * cp >= max_len,
                      f"{budget_key}={budget} (x context parallel {cp}) is less than one padded sequence, "
                      f"data.max_prompt_length + data.max_response_length = {max_len}: verl's dynamic batch "
                      f"split (use_dynamic_bsz) needs room for one; raise it to at least {-(-max_len // cp)}")


_select = settings.select  # a composed config's key (one lookup: verl_patches/config/settings.py)


def _tree_paths(node: Any, prefix: str, known: set[str], free: set[str]) -> None:
    """Dotted paths of a config tree into ``known``; a mapping that is empty or null in it, or that verl
    hands on as it is (``override_*``, ``*kwargs``), is free-form: anything below it is accepted."""
    if isinstance(node, dict):
        leaf = prefix.rsplit(".", 1)[-1]
        # verl passes these on as they are (HF / transformer config overrides, engine arguments).
        if prefix and (not node or leaf.startswith("override_") or leaf.endswith("kwargs")):
            free.add(prefix)
        for key, value in node.items():
            if prefix == "" and key in ("defaults", "hydra"):
                continue
            path = f"{prefix}.{key}" if prefix else str(key)
            known.add(path)
            _tree_paths(value, path, known, free)
    elif node is None and prefix:
        free.add(prefix)


@functools.lru_cache(maxsize=None)
def known_keys(config_dir: Path = CONFIG_DIR) -> tuple[frozenset[str], frozenset[str]]:
    """The schema of a run config's keys: verl's own trainer tree (its installed
    ``ppo_megatron_trainer.yaml``) and every key the recipe's committed configs set."""
    # Lazy: verl, Hydra and OmegaConf load when configs are composed (several seconds; --help runs without them).
    from omegaconf import OmegaConf
    import verl.trainer.config as verl_config

    known: set[str] = set()
    free: set[str] = set()
    files = [Path(verl_config.__file__).with_name("ppo_megatron_trainer.yaml"), *sorted(config_dir.glob("*.yaml"))]
    for f in files:
        _tree_paths(OmegaConf.to_container(OmegaConf.load(f), resolve=False), "", known, free)
    return frozenset(known), frozenset(free)


def check_unknown_keys(rep: Report, cfg, config_dir: Path = CONFIG_DIR) -> None:
    """Every key of the composed config must be one verl's trainer or the recipe knows: a key added with
    ``+`` (Hydra's own hint for a key it does not know) is accepted by Hydra and then ignored by verl, so
    a misspelt ``+trainer.totl_training_steps=2`` would change nothing, silently. The recipe section has
    its own typed table (settings.py), checked by settings.problems."""
    # Lazy: verl, Hydra and OmegaConf load when configs are composed (several seconds; --help runs without them).
    from omegaconf import OmegaConf

    known, free = known_keys(config_dir)
    tree = OmegaConf.to_container(cfg, resolve=False)

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, dict) or prefix in free or prefix == RECIPE_SECTION:
            return
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if prefix == "" and key == "hydra":
                continue
            if path not in known:
                siblings = sorted(k.rsplit(".", 1)[-1] for k in known if k.rpartition(".")[0] == prefix)
                close = difflib.get_close_matches(str(key), siblings, n=1)
                hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else ""
                rep.errors.append(f"{path}: unknown key (neither verl 0.4.1's trainer config nor the recipe's "
                                  f"configs have it; a key added with '+' is ignored by verl){hint}")
                continue
            walk(value, path)

    walk(tree, "")


def validate(cfg, model: dict, environ: Mapping[str, str] | None = None) -> Report:
    """Every arithmetic and consistency rule the 256-die layout depends on; errors name the keys.

    A value of the wrong type is one named error and every rule that depends on it is skipped,
    so the report never ends in an exception. ``environ`` (default: this process's) is the run's
    environment, for the settings that the workers read from it (the launcher exports them first).
    The rules come in named groups, in this order (each group's errors in the report in turn).
    """
    rep = Report()
    check_unknown_keys(rep, cfg)
    verl_key_rules(rep, cfg)
    recipe = recipe_section_rules(rep, cfg)
    if recipe is None:
        return rep
    rmeg = _recipe_megatron(recipe)
    setting_warnings(rep, recipe)
    nnodes, per_node, world = world_rules(rep, cfg)
    train = training_layout_rules(rep, cfg, model, rmeg, world)
    rollout = rollout_layout_rules(rep, cfg, recipe, model, world)
    batch_rules(rep, cfg, train["dp"])
    fixed_routing_rules(rep, cfg, recipe)
    engine_rules(rep, cfg, recipe, environ)
    length_rules(rep, cfg, model)
    model_rules(rep, cfg, model)
    checkpoint_rules(rep, cfg)
    card_rules(rep, recipe, world, nnodes, per_node)
    profile_rules(rep, cfg, recipe, world)

    megatron_section = recipe.get("megatron") if isinstance(recipe.get("megatron"), dict) else {}
    hybrid = _optimizer_offload(rep, cfg, megatron_section.get("swap_optimizer", False) is True)
    memory = _check_memory(rep, cfg, recipe, model, hybrid or None, world=world, tp=train["tp"], pp=train["pp"],
                           expert_group=train["expert_group"], layer_list=train["num_layer_list"],
                           rollout_tp=rollout["tp"], rollout_ep=rollout["ep"])
    rep.layout = {"world": world, "nnodes": nnodes, "devices_per_node": per_node, "train": train, "rollout": rollout,
                  "model": {"layers": model["num_hidden_layers"], "routed_experts": model["n_routed_experts"]}}
    if memory:
        rep.layout["memory"] = memory
    return rep


def _pos(rep: Report, cfg, key: str) -> int | None:
    return _positive_int(rep, key, _select(cfg, key))


def _recipe_megatron(recipe: dict):
    """The recipe's Megatron section parsed, or None (a malformed one is reported by settings.problems)."""
    try:
        return parse_megatron(recipe.get("megatron") if isinstance(recipe.get("megatron"), dict) else None)
    except RecipeMegatronError:
        return None


def verl_key_rules(rep: Report, cfg) -> None:
    """verl's own keys that the run reads (verl_patches/config/verl_keys.py: type, finite, range, and the relations
    between them, GRPO's group of two among them), each bad value named with its key, value and rule."""
    found, named = verl_keys.problems(lambda key: _select(cfg, key))
    rep.errors += found
    rep.named |= named
    # verl's own _validate_config compares these values as numbers: it runs only on well-typed ones.
    rep.bad_values |= bool(found)


def recipe_section_rules(rep: Report, cfg) -> dict | None:
    """The recipe section: present, well-typed (settings.problems) and with the values a run config sets.
    The section as a plain dict, or None when no rule after this one can read it."""
    recipe_node = _select(cfg, RECIPE_SECTION)
    if not rep.check(recipe_node is not None, f"{RECIPE_SECTION} is missing"):
        return None
    recipe = settings.plain(recipe_node)
    problems = settings.problems(recipe)
    rep.errors += problems
    rep.bad_values |= bool(problems)
    if not isinstance(recipe, dict):
        return None
    vdp = _vllm_dp(recipe)
    missing = [f"vllm_dp.{k}" for k in ("dp_size", "instances") if vdp.get(k) == "???"]
    if not rep.check(not missing, f"{RECIPE_SECTION}: no value for {missing} (a run config sets them)"):
        return None
    return recipe


def _vllm_dp(recipe: dict) -> dict:
    return recipe.get("vllm_dp") if isinstance(recipe.get("vllm_dp"), dict) else {}


def setting_warnings(rep: Report, recipe: dict) -> None:
    """An allowed value that switches a check off: said (a warning), so a weakened run is not taken for a
    checked one."""
    if recipe.get("fingerprint_every") == 0:
        every = settings.KEYS["fingerprint_every"].default
        rep.warnings.append(f"{RECIPE_SECTION}.fingerprint_every=0 switches the weight fingerprint check off: rollout "
                            "weights that differ from what training sent would go unnoticed (the recipe checks "
                            + ("every switch)" if every == 1 else f"every {every} switches)"))


def world_rules(rep: Report, cfg) -> tuple[int | None, int | None, int | None]:
    """trainer.nnodes and trainer.n_gpus_per_node: positive integers; (nnodes, per node, world size)."""
    nnodes = _pos(rep, cfg, "trainer.nnodes")
    per_node = _pos(rep, cfg, "trainer.n_gpus_per_node")
    return nnodes, per_node, nnodes * per_node if nnodes and per_node else None


def training_layout_rules(rep: Report, cfg, model: dict, rmeg, world: int | None) -> dict:
    """The actor's Megatron layout (the reference is co-located and must match it): it divides the world,
    keeps whole experts per rank, and the pipeline's layer list covers the model. The layout's train part."""
    A = "actor_rollout_ref.actor.megatron"
    layers, experts = model["num_hidden_layers"], model["n_routed_experts"]
    tp = _pos(rep, cfg, f"{A}.tensor_model_parallel_size")
    pp = _pos(rep, cfg, f"{A}.pipeline_model_parallel_size")
    ep = _pos(rep, cfg, f"{A}.expert_model_parallel_size")
    cp = _pos(rep, cfg, f"{A}.context_parallel_size")
    etp_raw = _select(cfg, f"{A}.expert_tensor_parallel_size")
    etp = tp if etp_raw is None else _positive_int(rep, f"{A}.expert_tensor_parallel_size", etp_raw)
    dp = None
    if None not in (world, tp, pp, cp):
        if rep.check(world % (tp * pp * cp) == 0,
                     f"world size {world} (trainer.nnodes {_select(cfg, 'trainer.nnodes')} x trainer.n_gpus_per_node "
                     f"{_select(cfg, 'trainer.n_gpus_per_node')}) is not divisible by TP{tp} x PP{pp} x CP{cp} = "
                     f"{tp * pp * cp}"):
            dp = world // (tp * pp * cp)
    extend = bool(rmeg.moe_tp_extend_ep) if rmeg is not None else False
    # Whole experts per rank (the reshard plan and vLLM's EP both move whole experts).
    if etp is not None:
        rep.check(etp == 1, f"the recipe keeps whole experts per rank (no expert TP): expert_tensor_parallel_size "
                            f"must be 1, got {etp}")
    expert_group = None
    if ep is not None and (tp is not None or not extend):
        # MindSpeed's moe_tp_extend_ep folds TP into the expert group; megatron-core's EP alone is the group.
        expert_group = tp * ep if extend else ep
        rep.check(experts % expert_group == 0,
                  f"{experts} routed experts do not divide over the expert group of {expert_group} ranks")
        if world is not None and pp is not None and world % pp == 0:
            rep.check((world // pp) % expert_group == 0,
                      f"expert group of {expert_group} ranks does not divide the {world // pp} ranks of one pipeline stage")
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
        mine, theirs = _select(cfg, f"{A}.{key}"), _select(cfg, f"actor_rollout_ref.ref.megatron.{key}")
        rep.check(theirs == mine, f"ref.megatron.{key}={theirs!r} differs from actor's {mine!r} (co-located layout)")
    layer_list = list(rmeg.num_layer_list or []) if rmeg is not None else []
    if rmeg is not None and pp is not None:
        rep.check(len(layer_list) == pp, f"num_layer_list has {len(layer_list)} stages, PP is {pp}")
        rep.check(sum(layer_list) == layers,
                  f"num_layer_list {layer_list} sums to {sum(layer_list)}, the model has {layers} layers")
    return {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep, "etp": etp, "moe_tp_extend_ep": extend,
            "expert_group": expert_group,
            "experts_per_rank": experts // expert_group if expert_group and experts % expert_group == 0 else None,
            "num_layer_list": layer_list, "dense_layers": model["first_k_dense_replace"]}


def rollout_layout_rules(rep: Report, cfg, recipe: dict, model: dict, world: int | None) -> dict:
    """The rollout's layout: instances x (DP x TP) = world; EP = DP x TP inside one instance holds whole
    experts. The layout's rollout part."""
    experts = model["n_routed_experts"]
    vdp = _vllm_dp(recipe)
    rtp = _pos(rep, cfg, f"{R}.tensor_model_parallel_size")
    rdp = _positive_int(rep, f"{RECIPE_SECTION}.vllm_dp.dp_size", vdp.get("dp_size"))
    inst = _positive_int(rep, f"{RECIPE_SECTION}.vllm_dp.instances", vdp.get("instances", 1))
    rep_ep = rdp * rtp if rdp and rtp else None
    if rep_ep and inst and world:
        rep.check(rep_ep * inst == world,
                  f"rollout DP{rdp} x TP{rtp} x {inst} instance(s) = {rep_ep * inst}, world size is {world}")
    if rep_ep:
        rep.check(experts % rep_ep == 0, f"{experts} routed experts do not divide over rollout EP{rep_ep}")
    return {"tp": rtp, "dp": rdp, "instances": inst, "ep": rep_ep,
            "experts_per_rank": experts // rep_ep if rep_ep and experts % rep_ep == 0 else None}


def batch_rules(rep: Report, cfg, dp: int | None) -> None:
    """The batch arithmetic verl's trainer relies on, and GRPO."""
    bsz = _pos(rep, cfg, "data.train_batch_size")
    n = _pos(rep, cfg, f"{R}.n")
    mini = _pos(rep, cfg, "actor_rollout_ref.actor.ppo_mini_batch_size")
    dynamic = _flag(rep, "actor_rollout_ref.actor.use_dynamic_bsz", _select(cfg, "actor_rollout_ref.actor.use_dynamic_bsz"))
    epochs = _select(cfg, "actor_rollout_ref.actor.ppo_epochs")
    if dynamic is False:  # with dynamic batch sizes verl splits by tokens and ignores the micro batch size
        micro = _pos(rep, cfg, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
        if None not in (bsz, n, dp, micro):
            rep.check((bsz * n) % (dp * micro) == 0,
                      f"train batch {bsz} x n {n} not divisible by actor DP{dp} x micro {micro}")
    if None not in (bsz, mini):
        rep.check(bsz % mini == 0, f"train_batch_size {bsz} not divisible by ppo_mini_batch_size {mini}")
    recompute = _select(cfg, "actor_rollout_ref.actor.recompute_old_log_prob")
    if recompute is not None and not isinstance(recompute, bool):
        rep.errors.append(f"actor_rollout_ref.actor.recompute_old_log_prob must be true or false, got {recompute!r}")
    elif recompute is False and None not in (bsz, mini):
        # old_log_prob = log_prob.detach() is exact only with one optimizer step per batch.
        rep.check(mini == bsz and epochs == 1,
                  "recompute_old_log_prob=False needs one optimizer step per batch: "
                  f"ppo_mini_batch_size ({mini}) == train_batch_size ({bsz}) and ppo_epochs == 1")
    adv = _select(cfg, "algorithm.adv_estimator")
    rep.check(adv == "grpo", f"algorithm.adv_estimator must be grpo, got {adv!r}")


def fixed_routing_rules(rep: Report, cfg, recipe: dict) -> None:
    """Fixed routing is a benchmark switch: with real weights it would train on routing the model never chose."""
    fixed = recipe.get("fixed_routing", settings.KEYS["fixed_routing"].default)
    # A value that is not a boolean is named by settings.problems (recipe_section_rules).
    if fixed is True:
        loaded = [w for w in ("actor", "ref") if _select(cfg, f"actor_rollout_ref.{w}.load_weight")]
        rep.check(not loaded, f"{RECIPE_SECTION}.fixed_routing=True with {'/'.join(loaded)}.load_weight=True: forced "
                              "routing is for random-init throughput runs only (turn one of them off)")


def engine_rules(rep: Report, cfg, recipe: dict, environ: Mapping[str, str] | None) -> None:
    """The rollout engine's switches: real booleans, graph mode without freeing the cache engine, and no
    allocator setting that bypasses the address-stable pool graph mode needs on NPU."""
    for key in ("enforce_eager", "free_cache_engine", "enable_chunked_prefill"):
        v = _select(cfg, f"{R}.{key}")
        if not isinstance(v, bool):
            rep.errors.append(f"{R}.{key} must be true or false, got {v!r}")
            rep.bad_values = True
    eager, free = _select(cfg, f"{R}.enforce_eager"), _select(cfg, f"{R}.free_cache_engine")
    rep.check(not (eager is False and free is True),
              "rollout.enforce_eager=False (graph mode) needs rollout.free_cache_engine=False (verl asserts it)")
    # Graph mode with the recipe's offload builds the rollout in address-stable regions; on NPU that is
    # vLLM-Ascend's CaMem pool, which expandable segments bypass (the rollout refuses it at build too).
    if eager is False and recipe.get("offload", settings.KEYS["offload"].default) is True \
            and str(_select(cfg, "trainer.device")) == "npu":
        conflict = alloc_conf_conflict(environ)
        if conflict:
            rep.errors.append(conflict)


def length_rules(rep: Report, cfg, model: dict) -> None:
    """A padded sequence (prompt + response) fits the token budgets and the model's positions."""
    prompt_len, resp_len = _pos(rep, cfg, "data.max_prompt_length"), _pos(rep, cfg, "data.max_response_length")
    if not (prompt_len and resp_len):
        return
    max_len = prompt_len + resp_len
    _check_token_budgets(rep, cfg, max_len)
    if isinstance(model.get("max_position_embeddings"), int):
        rep.check(max_len <= model["max_position_embeddings"],
                  f"prompt + response = {max_len} exceeds max_position_embeddings {model['max_position_embeddings']}")
    tokens = _pos(rep, cfg, f"{R}.max_num_batched_tokens")
    if _select(cfg, f"{R}.enable_chunked_prefill") is True and tokens and tokens < max_len:
        rep.notes.append(
            f"rollout.max_num_batched_tokens={tokens} < max_model_len {max_len} with chunked prefill: "
            "verl 0.4.1's vLLMRollout rejects this; the recipe's rollout patch must lift that check")


def checkpoint_rules(rep: Report, cfg) -> None:
    """What the whole-or-absent checkpoints need (verl_patches/train/checkpoint_commit.py): a synchronous save when
    the run saves, a resume mode verl knows, and the directory a resume_path names."""
    save_freq = _select(cfg, "trainer.save_freq")
    if isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0:
        rep.check(_select(cfg, "actor_rollout_ref.actor.checkpoint.async_save") is not True,
                  f"actor_rollout_ref.actor.checkpoint.async_save=True with trainer.save_freq={save_freq}: "
                  f"{ASYNC_SAVE_WHY}")
    mode = _select(cfg, "trainer.resume_mode")
    if rep.check(mode in RESUME_MODES, f"trainer.resume_mode={mode!r}: one of {', '.join(RESUME_MODES)}"):
        problem = resume_path_problem(_select(cfg, "trainer.resume_from_path")) if mode == "resume_path" else None
        if problem:
            rep.errors.append(problem)


def model_rules(rep: Report, cfg, model: dict) -> None:
    """What the model and its loading need: no rope fusion with YaRN, BF16 weights, MTP off, a
    distributed-checkpoint path when one is used."""
    rope = model.get("rope_scaling") if isinstance(model.get("rope_scaling"), dict) else {}
    otc = _select(cfg, "actor_rollout_ref.actor.megatron.override_transformer_config")
    fusion = otc.get("apply_rope_fusion", False) if hasattr(otc, "get") else False
    rep.check(not (rope.get("type") == "yarn" and fusion),
              "override_transformer_config.apply_rope_fusion=True with YaRN RoPE: megatron's MLA asserts it off "
              "(use recipe.megatron.use_fused_rotary_pos_emb on NPU)")
    if model.get("quantization_config"):
        rep.errors.append("model config has quantization_config: convert FP8 to BF16 first "
                          "(python -m verl_patches.tools.fp8_to_bf16) and drop it")
    nextn = _select(cfg, "actor_rollout_ref.model.override_config.model_config.num_nextn_predict_layers")
    rep.check(model.get("num_nextn_predict_layers", 0) == 0 or nextn == 0, "MTP must be off: num_nextn_predict_layers=0")
    for who in ("actor", "ref"):
        use = _select(cfg, f"actor_rollout_ref.{who}.megatron.use_dist_checkpointing")
        if use is not None and not isinstance(use, bool):
            rep.errors.append(f"actor_rollout_ref.{who}.megatron.use_dist_checkpointing must be true or false, got {use!r}")
        elif use:
            path = _select(cfg, f"actor_rollout_ref.{who}.megatron.dist_checkpointing_path")
            rep.check(bool(path) and str(path).strip() != "",
                      f"{who}.megatron.use_dist_checkpointing=True but dist_checkpointing_path is empty (set DIST_CKPT_PATH)")


def card_rules(rep: Report, recipe: dict, world: int | None, nnodes: int | None, per_node: int | None) -> None:
    """perf/tps_per_card divides by whole cards (verl_patches/reporting/report.py: Cards); checked here, before a run."""
    per_card = recipe.get("devices_per_card")
    # One below the key's own range is named by settings.problems already.
    if world is not None and isinstance(per_card, int) and not isinstance(per_card, bool) \
            and settings.problem("devices_per_card", per_card, "") is None:
        rep.check(per_card >= 1 and world % per_card == 0,
                  f"{RECIPE_SECTION}.devices_per_card={per_card}: the world size {world} (trainer.nnodes {nnodes} x "
                  f"trainer.n_gpus_per_node {per_node}) is not whole cards of {per_card} device(s)")


def profile_rules(rep: Report, cfg, recipe: dict, world: int | None) -> None:
    """recipe.profile (well-formed: settings.problems): a chosen rank the run has not is an error (its traces would
    never come); a step range the run never reaches, or old_log_prob under old log-prob reuse (verl's forward never
    runs), is said as a warning: nothing would be written."""
    if rep.bad_values or not isinstance(recipe.get("profile"), dict):
        return
    profile = settings.ProfileSettings.of(recipe["profile"])
    if not profile.on:
        return
    here = f"{RECIPE_SECTION}.profile"
    if world is not None and profile.ranks != "all":
        missing = [r for r in profile.ranks if r >= world]
        rep.check(not missing, f"{here}.ranks={list(profile.ranks)}: the run has ranks 0..{world - 1} "
                               f"(trainer.nnodes x trainer.n_gpus_per_node), not {missing}")
    total = _select(cfg, "trainer.total_training_steps")
    if isinstance(total, int) and not isinstance(total, bool) and profile.steps[0] > total:
        rep.warnings.append(f"{here}.steps={list(profile.steps)} starts after trainer.total_training_steps={total}: "
                            "no trace will be written")
    if "old_log_prob" in profile.stages and _select(cfg, "actor_rollout_ref.actor.recompute_old_log_prob") is False:
        rep.warnings.append(f"{here}.stages names old_log_prob, but actor_rollout_ref.actor.recompute_old_log_prob="
                            "False reuses the update's log-prob: verl's old log-prob forward never runs, so that "
                            "stage writes no trace")


MEMORY_KEYS = ("hidden_size", "num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank",
               "v_head_dim", "moe_intermediate_size", "intermediate_size", "vocab_size")


def _check_memory(rep: Report, cfg, recipe, model: dict, hybrid: dict | None, **layout) -> dict | None:
    """recipe.device_memory_gib set: the per-device training state and rollout weights must fit
    (verl_patches/checks/recipe_memory.py). None when it is not set or the model config lacks the sizes."""
    device_gib = recipe.get("device_memory_gib", None)
    if device_gib is None or rep.errors:
        return None
    if not rep.check(isinstance(device_gib, (int, float)) and not isinstance(device_gib, bool) and device_gib > 0,
                     f"{RECIPE_SECTION}.device_memory_gib must be a positive number, got {device_gib!r}"):
        return None
    if any(k not in model for k in MEMORY_KEYS):
        rep.notes.append("memory not estimated: the model config lacks the layer sizes")
        return None

    arr = cfg.actor_rollout_ref
    # MindSpeed's swap optimizer keeps Adam's state on the host between its uses (Ascend only);
    # megatron-core's HybridDeviceOptimizer (actor.optim.optimizer_cpu_offload) keeps a share of it there.
    megatron = recipe.get("megatron") if isinstance(recipe.get("megatron"), dict) else {}
    swap = str(cfg.trainer.device) == "npu" and bool(megatron.get("swap_optimizer", False))
    fraction = hybrid["fraction"] if hybrid else (1.0 if swap else 0.0)
    # The direct reshard's buckets are counted at the switch; the baselines' gather buffers (alltoallv, upstream)
    # are not estimated (docs/benchmarks.md measures them per layout).
    method = recipe.get("reshard_method", settings.KEYS["reshard_method"].default)
    direct = method == "direct"
    bucket_mb = recipe.get("reshard_bucket_mb", settings.KEYS["reshard_bucket_mb"].default) if direct else 0
    est = estimate(model, host_fraction=fraction, host_grad_copy=bool(hybrid), reshard_bucket_mb=bucket_mb, **layout)
    out = {**est.as_dict(), "device_memory_gib": device_gib}
    if not direct:
        rep.notes.append(f"{RECIPE_SECTION}.reshard_method={method}: its transfer buffers are not "
                         "in the switch's memory estimate (only the direct method's buckets are)")
    where = ("" if fraction == 1.0 else f" + optimizer {est.device_optimizer:.1f}"
             + (f" ({1 - fraction:g} of {est.optimizer:.1f} on the device)" if fraction else ""))
    rep.check(est.training_state <= device_gib,
              f"training state {est.training_state:.1f} GiB per device (params {est.params:.1f} + grads {est.grads:.1f}"
              f"{where}) exceeds {RECIPE_SECTION}.device_memory_gib="
              f"{device_gib}: use more devices (a larger expert group or pipeline), devices with more memory, or "
              "the optimizer on the host (actor_rollout_ref.actor.optim.optimizer_cpu_offload=True)")
    host_gib = recipe.get("host_memory_gib", None)
    per_node = _select(cfg, "trainer.n_gpus_per_node")
    if host_gib is not None and isinstance(per_node, int) and not isinstance(per_node, bool):
        if rep.check(isinstance(host_gib, (int, float)) and not isinstance(host_gib, bool) and host_gib > 0,
                     f"{RECIPE_SECTION}.host_memory_gib must be a positive number, got {host_gib!r}"):
            need = est.host_per_device * per_node
            out.update(host_per_node_gib=round(need, 1), host_memory_gib=host_gib)
            rep.check(need <= host_gib,
                      f"host memory {need:.1f} GiB per node ({per_node} devices x (optimizer on host "
                      f"{est.host_optimizer:.1f} + the switch's copies of the training and reference params "
                      f"{2 * est.params:.1f})) exceeds {RECIPE_SECTION}.host_memory_gib={host_gib}: lower "
                      "actor_rollout_ref.actor.optim.optimizer_offload_fraction, or use more nodes")
    share = float(arr.rollout.gpu_memory_utilization)
    rep.check(est.rollout_weights <= share * device_gib,
              f"rollout weights {est.rollout_weights:.1f} GiB per device exceed rollout.gpu_memory_utilization={share} "
              f"of {device_gib} GiB: raise the rollout TP or EP, or the memory share")
    rep.check(est.switch_peak <= device_gib,
              f"the switch's reshard holds {est.switch_peak:.1f} GiB per device (training params {est.params:.1f} + "
              f"rollout weights {est.rollout_weights:.1f} + {RESHARD_BUCKETS_IN_FLIGHT} reshard buckets of "
              f"{bucket_mb} MiB), over {RECIPE_SECTION}.device_memory_gib={device_gib}: lower "
              f"{RECIPE_SECTION}.reshard_bucket_mb, or raise the rollout TP or EP")
    if est.training_state > 0.85 * device_gib:
        rep.notes.append(f"training state {est.training_state:.1f} GiB is over 85% of {device_gib} GiB: activations "
                         "need the rest (keep full recompute)")
    return out


def _optimizer_offload(rep: Report, cfg, swap_optimizer: bool):
    """actor.optim's optimizer-offload settings (patch verl.optim.cpu_offload): the checked dict, None when
    off, False when they are malformed or cannot combine (the error is recorded)."""
    optim = _select(cfg, "actor_rollout_ref.actor.optim")
    if optim is None:
        return None
    try:
        hybrid = offload_settings(optim)
    except OptimizerOffloadError as e:
        rep.errors.append(str(e))
        return False
    if hybrid and swap_optimizer:
        rep.errors.append("actor.optim.optimizer_cpu_offload=True (megatron-core's HybridDeviceOptimizer) cannot "
                          f"combine with {RECIPE_SECTION}.megatron.swap_optimizer=True (MindSpeed's swap optimizer "
                          "moves the same state): turn one of them off")
        return False
    return hybrid


def verl_validate(cfg) -> str | None:
    """verl's own trainer-side checks (RayPPOTrainer._validate_config); the failure message, or None."""
    # Lazy: verl, Hydra and OmegaConf load when configs are composed (several seconds; --help runs without them).
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    # It reads only these three attributes; GRPO has no critic and uses the reference policy (KL loss).
    probe = SimpleNamespace(config=cfg, use_critic=cfg.algorithm.adv_estimator == "gae",
                            use_reference_policy=bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward))
    try:
        RayPPOTrainer._validate_config(probe)
    except (AssertionError, ValueError) as e:
        return f"verl's RayPPOTrainer._validate_config rejects the config: {e}"
    except Exception as e:  # noqa: BLE001 - verl's checks assume well-typed values; report, never crash
        return f"verl's RayPPOTrainer._validate_config cannot check the config: {type(e).__name__}: {e}"
    return None


def data_files(cfg) -> list[Path]:
    files = []
    for key in ("data.train_files", "data.val_files"):
        value = _select(cfg, key)
        items = [value] if isinstance(value, str) else list(value or [])
        files += [Path(os.path.expanduser(str(v))) for v in items]
    return files


def check_data(cfg, rep: Report) -> None:
    """Errors for rows of the configured data files that the configured reward cannot score."""
    present = []
    for f in data_files(cfg):
        if f.is_file():
            present.append(f)
        else:
            rep.notes.append(f"data file {f} not found: its rows were not checked against the reward")
    if not present:
        return
    try:
        scorer, what = recipe_scorer(cfg)
    except Exception as e:  # noqa: BLE001 - a custom reward that does not load is the finding itself
        rep.errors.append(f"the configured reward cannot be loaded: {type(e).__name__}: {e}")
        return
    prompt_key = _select(cfg, "data.prompt_key") or "prompt"
    problems = check_files(present, scorer, str(prompt_key))
    rep.errors += problems
    if not problems:
        rep.notes.append(f"every data_source in {len(present)} data file(s) is scored by {what}")


def _checkpoint_bytes(cfg, model: dict, layout: dict) -> float | None:
    """One checkpoint of the actor on the run's layout (recipe_memory.checkpoint_size), or None where the run
    does not save or the layout or the model's sizes are not known."""
    save_freq = _select(cfg, "trainer.save_freq")
    train = layout.get("train") or {}
    if not (isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0) \
            or any(k not in model for k in MEMORY_KEYS) or None in (layout.get("world"), train.get("expert_group")):
        return None
    return checkpoint_size(model, world=layout["world"], tp=train["tp"], pp=train["pp"],
                           expert_group=train["expert_group"], layer_list=train["num_layer_list"] or None).total


def output_dirs(cfg, model: dict, layout: dict, log_dir: str | None = None) -> list[OutputDir]:
    """The directories the run writes, each with the free space it needs: the checkpoints (one checkpoint of the
    actor where the size is known, else the floor), the launcher's logs, the profiler's traces when stages are
    named, tensorboard's events when verl's tensorboard logger is on, and the metrics record's folder."""
    out = []
    ckpt = _select(cfg, "trainer.default_local_dir")
    if isinstance(ckpt, str) and ckpt:
        need = _checkpoint_bytes(cfg, model, layout)
        out.append(OutputDir("trainer.default_local_dir", ckpt, *([need] if need else [])))
    if log_dir:
        out.append(OutputDir("LOG_DIR", log_dir))
    recipe = settings.plain(_select(cfg, RECIPE_SECTION)) or {}
    profile = recipe.get("profile") if isinstance(recipe.get("profile"), dict) else {}
    if profile.get("stages") and isinstance(profile.get("dir"), str):
        out.append(OutputDir(f"{RECIPE_SECTION}.profile.dir", profile["dir"]))
    logger = _select(cfg, "trainer.logger")
    loggers = [logger] if isinstance(logger, str) else list(logger or [])
    if "tensorboard" in loggers:
        tb = recipe.get("tensorboard_dir")
        # verl's tensorboard logger's own default (TENSORBOARD_DIR unset), under the driver's directory.
        tb = tb if isinstance(tb, str) else os.path.join("tensorboard_log", str(_select(cfg, "trainer.project_name")),
                                                         str(_select(cfg, "trainer.experiment_name")))
        out.append(OutputDir(f"{RECIPE_SECTION}.tensorboard_dir", tb))
    metrics = recipe.get("metrics_file")
    if isinstance(metrics, str) and metrics:
        out.append(OutputDir(f"{RECIPE_SECTION}.metrics_file's folder", os.path.dirname(metrics) or "."))
    return out


def check_outputs(cfg, model: dict, rep: Report, log_dir: str | None = None) -> None:
    """Errors for each directory the run writes that it could not: a path through a file, no write permission
    (tried), too little free space; a note naming those that can be written."""
    dirs = output_dirs(cfg, model, rep.layout, log_dir)
    problems = [p for p in map(dir_problem, dirs) if p]
    rep.errors += problems
    if not problems and dirs:
        rep.notes.append("writable with room: " + ", ".join(f"{d.what} {d.path}" for d in dirs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.checks.recipe_config", description=__doc__)
    p.add_argument("--config-name", type=Text(), required=True, help=f"one of {RUN_CONFIGS}")
    p.add_argument("--config-dir", type=PathArg("config directory"), default=CONFIG_DIR)
    p.add_argument("--model-config", type=PathArg("model config.json"), default=None, help="DeepSeek-V3 config.json (default: model.path, then configs/model/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved YAML")
    p.add_argument("--check-data", action="store_true",
                   help="also check that the configured reward scores every data_source in data.train_files / "
                        "data.val_files (files that do not exist are a note)")
    p.add_argument("--check-outputs", action="store_true",
                   help="also check that every directory the run writes (checkpoints, logs, profiles, tensorboard, "
                        "the metrics record) exists or can be created, can be written, and has room (on this node)")
    p.add_argument("--log-dir", type=PathArg("log directory"), default=None,
                   help="the launcher's LOG_DIR, checked with --check-outputs")
    p.add_argument("overrides", nargs="*", type=Text(), help="Hydra overrides, as given to verl.trainer.main_ppo")
    args = p.parse_args(argv)
    try:
        # Lazy: verl, Hydra and OmegaConf load when configs are composed (several seconds; --help runs without them).
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
    if not rep.bad_values:  # verl's own checks assume well-typed values
        verl_error = verl_validate(cfg)
        if verl_error:
            rep.errors.append(verl_error)
    if args.check_data:
        check_data(cfg, rep)
    if args.check_outputs:
        check_outputs(cfg, model, rep, None if args.log_dir is None else str(args.log_dir))
    return finish(rep.errors, f"{args.config_name}: composed and validated", warnings=rep.warnings,
                  lines=[f"model config: {model_path}", "layout: " + json.dumps(rep.layout),
                         *(f"note: {note}" for note in rep.notes)],
                  failed=f"{args.config_name}: {len(rep.errors)} layout/config error(s)")


if __name__ == "__main__":
    sys.exit(main())
