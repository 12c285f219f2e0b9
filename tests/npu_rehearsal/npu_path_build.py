"""The NPU path on the NPU rehearsal platform, run as its own process (torch_npu's import renames torch's
PrivateUse1 backend and MindSpeed patches megatron-core in place: neither can be undone in a test process).

MindSpeed-LLM's adaptor (``import mindspeed_llm``) applies MindSpeed's and MindSpeed-LLM's features as on an
NPU, reading the command line built here from the tiny DeepSeek-V3's HF config; Megatron's global arguments
come from MindSpeed-LLM's parser (megatron.training's parse_args as MindSpeed-LLM patches it); verl 0.4.1's
initializer (registry.init_mcore_model -> DeepseekV3Model) builds the model with MindSpeed-LLM's DeepSeek
layer spec (mindspeed_llm/tasks/models/spec/deepseek_spec.py), the reference recipe's route. One forward and
backward in bf16 (megatron's Float16Module, as verl's get_model wraps it) on a gloo world of 1 ("hccl" mapped).
Prints one JSON line: the module classes, the dummy modules, the output, parameters without a gradient.
``DROP_OPERATOR=<name>`` removes that operator from the stand-in's table first (the test that the path fails
naming it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def megatron_argv(cfg: dict) -> list[str]:
    """MindSpeed-LLM / Megatron flags for the HF config (the model's shape; bf16; the local dispatcher)."""
    flags = {
        "num-layers": cfg["num_hidden_layers"], "hidden-size": cfg["hidden_size"],
        "ffn-hidden-size": cfg["intermediate_size"], "num-attention-heads": cfg["num_attention_heads"],
        "seq-length": 64, "max-position-embeddings": cfg["max_position_embeddings"], "micro-batch-size": 1,
        "vocab-size": cfg["vocab_size"], "make-vocab-size-divisible-by": 1, "padded-vocab-size": cfg["vocab_size"],
        "q-lora-rank": cfg["q_lora_rank"], "kv-lora-rank": cfg["kv_lora_rank"],
        "qk-rope-head-dim": cfg["qk_rope_head_dim"], "qk-nope-head-dim": cfg["qk_nope_head_dim"],
        "v-head-dim": cfg["v_head_dim"], "num-experts": cfg["n_routed_experts"],
        "moe-router-topk": cfg["num_experts_per_tok"], "moe-ffn-hidden-size": cfg["moe_intermediate_size"],
        "n-shared-experts": cfg["n_shared_experts"], "first-k-dense-replace": cfg["first_k_dense_replace"],
        "moe-layer-freq": 1, "moe-router-score-function": cfg["scoring_func"],
        "moe-token-dispatcher-type": "alltoall", "normalization": "RMSNorm", "norm-epsilon": cfg["rms_norm_eps"],
        "position-embedding-type": "rope", "rotary-base": cfg["rope_theta"], "tokenizer-type": "NullTokenizer",
        "transformer-impl": "local",
    }
    switches = ("use-mcore-models", "multi-latent-attention", "qk-layernorm", "moe-grouped-gemm",
                "moe-router-enable-expert-bias", "swiglu", "disable-bias-linear", "untie-embeddings-and-output-weights",
                "bf16", "use-cpu-initialization", "no-gradient-accumulation-fusion", "attention-softmax-in-fp32",
                "no-masked-softmax-fusion")
    argv = [x for k, v in flags.items() for x in (f"--{k}", str(v))] + [f"--{s}" for s in switches]
    return argv + ["--spec", "mindspeed_llm.tasks.models.spec.deepseek_spec", "layer_spec"]


def main() -> None:
    from verl_patches import npu_rehearsal

    npu_rehearsal.activate()
    npu_rehearsal.activate_mindspeed_kernels()
    drop = os.environ.get("DROP_OPERATOR")
    if drop:
        from verl_patches.npu_rehearsal import ops

        del ops.OPERATORS[drop]
    from verl_patches.core import apply
    from verl_patches.patches.mindspeed import patch_features_manager_features_manager as no_text_generation

    apply.apply_all(no_text_generation.PATCHES)  # before the adaptor runs (its docstring: why)
    cfg = json.loads((REPO / "configs/model/tiny_deepseek_v3.json").read_text())
    sys.argv = ["verl_worker", *megatron_argv(cfg)]
    import mindspeed_llm  # noqa: F401  (MindSpeed-LLM's adaptor: the features applied as on an NPU)
    import torch
    import torch.distributed as dist
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    args = parse_args()
    validate_args(args, {})
    set_global_variables(args, build_tokenizer=False)
    import tempfile

    store = tempfile.NamedTemporaryFile(prefix="npu_path_store_", delete=False).name
    dist.init_process_group("hccl", init_method=f"file://{store}", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    mpu.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(42)
    from transformers import AutoConfig
    from verl.models.mcore import model_initializer
    from verl.models.mcore.config_converter import hf_to_mcore_config_dpskv3
    from verl.models.mcore.registry import init_mcore_model

    def mindspeed_llm_layer_spec(self):  # the reference's spec (its route; a patch record binds it next)
        from mindspeed_llm.tasks.models.spec.deepseek_spec import layer_spec

        return layer_spec

    model_initializer.DeepseekV3Model.get_transformer_layer_spec = mindspeed_llm_layer_spec
    hf = AutoConfig.from_pretrained(REPO / "configs/model/tiny_deepseek_v3.json")
    tf = hf_to_mcore_config_dpskv3(hf, torch.bfloat16)
    model = init_mcore_model(tf, hf, pre_process=True, post_process=True)
    classes = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()})
    dummies = [n for n, m in model.named_modules() if type(m) is torch.nn.Module]
    from megatron.core.transformer.module import Float16Module

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
        "torch_npu": npu_rehearsal.describe(),
    }))


if __name__ == "__main__":
    main()
