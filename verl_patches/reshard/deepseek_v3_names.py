"""DeepSeek-V3's parameter names where the reshard, the preflight and the checkpoint tools share
them: per-expert Megatron names by expert storage, HF per-expert names of a stacked expert tensor."""

from __future__ import annotations

from typing import Any

from verl_patches.reshard.layouts import EXPERT_STORAGES
from verl_patches.reshard.model import LayoutError


def _per_expert_names(prefix: str, storage: str) -> tuple[Any, Any]:
    """Megatron parameter names of local expert j's fc1 / fc2, or (None, None) for GroupedMLP."""
    if storage == "te_grouped":
        return (lambda j: f"{prefix}linear_fc1.weight{j}"), (lambda j: f"{prefix}linear_fc2.weight{j}")
    if storage == "sequential":
        return ((lambda j: f"{prefix}local_experts.{j}.linear_fc1.weight"),
                (lambda j: f"{prefix}local_experts.{j}.linear_fc2.weight"))
    if storage != "grouped":
        raise LayoutError(f"expert storage {storage!r}: expected one of {EXPERT_STORAGES}")
    return None, None


def hf_expert_names(name: str, num_experts: int) -> list[str]:
    """HF per-expert names of a stacked logical expert tensor (model.layers.L.mlp.experts.X.weight)."""
    prefix, _, tail = name.rpartition(".experts.")
    return [f"{prefix}.experts.{j}.{tail}" for j in range(num_experts)]


_EXPERT_STACKS = (".mlp.experts.gate_proj.weight", ".mlp.experts.up_proj.weight",
                  ".mlp.experts.down_proj.weight")


def is_expert_stack(name: str) -> bool:
    """Whether a logical name is a routed-expert stack (model.layers.L.mlp.experts.X.weight)."""
    return name.endswith(_EXPERT_STACKS)
