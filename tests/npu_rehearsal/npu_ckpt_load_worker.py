"""The NPU model loads a checkpoint our converter wrote with spec mindspeed_llm: run as its own process on the NPU
rehearsal platform (as npu_path_worker.py, whose build it reuses), ``python npu_ckpt_load_worker.py HF_DIR CKPT``.

1. Names: every key of the model's sharded_state_dict (MindSpeed-LLM's DeepSeek spec, as verl's worker builds it)
   is in the checkpoint with the global shape the model asks for; which checkpoint tensors the model does not ask for.
2. Load: verl's load_mcore_dist_weights as the prelude leaves it (the recipe's, patch verl.model.load_hands_back:
   megatron's dist_checkpointing.load, then what it returns handed back) into the zeroed model; then every
   tensor of a fresh sharded_state_dict (factories applied) equals its piece of the checkpoint's global tensor.
3. Meaning: the loaded model's logits against transformers' DeepseekV3ForCausalLM of the HF directory (bf16, so a
   tolerance): a tensor under a wrong name or q / kv rows in the wrong order would not agree.

Prints one JSON line (RESULT ...).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(hf_dir: Path, ckpt: Path) -> None:
    sys.path.insert(0, str(HERE))
    from npu_path_worker import build_model

    import torch

    _, worker, model, cfg = build_model(hf_dir)
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    from verl_patches.tools.mcore_layout import DistCheckpointReader

    reader = DistCheckpointReader(ckpt)
    meta = reader.md.state_dict_metadata

    def flat(ssd):
        out = []
        for v in (ssd.values() if isinstance(ssd, dict) else ssd):
            out += flat(v) if isinstance(v, (dict, list)) else [v]
        return out

    ssd = model.sharded_state_dict()
    apply_factories(ssd)
    wanted, objects = {}, []
    for sh in flat(ssd):
        if isinstance(sh, ShardedTensor):
            wanted[sh.key] = tuple(sh.global_shape)
        elif isinstance(sh, ShardedObject):
            objects.append(sh.unique_key)
    have = set(reader.names())
    missing = sorted(k for k in wanted if k not in meta)
    shapes = sorted(f"{k}: model {wanted[k]}, checkpoint {tuple(meta[k].size)}" for k in wanted
                    if k in meta and hasattr(meta[k], "size") and tuple(meta[k].size) != wanted[k])
    unasked = sorted(have - set(wanted))
    missing_objects = sorted(k for k in objects if k not in meta)

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    from verl.utils.model import load_mcore_dist_weights

    load_error = None
    try:
        load_mcore_dist_weights([model], str(ckpt))
    except Exception as e:  # noqa: BLE001 - reported
        load_error = f"{type(e).__name__}: {str(e)[:3000]}"
    differ, checked = [], 0
    # Parameters the load left as zeroed. megatron's dist_checkpointing.load fills the tensors the sharded state
    # dict holds; a ShardedTensorFactory's (GroupedMLP's transposed expert weights) are copies built for the load,
    # merged into the returned state dict: verl's own loader dropped them (found here, 2026-11-28).
    unloaded = sorted(n for n, p in model.named_parameters() if not p.detach().any())
    if load_error is None:
        fresh = model.sharded_state_dict()
        apply_factories(fresh)
        for sh in flat(fresh):
            if not isinstance(sh, ShardedTensor) or sh.key not in meta:
                continue
            whole = reader.tensor(sh.key)
            # global_offset covers the prepended (expert) axes too; local_shape only the data's own.
            sizes = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            piece = whole[tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sizes))]
            data = sh.data  # a world of 1 with no distributed optimizer: nothing flattened
            checked += 1
            if not torch.equal(piece.reshape(data.shape).to(data.dtype), data.detach()):
                differ.append(sh.key)

    logits = {}
    if load_error is None:
        from megatron.core.transformer.module import Float16Module
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        g = torch.Generator().manual_seed(0)
        n = 16
        ids = torch.randint(0, cfg["vocab_size"], (1, n), generator=g)
        mask = torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool), diagonal=1)
        wrapped = Float16Module(worker.tf_config, model)
        wrapped.eval()
        with torch.no_grad():
            ours = wrapped(input_ids=ids, position_ids=torch.arange(n).unsqueeze(0), attention_mask=mask).float()
            hcfg = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")})
            ref_model = DeepseekV3ForCausalLM.from_pretrained(str(hf_dir), config=hcfg, torch_dtype=torch.bfloat16)
            ref_model.eval()
            ref = ref_model(input_ids=ids).logits.float()
            # A control: the same model with its fused down projection's q and kv row blocks in the other order
            # (the mistake the names must not make): how far that lands from the reference.
            q_rows = cfg["q_lora_rank"] or cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
            for name, p in model.named_parameters():
                if name.endswith("self_attention.linear_qkv.weight"):
                    p.copy_(torch.roll(p, shifts=p.shape[0] - q_rows, dims=0))  # [kv_a rows; q rows]
            wrong = wrapped(input_ids=ids, position_ids=torch.arange(n).unsqueeze(0), attention_mask=mask).float()

        def compare(x):
            return {"max_abs_diff": float((x - ref).abs().max()),
                    "argmax_agree": float((x.argmax(-1) == ref.argmax(-1)).float().mean()),
                    "cosine": float(torch.nn.functional.cosine_similarity(x.flatten(), ref.flatten(), dim=0))}

        logits = {"ref_max_abs": float(ref.abs().max()), "loaded": compare(ours), "rows_swapped": compare(wrong)}

    print("RESULT " + json.dumps({
        "wanted": len(wanted), "missing": missing, "shapes": shapes, "unasked": unasked,
        "objects": len(objects), "missing_objects": missing_objects, "load_error": load_error,
        "checked": checked, "differ": differ, "unloaded": unloaded, "logits": logits,
        "params": {k: list(p.shape) for k, p in model.named_parameters() if ".layers.1." in k or ".layers." not in k},
    }))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
