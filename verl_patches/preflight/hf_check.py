"""End-to-end check on rank 0: rebuild full models from the rollout shards and from the
training shards, load them into transformers' DeepseekV3 (TP 1 view), compare logits.

This catches what per-shard equality cannot: a naming or layout convention that is
self-consistent but does not make a working model (e.g. swapped gate/up halves).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_patches.preflight.values import box_values
from verl_patches.reshard.box import full_box
from verl_patches.reshard.deepseek_v3_names import hf_expert_names, is_expert_stack
from verl_patches.reshard.placements import Placements


class LogitCheckError(AssertionError):
    """The models built from the shards do not give the reference model's logits."""


def assemble(placements: Placements, side: str, storages: dict[int, dict[str, torch.Tensor]],
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Full logical tensors from per-rank storages (``side``: "train" or "rollout")."""
    out: dict[str, torch.Tensor] = {}
    for t in placements.tensors:
        full = torch.empty(t.shape, dtype=dtype)
        covered = torch.zeros(t.shape, dtype=torch.bool)
        for part in (t.train if side == "train" else t.rollout):
            src = next((r for r in part.ranks if r in storages), None)
            if src is None:
                continue
            sl = tuple(slice(a, b) for a, b in part.box)
            full[sl] = part.slot.view(storages[src][part.slot.name])
            covered[sl] = True
        if not bool(covered.all()):
            raise LogitCheckError(f"{side} shards do not cover {t.name} (shape {list(t.shape)})")
        out[t.name] = full
    return out


def reference(placements: Placements, *, seed: int, step: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {t.name: box_values(t.name, t.shape, full_box(t.shape), seed=seed, step=step, dtype=dtype)
            for t in placements.tensors}


def to_hf(placements: Placements, logical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    E = placements.model.n_routed_experts
    out = {}
    for name, v in logical.items():
        if is_expert_stack(name):
            for i, hf in enumerate(hf_expert_names(name, E)):
                out[hf] = v[i]
        else:
            out[name] = v
    return out


def check_logits(hf_config: dict[str, Any], placements: Placements, variants: dict[str, dict[str, torch.Tensor]],
                 *, seed: int = 0, seq_len: int = 16) -> dict[str, Any]:
    """Load each variant (HF state dicts) into one DeepseekV3ForCausalLM and compare logits with
    the first variant's. Every model parameter must come from the shards."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = {k: v for k, v in hf_config.items() if k not in ("architectures", "transformers_version", "torch_dtype")}
    config = DeepseekV3Config(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    params = dict(model.named_parameters())
    ids = torch.randint(0, config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed))
    logits: dict[str, torch.Tensor] = {}
    for label, state in variants.items():
        unknown = sorted(set(state) - set(model.state_dict()))
        if unknown:
            raise LogitCheckError(f"{label}: names unknown to transformers' DeepseekV3: {unknown[:5]}")
        uncovered = sorted(set(params) - set(state))
        if uncovered:
            raise LogitCheckError(f"{label}: model parameters not produced by the reshard: {uncovered[:5]}")
        model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
        with torch.no_grad():
            logits[label] = model(input_ids=ids).logits.clone()
    first, *rest = logits
    for label in rest:
        if not torch.equal(logits[label], logits[first]):
            err = (logits[label] - logits[first]).abs().max().item()
            raise LogitCheckError(f"logits of the model built from {label} differ from {first} (max abs {err:.3g})")
    return {"compared": list(logits), "logits_shape": list(logits[first].shape),
            "parameters": len(params), "max_abs_logit": float(logits[first].abs().max())}
