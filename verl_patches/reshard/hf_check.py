"""End-to-end check on rank 0: rebuild full models from the rollout shards and from the
training shards, load them into transformers' DeepseekV3 (TP 1 view), compare logits.

This catches what per-shard equality cannot: a naming or layout convention that is
self-consistent but does not make a working model (e.g. swapped gate/up halves).

The shards are named as the lock's transformers (configs/upstream.lock.toml) names DeepSeek-V3's
checkpoint, one tensor per expert. Where the installed transformers' model names its parameters
otherwise (releases from 5.0 store each layer's experts as stacked tensors and convert per-expert
checkpoints while loading), the state goes through that release's own loader (a safetensors
checkpoint in a temporary folder, ``from_pretrained``), so the check still compares logits; a release
whose loader leaves a name unknown or a parameter unset is refused, naming the installed and the
locked version.
"""

from __future__ import annotations

import inspect
import tempfile
from typing import Any

import torch

from verl_patches.core.lock import load_lock
from verl_patches.reshard.values import box_values
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


def versions() -> tuple[str, str]:
    """(installed transformers version, the lock's version)."""
    # Lazy: transformers (slow to import) and safetensors only for the HF logits check.
    import transformers

    try:
        locked = load_lock()["transformers"].version or "?"
    except Exception:  # noqa: BLE001 - a lock that cannot be read still leaves the installed version to name
        locked = "? (configs/upstream.lock.toml unreadable)"
    return transformers.__version__, locked


def _refuse(label: str, unknown: int, unset: int, mismatched: int) -> LogitCheckError:
    installed, locked = versions()
    return LogitCheckError(
        f"{label}: the installed transformers {installed} does not load DeepSeek-V3's checkpoint names as the "
        f"locked transformers {locked} does ({unknown} name(s) unknown to its DeepseekV3 after its own checkpoint "
        f"conversion, {unset} parameter(s) left unset, {mismatched} of another shape); the logit check needs "
        f"transformers {locked} (pip install transformers=={locked}) or a release whose loader converts them")


def _load_converted(config: Any, state: dict[str, torch.Tensor], label: str) -> torch.nn.Module:
    """The model built by the installed transformers' own loader from ``state`` saved as a checkpoint
    (its checkpoint-name conversion applies); refuses when that loader leaves anything over or unset."""
    # Lazy: transformers (slow to import) and safetensors only for the HF logits check.
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    with tempfile.TemporaryDirectory(prefix="logit_check_") as tmp:
        config.save_pretrained(tmp)
        save_file({k: v.to(torch.float32).contiguous() for k, v in state.items()}, f"{tmp}/model.safetensors",
                  metadata={"format": "pt"})
        params = inspect.signature(DeepseekV3ForCausalLM.from_pretrained).parameters
        kw = {"dtype": torch.float32} if "dtype" in params else {"torch_dtype": torch.float32}
        try:
            model, info = DeepseekV3ForCausalLM.from_pretrained(tmp, attn_implementation="eager",
                                                                output_loading_info=True, **kw)
        except Exception as e:  # noqa: BLE001 - the loader's own error, with the versions named
            installed, locked = versions()
            raise LogitCheckError(f"{label}: the installed transformers {installed} could not load DeepSeek-V3's "
                                  f"checkpoint names (the lock pins {locked}): {type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
    unknown, unset = len(info.get("unexpected_keys") or ()), len(info.get("missing_keys") or ())
    mismatched = len(info.get("mismatched_keys") or ())
    if unknown or unset or mismatched:
        raise _refuse(label, unknown, unset, mismatched)
    return model.to(torch.float32).eval()


def check_logits(hf_config: dict[str, Any], placements: Placements, variants: dict[str, dict[str, torch.Tensor]],
                 *, seed: int = 0, seq_len: int = 16, via_checkpoint: bool = False) -> dict[str, Any]:
    """Load each variant (HF state dicts) into one DeepseekV3ForCausalLM and compare logits with
    the first variant's. Every model parameter must come from the shards. Where the installed
    transformers' model does not take the variants' names (or ``via_checkpoint``), every variant goes
    through its checkpoint loader instead (``_load_converted``)."""
    # Lazy: transformers (slow to import) and safetensors only for the HF logits check.
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = {k: v for k, v in hf_config.items() if k not in ("architectures", "transformers_version", "torch_dtype")}
    config = DeepseekV3Config(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    params = dict(model.named_parameters())
    ids = torch.randint(0, config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed))
    logits: dict[str, torch.Tensor] = {}
    known = set(model.state_dict())
    # Decided once for every variant, so that all of them are loaded the same way and compared alike:
    # where the installed release names any of them otherwise, its own loader converts them all.
    converted = via_checkpoint or any(not set(state) <= known for state in variants.values())
    for label, state in variants.items():
        if converted:
            with torch.no_grad():
                logits[label] = _load_converted(config, state, label)(input_ids=ids).logits.clone()
            continue
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
    # Lazy: transformers (slow to import) and safetensors only for the HF logits check.
    import transformers

    return {"compared": list(logits), "logits_shape": list(logits[first].shape),
            "parameters": len(params), "max_abs_logit": float(logits[first].abs().max()),
            "transformers": transformers.__version__, "loaded_via_checkpoint": converted}
