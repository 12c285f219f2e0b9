"""The NPU path on the NPU rehearsal platform, run as its own process (torch_npu's import renames torch's
PrivateUse1 backend and MindSpeed patches megatron-core in place: neither can be undone in a test process).

Through the overlay's own mechanism: launch.prelude.boot_rehearsal (the stand-in, MindSpeed's op builders on host
kernels); the binding's build_global_args (Megatron's global arguments from verl's config:
verl_patches.config.megatron_args.megatron_argv of the tiny DeepSeek-V3's HF config through MindSpeed-LLM's
parser, whose adaptor applies MindSpeed's and MindSpeed-LLM's features); the worker-phase records the rehearsal
platform selects (launch.prelude.patches_for) for the model; verl's own MegatronWorker._init_hf_config_and_tf_config
(wrapped by verl.recipe_megatron.binding) and registry.init_mcore_model, whose layer spec is MindSpeed-LLM's
(record verl.deepseek_v3_mindspeed_llm_layer_spec). One forward and backward in bf16 (megatron's Float16Module,
as verl's get_model wraps it) on a gloo world of 1 ("hccl", registered by the stand-in as torch_npu does).
Prints one JSON line: the module classes, the dummy modules, the output, parameters without a gradient.
``DROP_OPERATOR=<name>`` removes that operator from the stand-in's table first (the test that the path fails
naming it). Run with the stand-in's site on PYTHONPATH, WORLD_SIZE=1 (tests/npu_rehearsal/test_platform.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    from verl_patches.rigs import npu_rehearsal

    drop = os.environ.get("DROP_OPERATOR")
    if drop:
        from verl_patches.rigs.npu_rehearsal import ops

        del ops.OPERATORS[drop]
    import tempfile
    import types

    import torch
    from omegaconf import OmegaConf

    from verl_patches.core import apply
    from verl_patches.prelude import boot_rehearsal
    from verl_patches.patches.mindspeed import patch_features_manager_features_manager as no_text_generation
    from verl_patches.patches.verl import patch_single_controller_base_megatron_worker as binding

    os.environ.setdefault("VERL_PATCHES_PHASE", "worker")
    boot_rehearsal()  # the stand-in and MindSpeed's op builders on host kernels (the prelude's first step)
    worker_config = OmegaConf.create({"model": {}, "rollout": {"prompt_length": 32, "response_length": 32,
                                                               "recipe": {"megatron": {}}}})
    model_dir = Path(tempfile.mkdtemp(prefix="npu_path_model_"))
    (model_dir / "config.json").write_text((REPO / "configs/model/tiny_deepseek_v3.json").read_text())
    # MindSpeed-LLM's adaptor BEFORE megatron-core is imported and seeded: it replaces megatron-core's
    # _set_cuda_rng_state and jit_fuser (torch.compile) and must come first, as in the reference recipe. verl's
    # worker seeds megatron-core before the binding runs: in a rank the prelude imports the adaptor first
    # (npu_path_worker.py runs that order). Here, the model's records only, the binding's own function runs first,
    # with the layout the worker will have; the binding's call below then finds the same arguments built.
    apply.apply_all(no_text_generation.PATCHES)  # before the adaptor runs (its docstring: why)
    recipe = binding.importlib.import_module("verl_patches.config.megatron_args").parse({})
    binding.build_global_args(worker_config, str(model_dir), torch.bfloat16, recipe, tp=1, pp=1, ep=1, etp=1,
                              cp=1)
    import torch.distributed as dist

    store = tempfile.NamedTemporaryFile(prefix="npu_path_store_", delete=False).name
    dist.init_process_group("hccl", init_method=f"file://{store}", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    mpu.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(42)
    # The worker-phase records the build goes through (the whole prelude: npu_path_worker.py).
    from verl_patches.prelude import patches_for

    wanted = {"verl.recipe_megatron.binding", "mindspeed.recipe_megatron_args",
              "verl.deepseek_v3_mindspeed_llm_layer_spec", "verl.mcore_config.deepseek_v3"}
    records = [p for p in patches_for("worker") if p.id in wanted]
    applied = apply.apply_all(records)
    from transformers import AutoConfig  # noqa: F401
    from verl.single_controller.base.megatron.worker import MegatronWorker

    worker = object.__new__(MegatronWorker)
    worker._rank = 0
    worker.config = worker_config
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = types.SimpleNamespace(bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"], pad_token_id=1)
    worker._init_hf_config_and_tf_config(str(model_dir), tok, torch.bfloat16, {}, {}, False)
    from verl.models.mcore.registry import init_mcore_model

    tf, hf = worker.tf_config, worker.hf_config
    model = init_mcore_model(tf, hf, pre_process=True, post_process=True)
    classes = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()})
    dummies = [n for n, m in model.named_modules() if type(m) is torch.nn.Module]
    from megatron.core.transformer.module import Float16Module
    from megatron.training import get_args

    wrapped = Float16Module(tf, model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (1, 16), generator=g)
    mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
    out = wrapped(input_ids=ids, position_ids=torch.arange(16).unsqueeze(0), attention_mask=mask)
    out.float().logsumexp(-1).mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    print("RESULT " + json.dumps({
        "classes": classes, "dummies": dummies, "shape": list(out.shape), "finite": bool(torch.isfinite(out).all()),
        "no_grad": no_grad, "params": {n: list(p.shape) for n, p in model.named_parameters()},
        "torch_npu": npu_rehearsal.describe(), "applied": applied,
        "seq_length": get_args().seq_length, "spec": list(get_args().spec),
    }))


if __name__ == "__main__":
    main()
