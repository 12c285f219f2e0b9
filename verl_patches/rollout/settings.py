"""The recipe's rollout settings read from verl's rollout config, with the recipe's values as defaults.

Works on any mapping with ``get`` (OmegaConf DictConfig or dict), so the patch runs whatever the
YAML holds: a plain verl config gets the recipe's behaviour, the recipe's YAML can turn it off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from verl_patches import settings
from verl_patches.core import stash
from verl_patches.reshard.methods import METHODS
from verl_patches.rollout.dp_domain import DEFAULT_MASTER_PORT_BASE, DEFAULT_PORT_STRIDE, DPDomainError, DPSpec

RECIPE_KEY = "recipe"  # actor_rollout_ref.rollout.recipe (configs/README.md)
# The rollout's LLM carries its settings under this attribute, for the sharding manager.
ENGINE_ATTR = stash.attr("rollout_settings")
RESHARD_METHODS = METHODS  # verl_patches.reshard.methods: the one list


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    try:
        value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    except Exception as e:  # noqa: BLE001 - OmegaConf's MissingMandatoryValue for '???' without importing it
        if type(e).__name__ != "MissingMandatoryValue":
            raise
        return default
    return default if value is None else value


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"rollout.{name} must be true or false, got {value!r}")


def _int(value: Any, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"{name} must be an integer, got {value!r}")


# The recipe's own keys (configs/README.md): name -> a type, a tuple of allowed values, or a
# nested section. ``megatron`` is checked by verl_patches.megatron_args.parse.
SECTION = f"actor_rollout_ref.rollout.{RECIPE_KEY}"
# The types come from verl_patches/settings.py (each key and default written once); the sections
# are walked here.
RECIPE_SCHEMA: dict[str, Any] = {
    **{name: key.kind for name, key in settings.KEYS.items() if key.kind != "section"},
    "vllm_dp": {"dp_size": int, "instances": int, "master_port_base": int, "port_stride": int},
    "megatron": "megatron",
}
# Lower bounds of the integer keys (ports also have an upper one).
_INT_MIN = {"dp_size": 1, "instances": 1, "port_stride": 1, "master_port_base": 1}
# Lower bounds of the section's own numbers, from the settings table (written once).
_TOP_MIN = {name: key.minimum for name, key in settings.KEYS.items() if key.minimum is not None}


plain = settings.plain  # an OmegaConf node as plain containers (one implementation)


def _describe(value: Any) -> str:
    return f"the string {value!r}" if isinstance(value, str) else f"{value!r} ({type(value).__name__})"


def recipe_problems(section: Any, where: str = SECTION) -> list[str]:
    """Every unknown key (with a did-you-mean), wrong type and string boolean in the recipe's
    section, named by its full key path; [] when the section is well-formed. A '???' (a value
    the run config must set) is not judged here."""
    import difflib

    section = plain(section)
    if section is None:
        return []
    if not isinstance(section, Mapping):
        return [f"{where} must be a mapping of the recipe's keys, got {_describe(section)}"]
    problems: list[str] = []

    def walk(node: Mapping, schema: dict[str, Any], path: str) -> None:
        for key, value in node.items():
            here = f"{path}.{key}"
            rule = schema.get(key) if isinstance(key, str) else None
            if rule is None:
                close = difflib.get_close_matches(str(key), list(schema), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(schema))})"
                problems.append(f"{here}: unknown key{hint}")
                continue
            if value is None or value == "???":
                continue
            if rule == "megatron":
                from verl_patches.megatron_args import RecipeMegatronError, parse

                if not isinstance(value, Mapping):
                    problems.append(f"{here} must be a mapping, got {_describe(value)}")
                    continue
                try:
                    parse(value)
                except RecipeMegatronError as e:
                    problems.append(str(e))
            elif isinstance(rule, dict):
                if isinstance(value, Mapping):
                    walk(value, rule, here)
                else:
                    problems.append(f"{here} must be a mapping, got {_describe(value)}")
            elif isinstance(rule, tuple):
                if value not in rule:
                    problems.append(f"{here} must be one of {list(rule)}, got {_describe(value)}")
            elif rule is bool:
                if not isinstance(value, bool):
                    hint = " (write true or false without quotes)" if isinstance(value, str) else ""
                    problems.append(f"{here} must be true or false, got {_describe(value)}{hint}")
            elif rule is str:
                if not isinstance(value, str):
                    problems.append(f"{here} must be a string (a path), got {_describe(value)}")
            elif rule is float:
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                    problems.append(f"{here} must be a positive number, got {_describe(value)}")
                elif path == where and key in _TOP_MIN and value < _TOP_MIN[key]:
                    problems.append(f"{here} must be >= {_TOP_MIN[key]}, got {value}")
            elif rule is int:
                if not isinstance(value, int) or isinstance(value, bool):
                    problems.append(f"{here} must be an integer, got {_describe(value)}")
                elif value < (low := _TOP_MIN.get(key, 0) if path == where else _INT_MIN.get(key, 0)) \
                        or (key == "master_port_base" and value > 65535):
                    problems.append(f"{here} must be >= {low}"
                                    + (" and <= 65535" if key == "master_port_base" else "") + f", got {value}")

    walk(section, RECIPE_SCHEMA, where)
    return problems


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
        problems = recipe_problems(recipe, f"rollout.{RECIPE_KEY}")
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
        from verl_patches.megatron_args import parse as parse_megatron

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
