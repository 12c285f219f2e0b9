"""Per-rank body for the recipe.megatron tests: verl 0.4.1's real MegatronWorker._init_hf_config_and_tf_config
and hf_to_mcore_config build the TransformerConfig, real megatron-core parallel state (gloo) and a real
GPTModel (MLA + MoE, local spec) show what each pipeline stage builds.

Stand-ins, declared: the worker object is made without verl's Ray-side __init__ (only the attributes the
method reads: config, rank); the tokenizer is a namespace of token ids; megatron's CPU stand-ins are
verl_patches.rigs.testing.live_models.megatron_cpu_stand_ins (torch.cuda.current_device, the grouped-GEMM
package check) plus its parameter-free core-attention stub.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from verl_patches.core import stash

TINY = Path(__file__).resolve().parents[3] / "configs" / "model" / "tiny_deepseek_v3.json"
# What the CPU model build needs of the TransformerConfig (given as the user's override_transformer_config):
# the alltoall dispatcher and the shared-expert overlap make CUDA objects, the persistent layer norm is an
# Apex kernel, and the allgather dispatcher refuses variable sequence lengths. No forward runs here.
CPU_BUILD_OVERRIDES = {"use_cpu_initialization": True, "moe_token_dispatcher_type": "allgather",
                       "moe_shared_expert_overlap": False, "persist_layer_norm": False, "variable_seq_lengths": False}


def all_patches() -> list:
    from verl_patches.patches.megatron import patch_core_transformer_transformer_block as blk
    from verl_patches.patches.megatron import patch_core_transformer_transformer_layer as lay
    from verl_patches.patches.verl import patch_models_mcore_registry as reg
    from verl_patches.patches.verl import patch_single_controller_base_megatron_worker as wrk
    from verl_patches.patches.verl import patch_utils_megatron_utils as mu

    # The registry module also holds the update's entropy patch (feature old_log_prob_reuse), which
    # requires the actor's update patches; these tests build the model only.
    config = [p for p in reg.PATCHES if p.id == "verl.mcore_config.deepseek_v3"]
    return config + wrk.PATCHES + mu.PATCHES + blk.PATCHES + lay.PATCHES


def model_config(layers: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = json.loads(TINY.read_text())
    cfg["num_hidden_layers"] = layers
    cfg.update(extra or {})
    return cfg


def init_worker_config(rank: int, model: dict[str, Any], recipe: dict[str, Any] | None, overrides: dict[str, Any],
                       actor: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """Run verl's real _init_hf_config_and_tf_config on a bare MegatronWorker; (tf_config, hf_config)."""
    from omegaconf import OmegaConf

    from verl.single_controller.base.megatron.worker import MegatronWorker

    d = Path(tempfile.mkdtemp(prefix=f"recipe_megatron_{rank}_"))
    (d / "config.json").write_text(json.dumps(model))
    w = MegatronWorker.__new__(MegatronWorker)  # stand-in: no Ray-side __init__
    cfg: dict[str, Any] = {"model": {}, "actor": actor or {"load_weight": False}}
    if recipe is not None:
        cfg["rollout"] = {"recipe": {"megatron": recipe}}
    w.config = OmegaConf.create(cfg)
    w._rank = rank  # what Worker.rank reads
    tok = SimpleNamespace(bos_token_id=0, eos_token_id=1, pad_token_id=1)  # stand-in tokenizer
    w._init_hf_config_and_tf_config(str(d), tok, torch.float32, {}, dict(overrides))
    return w.tf_config, w.hf_config


def build_gpt(tf: Any, vocab: int) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core import parallel_state as ps

    spec = get_gpt_decoder_block_spec(tf, use_transformer_engine=False)

    class CoreAttentionStub(torch.nn.Module):  # stand-in: parameter-free
        def __init__(self, *args, **kwargs):
            super().__init__()

    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = CoreAttentionStub
    return GPTModel(tf, spec, vocab_size=vocab, max_sequence_length=128, position_embedding_type="rope",
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False)


def convert_rank(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """World 1: the real converter and the worker binding, case by case (patched or not)."""
    from megatron.core import parallel_state as ps

    from verl_patches.core.apply import apply_all, undo
    from verl_patches.rigs.testing.live_models import megatron_cpu_stand_ins

    megatron_cpu_stand_ins()
    ps.initialize_model_parallel(1, 1)
    import logging

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("verl_patches.patches.verl.patch_single_controller_base_megatron_worker").addHandler(handler)
    out = []
    for case in cases:
        warnings.clear()
        if case.get("patched", True):
            apply_all(all_patches())
        if case.get("mindspeed_stand_in"):
            _install_mindspeed_stand_in(case["mindspeed_stand_in"])
        try:
            model = (json.loads(Path(case["model_file"]).read_text()) if "model_file" in case
                     else model_config(case.get("layers", 4), case.get("model")))
            tf, _ = init_worker_config(rank, model, case.get("recipe"), case.get("overrides", {}), case.get("actor"))
            fields = {k: getattr(tf, k) for k in case.get("fields", [])}
            res = {"ok": True, "fields": json.loads(json.dumps(fields, default=str)),
                   "num_layer_list": _listed(stash.get(tf, "num_layer_list", "absent"))}
            res["warnings"] = list(warnings)
            if case.get("mindspeed_stand_in"):
                import mindspeed.megatron_adaptor as adaptor

                res["mindspeed_parsed_at_import"] = adaptor.PARSED_AT_IMPORT
                res["mindspeed_args"] = vars(adaptor.get_mindspeed_args())
            out.append(res)
        except Exception as e:  # noqa: BLE001 - the test compares the message
            out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
        finally:
            undo()
            if case.get("mindspeed_stand_in"):
                os.environ.pop("VERL_PATCHES_DEVICE", None)
    return out


def _listed(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _install_mindspeed_stand_in(root: str) -> None:
    """Ascend only in real life: a declared stand-in MindSpeed package (see the test) under VERL_PATCHES_DEVICE=npu.

    Our register_features_args wrapper goes on by hand: the Patch record's fingerprint is MindSpeed's
    real source, which the stand-in is not.
    """
    import sys

    from verl_patches.patches.mindspeed.patch_arguments import wrap_register_features_args

    os.environ["VERL_PATCHES_DEVICE"] = "npu"
    sys.path.insert(0, root)
    # MindSpeed alone (the binding's route where MindSpeed-LLM is absent): the installed MindSpeed-LLM is hidden,
    # its route is tested on the NPU rehearsal platform (tests/npu_rehearsal/npu_path_build.py).
    sys.modules["mindspeed_llm"] = None  # type: ignore[assignment]  (find_spec answers None)
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager as manager

    original = vars(manager)["register_features_args"].__func__
    manager.register_features_args = classmethod(wrap_register_features_args(original))


def uneven_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """World = PP: the worker binding, the GPTModel each stage builds (patched), then upstream's view of the same config."""
    from megatron.core import parallel_state as ps

    from verl_patches.core.apply import apply_all, undo
    from verl_patches.rigs.testing.live_models import megatron_cpu_stand_ins

    megatron_cpu_stand_ins()
    ps.initialize_model_parallel(1, world)
    model = model_config(spec["layers"], {"first_k_dense_replace": spec["dense"]})
    out: dict[str, Any] = {"pp_rank": ps.get_pipeline_model_parallel_rank()}
    apply_all(all_patches())
    try:
        tf, _ = init_worker_config(rank, model, {"num_layer_list": spec["num_layer_list"]}, CPU_BUILD_OVERRIDES)
        gpt = build_gpt(tf, model["vocab_size"])
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from verl.utils.model import normalize_model_name

        layers = gpt.decoder.layers
        out["layer_numbers"] = [int(layer.layer_number) for layer in layers]
        out["moe"] = [isinstance(layer.mlp, MoELayer) for layer in layers]
        sharded = gpt.sharded_state_dict()
        # The global names the distributed checkpoint stores this stage's layers under.
        keys = [getattr(v, "key", "") for v in sharded.values()]
        out["ckpt_layers"] = sorted({int(k.split("decoder.layers.")[1].split(".")[0])
                                     for k in keys if k.startswith("decoder.layers.")})
        # What per_tensor_generator names this stage's first and last local layer for the rollout.
        out["rollout_names"] = [normalize_model_name(f"decoder.layers.{i}.mlp.linear_fc2.weight", out["pp_rank"], 0, tf)
                                for i in (0, len(layers) - 1)]
        out["pre_post"] = [gpt.pre_process, gpt.post_process]
        undo()
        # Upstream, on the same config: what megatron-core 0.12.1 and verl make of the stage.
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from verl.utils.megatron_utils import get_transformer_layer_offset

        out["upstream_verl_offsets"] = [get_transformer_layer_offset(p, 0, tf) for p in range(world)]
        try:
            out["upstream_layers_to_build"] = get_num_layers_to_build(tf)
        except AssertionError as e:
            out["upstream_layers_to_build"] = f"AssertionError: {e}"
    except Exception as e:  # noqa: BLE001 - the test compares the message
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        undo()
    return out
