"""``python -m verl_patches layer-spec``: the classes DeepSeek-V3's layer spec resolves to on Ascend, for a run's
config, resolved as a rank of that run resolves them; exit 1 when any is not a real implementation.

A rank of an Ascend run builds its training model from MindSpeed-LLM's DeepSeek layer spec under Megatron's global
arguments (record ``verl.deepseek_v3_mindspeed_llm_layer_spec``). Which class each slot of that spec holds is
decided by the installed MindSpeed / MindSpeed-LLM releases and by the arguments (MindSpeed's features read them
when they register). This command takes the same steps as the rank, in one process, without a device or a
process group, and without building the model:

1. the config composed as verl's main_ppo composes it (verl_patches/checks/compose.py), with the user's overrides;
2. the worker phase's prelude (verl_patches/prelude.py ``apply_prelude``: on the NPU rehearsal platform the
   stand-in first, then MindSpeed's records, MindSpeed-LLM's adaptor, every other record);
3. Megatron's global arguments from the model's config.json, the actor's layout and ``recipe.megatron``
   (verl_patches/train/mindspeed_adaptor.py ``build_global_args``, which the binding calls), for the run's world size
   (``trainer.nnodes x trainer.n_gpus_per_node`` unless ``--world-size`` says otherwise);
4. verl's ``DeepseekV3Model.get_transformer_layer_spec``, which the record replaces: it walks the spec and refuses
   None, a bare ``torch.nn.Module`` dummy, a Transformer Engine class or a CPU-platform host module
   (verl_patches/train/layer_classes.py).

It prints one line per class with the release it came from (configs/upstream.lock.toml), and with ``--json FILE``
writes them there. ``python -m verl_patches doctor`` runs it on the NPU platform; the cluster launchers' doctor
step passes their config and overrides, so the 256-die dry run lists the classes its ranks will build.
NPU only (an Atlas node, or the NPU rehearsal platform: ``VERL_PATCHES_PLATFORM=npu-rehearsal``); elsewhere the
spec is not the one the run builds, and the command refuses.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from verl_patches.rigs import npu_rehearsal
from verl_patches.base import accelerator
from verl_patches.base.schema import Integer, PathArg, Text
from verl_patches.config import megatron_args, settings
from verl_patches.core import apply
from verl_patches import prelude
from verl_patches.checks.compose import CONFIG_DIR, compose, find_model_config, load_model_config
from verl_patches.train import layer_classes
from verl_patches.train.mindspeed_adaptor import build_global_args

DEFAULT_CONFIG = "deepseekv3_256die_random_init"
# The records the report takes its steps through (applied by the worker prelude, as in a rank).
RECORDS = ("verl.recipe_megatron.binding", "verl.deepseek_v3_mindspeed_llm_layer_spec")


class LayerSpecReportError(RuntimeError):
    """The spec could not be resolved for this config (the message names the step and the fix)."""


def _layout(cfg) -> dict[str, int]:
    meg = cfg.actor_rollout_ref.actor.megatron
    return {"tp": int(meg.tensor_model_parallel_size), "pp": int(meg.pipeline_model_parallel_size),
            "ep": int(meg.expert_model_parallel_size),
            "etp": None if meg.get("expert_tensor_parallel_size") is None else int(meg.expert_tensor_parallel_size),
            "cp": int(meg.get("context_parallel_size") or 1)}


def resolve(config_name: str, overrides: list[str], config_dir: Path = CONFIG_DIR, model_config: Path | None = None,
            world_size: int | None = None) -> dict:
    """The resolved classes of ``config_name``'s layer spec: {"config", "world_size", "layout", "model_config",
    "classes": [{"path", "class", "release"}], "problems": [...]}. Raises LayerSpecReportError off the NPU."""
    platform = accelerator.device_type()
    if platform != "npu" and not npu_rehearsal.selected():
        raise LayerSpecReportError(
            f"the layer spec is Ascend's and this process runs on {platform}: run it on an Atlas node (torch_npu "
            "importable) or on the NPU rehearsal platform (VERL_PATCHES_PLATFORM=npu-rehearsal, with "
            f"{npu_rehearsal.SITE} first on PYTHONPATH)")
    # Lazy: torch loads with the prelude (the command's --help runs without it).
    import torch

    cfg = compose(config_name, overrides, config_dir)
    model_path = find_model_config(cfg, model_config)
    load_model_config(model_path)  # refuses a config.json that is not DeepSeek-V3's, naming the key
    trainer = cfg.trainer
    world = world_size or int(trainer.nnodes) * int(trainer.n_gpus_per_node)
    # What rank 0 of the run has in its environment: the run's world (Megatron's argument check divides it by the
    # layout), and scripts/cluster/recipe_env.sh's CUDA_DEVICE_MAX_CONNECTIONS, which that check requires with TP
    # (a value already set wins, as there).
    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0", VERL_PATCHES_PHASE="worker")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    prelude.apply_prelude("worker")  # a no-op where verl's hooked worker module ran it already
    missing = [r for r in RECORDS if r not in apply.applied()]
    if missing:
        raise LayerSpecReportError(
            f"the worker prelude did not apply {missing} (VERL_PATCHES_OFF or VERL_PATCHES_DISABLE set?): a rank would "
            "not build DeepSeek-V3 from MindSpeed-LLM's spec; `python -m verl_patches doctor` names each record's state")
    layout = _layout(cfg)
    recipe = settings.from_trainer(cfg).megatron  # the section checked, every problem named
    model_dir = model_path.parent
    if model_path.name != "config.json":  # the binding reads <model dir>/config.json, as verl's worker does
        model_dir = Path(tempfile.mkdtemp(prefix="layer_spec_model_"))
        shutil.copyfile(model_path, model_dir / "config.json")
    build_global_args(cfg.actor_rollout_ref, str(model_dir), torch.bfloat16, recipe, **layout)
    from verl.models.mcore.model_initializer import DeepseekV3Model  # after the prelude, as in the rank

    try:
        # The record's replacement reads no state of the model object.
        spec = DeepseekV3Model.get_transformer_layer_spec(object.__new__(DeepseekV3Model))
    except layer_classes.LayerSpecError:  # refused: walked again below, to list every class with the problems
        module, attr = megatron_args.DEEPSEEK_SPEC
        spec = getattr(importlib.import_module(module), attr)
    entries = layer_classes.walk(spec)
    problems = layer_classes.problems(entries)
    rel = layer_classes.releases()
    return {"config": config_name, "world_size": world, "layout": layout, "model_config": str(model_path),
            "classes": [{"path": e.path, "class": e.name, "release": rel.get(e.package, e.package or "?")}
                        for e in entries],
            "problems": problems}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches layer-spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--config-name", type=Text(), default=DEFAULT_CONFIG, help="a recipe config in configs/")
    p.add_argument("--config-dir", type=PathArg("config directory"), default=CONFIG_DIR)
    p.add_argument("--model-config", type=PathArg("model config.json"), default=None,
                   help="DeepSeek-V3 config.json (default: the config's model.path, then configs/model/)")
    p.add_argument("--world-size", type=Integer(low=1), default=None,
                   help="ranks of the run (default: trainer.nnodes x trainer.n_gpus_per_node)")
    p.add_argument("--json", type=PathArg("JSON output file"), default=None,
                   help="also write the result to this file")
    p.add_argument("overrides", nargs="*", type=Text(), help="Hydra overrides, as given to verl.trainer.main_ppo")
    args = p.parse_args(argv)
    try:
        out = resolve(args.config_name, args.overrides, args.config_dir, args.model_config, args.world_size)
    except Exception as e:  # noqa: BLE001 - every failure is reported the same way: the step's error, named
        out = {"config": args.config_name, "error": f"{type(e).__name__}: {e}"}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if "error" in out:
        print(f"error: layer spec of {args.config_name}: {out['error']}", file=sys.stderr)
        return 1
    print(f"layer spec of {out['config']} on Ascend (world {out['world_size']}, layout {out['layout']}):")
    for c in out["classes"]:
        print(f"  {c['path']}: {c['class']} [{c['release']}]")
    if out["problems"]:
        print(f"error: {len(out['problems'])} class(es) of the layer spec are not real implementations:\n  "
              + "\n  ".join(out["problems"]), file=sys.stderr)
        return 1
    print(f"layer spec: {len(out['classes'])} classes, each a real implementation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
