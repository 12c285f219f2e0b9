"""The rollout's settings: the recipe section read once, as the run's RecipeSettings
(verl_patches/config/settings.py, where every key, its type, default and rules are declared), the vLLM DP
domain derived from it and the world, and the verl rollout keys the recipe's engine checks.

Works on any mapping with ``get`` (OmegaConf DictConfig or dict), so the patch runs whatever the
YAML holds: a plain verl config gets the recipe's behaviour, the recipe's YAML can turn it off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from verl_patches.config import settings
from verl_patches.rollout.dp_domain import DPDomainError, DPSpec

RECIPE_KEY = settings.SECTION_IN_ROLLOUT  # actor_rollout_ref.rollout.recipe (configs/README.md)
# The stash key under which the rollout's LLM carries its RolloutSettings, for the sharding manager
# and the generation (verl_patches/core/stash.py).
STASH_KEY = "rollout_settings"
SECTION = settings.SECTION


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = settings.lookup(cfg, key)
    return default if value is None else value


@dataclass(frozen=True)
class RolloutSettings:
    """What the rollout runs with: the recipe section (``recipe``, the run's RecipeSettings: every
    recipe key is read from there, nothing is restated here), the DP domain derived from it and the
    world, and the two verl rollout keys the recipe's engine checks."""

    recipe: settings.RecipeSettings
    dp: DPSpec
    max_num_batched_tokens: int
    enable_chunked_prefill: bool

    @classmethod
    def from_config(cls, config: Mapping, world_size: int) -> "RolloutSettings":
        recipe = settings.build(_get(config, RECIPE_KEY, {}), f"rollout.{RECIPE_KEY}")
        vdp = recipe.vllm_dp
        tp = settings.check_type(int, _get(config, "tensor_model_parallel_size", 1), "rollout.tensor_model_parallel_size")
        if tp < 1 or world_size % (tp * vdp.instances):
            raise DPDomainError(f"rollout world of {world_size} ranks is not divisible by rollout TP{tp} x "
                                f"{vdp.instances} instance(s) (rollout.{RECIPE_KEY}.vllm_dp.instances)")
        # One DP group over every rank of an instance is the recipe's layout (EP = DP x TP).
        dp_size = world_size // (tp * vdp.instances) if vdp.dp_size is None else vdp.dp_size
        spec = DPSpec(tp_size=tp, dp_size=dp_size, instances=vdp.instances, master_port_base=vdp.master_port_base,
                      port_stride=vdp.port_stride)
        tokens = settings.check_type(int, _get(config, "max_num_batched_tokens", 8192), "rollout.max_num_batched_tokens")
        if tokens < 1:
            raise ValueError(f"rollout.max_num_batched_tokens must be positive, got {tokens}")
        chunked = settings.check_type(bool, _get(config, "enable_chunked_prefill", True), "rollout.enable_chunked_prefill")
        return cls(recipe=recipe, dp=spec, max_num_batched_tokens=tokens, enable_chunked_prefill=chunked)

    @property
    def num_layer_list(self) -> tuple[int, ...]:
        """recipe.megatron.num_layer_list (() = even split)."""
        return self.recipe.megatron.num_layer_list or ()

    def check_batched_tokens(self, max_model_len: int) -> None:
        """Chunked prefill splits long prompts, so a budget below max_model_len is fine with it
        (the recipe runs 1024 against 4096: 8192 runs out of memory); without it vLLM cannot
        schedule a full-length prompt."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(f"rollout.max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len "
                             f"{max_model_len} needs rollout.enable_chunked_prefill=True")
