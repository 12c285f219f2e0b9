"""Fixed (forced balanced) expert routing for the random-init benchmark run: every expert gets the same
number of tokens, in training and in the rollout, so throughput does not depend on a random router.

Switched by ``actor_rollout_ref.rollout.recipe.fixed_routing`` (off by default). The worker binding
calls :func:`configure` from the YAML before any model is built; the router patches read
:func:`enabled` on every call. The state is exported as VERL_PATCHES_FIXED_ROUTING so processes the
worker starts (a vLLM engine core) see the same choice. Framework-free: plain torch.
"""

from __future__ import annotations

import os

import torch

from verl_patches.base import env
from verl_patches.config import settings

ENV = "VERL_PATCHES_FIXED_ROUTING"
FLAG = "actor_rollout_ref.rollout.recipe.fixed_routing"


class FixedRoutingError(ValueError):
    """Fixed routing asked for where it cannot be honoured; the message names the fix."""


def configure(on: bool) -> None:
    if not isinstance(on, bool):
        raise FixedRoutingError(f"{FLAG} must be true or false, got {on!r}")
    os.environ[ENV] = "1" if on else "0"


def configure_from_worker_config(worker_config) -> bool:
    """Set the switch from a worker's config (actor_rollout_ref: the key sits at rollout.recipe.fixed_routing)."""
    try:
        configure(settings.from_worker(worker_config).fixed_routing)
    except settings.SettingsError as e:
        raise FixedRoutingError(str(e)) from None
    return enabled()


def enabled() -> bool:
    return bool(env.get(ENV))


def balanced_expert_ids(num_tokens: int, top_k: int, num_experts: int, device=None,
                        dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[num_tokens, top_k] expert ids: token i takes experts (i * top_k + j) mod num_experts.

    The top_k experts of a token are distinct, and over any num_experts / gcd(top_k, num_experts)
    consecutive tokens every expert is taken equally often; when num_tokens * top_k is a multiple of
    num_experts each expert gets exactly num_tokens * top_k / num_experts tokens. Built from arange
    only (no host sync, no randomness), so it is the same on every rank and inside captured graphs.
    """
    if not 1 <= top_k <= num_experts:
        raise FixedRoutingError(f"fixed routing needs 1 <= top_k <= num_experts, got top_k={top_k}, "
                                f"num_experts={num_experts}")
    rows = torch.arange(num_tokens, device=device, dtype=torch.int64).unsqueeze(1) * top_k
    cols = torch.arange(top_k, device=device, dtype=torch.int64).unsqueeze(0)
    return ((rows + cols) % num_experts).to(dtype)


def routing_map_and_probs(logits: torch.Tensor, top_k: int, score_function: str,
                          scaling_factor: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's router outputs for the balanced assignment: (probs, routing_map), both
    [tokens, experts], probs zero off the map. The kept scores are the router's own for the chosen
    experts (sigmoid renormalised over the top-k, or softmax over them), so the router weight still
    receives a gradient through the expert outputs."""
    tokens, experts = logits.shape
    ids = balanced_expert_ids(tokens, top_k, experts, device=logits.device)
    chosen = logits.float().gather(1, ids)
    if score_function == "sigmoid":
        weights = torch.sigmoid(chosen)
        if top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    elif score_function == "softmax":
        weights = torch.softmax(chosen, dim=-1)
    else:
        raise FixedRoutingError(f"fixed routing: unknown router score function {score_function!r}")
    if scaling_factor:
        weights = weights * scaling_factor
    probs = torch.zeros(tokens, experts, dtype=logits.dtype, device=logits.device)
    probs = probs.scatter(1, ids, weights.to(logits.dtype))
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=logits.device).scatter(1, ids, True)
    return probs, routing_map
