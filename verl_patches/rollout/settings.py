"""The recipe's rollout settings read from verl's rollout config, with the recipe's values as defaults.

Works on any mapping with ``get`` (OmegaConf DictConfig or dict), so the patch runs whatever the
YAML holds: a plain verl config gets the recipe's behaviour, the recipe's YAML can turn it off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from verl_patches.config import settings
from verl_patches.core import stash
from verl_patches.reshard import METHODS
from verl_patches.rollout.dp_domain import DEFAULT_MASTER_PORT_BASE, DEFAULT_PORT_STRIDE, DPDomainError, DPSpec

RECIPE_KEY = settings.SECTION_IN_ROLLOUT  # actor_rollout_ref.rollout.recipe (configs/README.md)
# The rollout's LLM carries its settings under this attribute, for the sharding manager.
ENGINE_ATTR = stash.attr("rollout_settings")
RESHARD_METHODS = METHODS  # verl_patches.reshard (its __init__): the one list
SECTION = settings.SECTION


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = settings.lookup(cfg, key)
    return default if value is None else value


def _bool(value: Any, name: str) -> bool:
    return settings.check_type(bool, value, f"rollout.{name}")


def _int(value: Any, name: str) -> int:
    return settings.check_type(int, value, name)


@dataclass(frozen=True)
class RolloutSettings:
    offload: bool  # recipe offload/onload instead of vLLM sleep mode (sleep mode off)
    dp_sync_on_device: bool
    dp: DPSpec
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    reshard_method: str = settings.KEYS["reshard_method"].default
    num_layer_list: tuple[int, ...] = ()  # recipe.megatron.num_layer_list (() = even split)
    fingerprint_every: int = settings.KEYS["fingerprint_every"].default  # 0: the weight fingerprint is off

    @classmethod
    def from_config(cls, config: Mapping, world_size: int) -> "RolloutSettings":
        recipe = _get(config, RECIPE_KEY, {})
        problems = settings.problems(recipe, f"rollout.{RECIPE_KEY}")
        if problems:
            raise ValueError("; ".join(problems))
        vdp = _get(recipe, "vllm_dp", {})
        tp = _int(_get(config, "tensor_model_parallel_size", 1), "rollout.tensor_model_parallel_size")
        instances = int(_get(vdp, "instances", 1))
        if tp < 1 or instances < 1 or world_size % (tp * instances):
            raise DPDomainError(f"rollout world of {world_size} ranks is not divisible by rollout TP{tp} x "
                                f"{instances} instance(s) (rollout.{RECIPE_KEY}.vllm_dp.instances)")
        dp_raw = _get(vdp, "dp_size", None)
        # One DP group over every rank of an instance is the recipe's layout (EP = DP x TP).
        dp_size = world_size // (tp * instances) if dp_raw in (None, "???") else int(dp_raw)
        spec = DPSpec(tp_size=tp, dp_size=dp_size, instances=instances,
                      master_port_base=int(_get(vdp, "master_port_base", DEFAULT_MASTER_PORT_BASE)),
                      port_stride=int(_get(vdp, "port_stride", DEFAULT_PORT_STRIDE)))
        tokens = _int(_get(config, "max_num_batched_tokens", 8192), "rollout.max_num_batched_tokens")
        if tokens < 1:
            raise ValueError(f"rollout.max_num_batched_tokens must be positive, got {tokens}")
        method = settings.read(recipe, "reshard_method")
        from verl_patches.config.megatron_args import parse as parse_megatron

        section = _get(recipe, "megatron", None)
        layers = parse_megatron(dict(section) if section is not None else None).num_layer_list or ()
        return cls(offload=settings.read(recipe, "offload"),
                   reshard_method=method, num_layer_list=layers,
                   fingerprint_every=settings.read(recipe, "fingerprint_every"),
                   dp_sync_on_device=settings.read(recipe, "dp_sync_on_device"),
                   dp=spec, max_num_batched_tokens=tokens,
                   enable_chunked_prefill=_bool(_get(config, "enable_chunked_prefill", True), "enable_chunked_prefill"))

    def check_batched_tokens(self, max_model_len: int) -> None:
        """Chunked prefill splits long prompts, so a budget below max_model_len is fine with it
        (the recipe runs 1024 against 4096: 8192 runs out of memory); without it vLLM cannot
        schedule a full-length prompt."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(f"rollout.max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len "
                             f"{max_model_len} needs rollout.enable_chunked_prefill=True")
