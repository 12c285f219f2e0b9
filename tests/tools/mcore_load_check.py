"""Load a converted checkpoint into a real megatron-core 0.12 GPTModel (MLA + MoE, local spec) on CPU; print a JSON verdict.

Run as a script in its own process (it initialises torch.distributed). Fakes, only where CPU cannot run the real thing:
torch.cuda.current_device/synchronize return CPU answers, and the parameter-free core attention is a stub (the local
DotProductAttention in 0.12.1 does not accept MLA's arguments); every module holding weights is megatron's own.
"""

import json
import os
import sys
from pathlib import Path

import torch


def build_model(cfg: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    n = cfg["num_hidden_layers"]
    tc = MLATransformerConfig(
        num_layers=n, hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"], moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        q_lora_rank=cfg["q_lora_rank"], kv_lora_rank=cfg["kv_lora_rank"], qk_head_dim=cfg["qk_nope_head_dim"],
        qk_pos_emb_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
        num_moe_experts=cfg["n_routed_experts"],
        moe_layer_freq=[0 if i < cfg["first_k_dense_replace"] else 1 for i in range(n)],
        moe_shared_expert_intermediate_size=cfg["moe_intermediate_size"] * cfg["n_shared_experts"],
        moe_router_topk=cfg["num_experts_per_tok"], moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True, rope_type="rope", qk_layernorm=True,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False)

    class CoreAttentionStub(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = CoreAttentionStub
    return GPTModel(tc, spec, vocab_size=cfg["vocab_size"], max_sequence_length=64, position_embedding_type="rope",
                    share_embeddings_and_output_weights=cfg.get("tie_word_embeddings", False))


def main(ckpt: str, hf: str) -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[3] if len(sys.argv) > 3 else "29517")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import StrictHandling

    ps.initialize_model_parallel(1, 1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from verl_patches.tools.hf_to_mcore import HFSource, build, load_hf_index, unit_plan, units

    cfg, weight_map = load_hf_index(Path(hf))
    model = build_model(cfg)
    for p in model.parameters():
        p.data.zero_()
    # What verl's load_mcore_dist_weights does.
    dist_checkpointing.load(model.sharded_state_dict(), ckpt, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    sd = model.state_dict()
    # Megatron's SequentialMLP holds experts as local_experts.<i>; our names use the checkpoint's expert axis.
    from contextlib import ExitStack

    src = HFSource(Path(hf), weight_map)
    checked, bad, covered = 0, [], set()
    for unit in units(cfg):
        with ExitStack() as stack:
            plan = unit_plan(cfg, unit, "local")
            get = src.open([s for _, srcs, _ in plan for s in srcs], stack)
            for name, srcs, how in plan:
                want = build(how, srcs, get)
                if ".experts.experts." in name:
                    base, leaf = name.split(".experts.experts.")
                    keys = [f"{base}.experts.local_experts.{x}.{leaf}" for x in range(want.shape[0])]
                    got = torch.stack([sd[k] for k in keys])
                    covered.update(keys)
                else:
                    got = sd[name]
                    covered.add(name)
                checked += 1
                if not torch.equal(got.to(want.dtype), want):
                    bad.append(name)
    params = {k for k, v in sd.items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    print(json.dumps({"checked": checked, "bad": bad, "model_tensors": len(params),
                      "not_covered": sorted(params - covered)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
