"""The recipe's own settings: every key of ``actor_rollout_ref.rollout.recipe`` with its type and its
default, written once, and one reader that every patch, the launchers' checks and the config
composition use. Booleans are read one way: a real true/false, anything else is an error naming
the key (a quoted "false" in YAML is a string, and truthy).

Three things are called "recipe" in this repository; they are different:
- the *recipe section*: this YAML section (``actor_rollout_ref.rollout.recipe``), read here;
- the *run configs*: the YAML files under configs/ that compose a run (verl_patches/recipe_config.py);
- the *recipe reshard method* (``reshard_method: recipe``): the published recipe's reference reshard,
  kept for comparison (verl_patches/reshard/methods.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_patches.reshard.methods import METHODS

SECTION = "actor_rollout_ref.rollout.recipe"  # in the trainer's config
SECTION_IN_WORKER = "rollout.recipe"  # in a worker's config (verl gives it actor_rollout_ref)
SECTION_IN_ROLLOUT = "recipe"  # in the rollout's config


class SettingsError(ValueError):
    """A recipe setting with the wrong type or an unknown name; the message names the key."""


@dataclass(frozen=True)
class Key:
    kind: Any  # bool, int, float, str, a tuple of allowed values, or "section" (checked elsewhere)
    default: Any
    doc: str
    minimum: Any = None  # numbers: the smallest value allowed


KEYS: dict[str, Key] = {
    "reshard_method": Key(METHODS, "direct", "how the trained weights reach vLLM (verl_patches/reshard/methods.py)"),
    "tensor_cache": Key(bool, True, "keep stage outputs on the workers; the driver sends row ids"),
    "dp_sync_on_device": Key(bool, True, "vLLM's DP all-reduces on the device group instead of gloo"),
    "offload": Key(bool, True, "the recipe's switch schedule instead of verl's offload and vLLM's sleep mode"),
    "rollout_torch_compile": Key(bool, True, "the real torch.compile for the rollout under MindSpeed"),
    "fixed_routing": Key(bool, False, "load-balanced expert routing (random-init benchmarks)"),
    "overlap_grad_reduce": Key(bool, False, "megatron-core's DDP launches each gradient bucket's reduce from the "
                                            "backward hooks (verl_patches/ddp_overlap.py); false: verl's DDP"),
    "overlap_param_gather": Key(bool, False, "megatron-core's DDP gathers the distributed optimizer's updated "
                                             "shards in the next forward's pre-hooks, finished when the update "
                                             "returns (verl_patches/ddp_overlap.py); false: in the optimizer step"),
    "vllm_dp": Key("section", None, "vLLM data parallelism: dp_size, instances, master_port_base, port_stride"),
    "megatron": Key("section", None, "Megatron / MindSpeed settings (verl_patches/megatron_args.py)"),
    "device_memory_gib": Key(float, None, "the device's memory, to check the memory estimate against"),
    "host_memory_gib": Key(float, None, "the host memory of one node, to check the host side of the memory estimate "
                                        "against (the optimizer on the host and the switch's pinned copies)"),
    "metrics_file": Key(str, None, "the run's JSONL record (verl_patches/report.py)"),
    "fingerprint_every": Key(int, 10, "check every N switches that each rollout parameter holds exactly what the "
                                     "training side sent (verl_patches/reshard/checksum.py); 0: never", minimum=0),
    "tensorboard_dir": Key(str, None, "where verl's tensorboard logger writes (its TENSORBOARD_DIR); null: verl's "
                                      "default, tensorboard_log/<project>/<experiment> under the driver's directory"),
    # The rollout's long-tail rebalance (docs/ROLLOUT.md): the policy (verl_patches/rollout/rebalance.py, also
    # read by the planner) and the mechanism (verl_patches/rollout/migrate.py), which only the CPU
    # generation stand-in runs yet: on vLLM's engine (NPU, GPU) the rollout refuses rebalance: True.
    "rebalance": Key(bool, False, "move unfinished requests between DP ranks so the DP group drops to a smaller "
                                  "captured graph bucket (the CPU generation stand-in only: vLLM's engine on a "
                                  "device does not implement the move yet and refuses it)"),
    "rebalance_min_bucket_drop": Key(int, 1, "rebalance only when it lowers the group's graph bucket by at least "
                                             "this many steps of graph_batch_sizes", minimum=1),
    "rebalance_max_imbalance": Key(float, None, "or, for a smaller drop, when the fullest DP rank holds more than "
                                                "this many times the mean; null: only the drop counts", minimum=1.0),
    "rebalance_cpu_stagger": Key(int, 0, "tests only, CPU generation stand-in: DP rank r admits its requests r x N "
                                         "decode steps late, forcing an uneven tail for rebalance to move (the "
                                         "outputs do not change); 0: off", minimum=0),
    "devices_per_card": Key(int, None, "devices (verl's GPUs: dies on Ascend) per card, for perf/tps_per_card; "
                                       "null: by trainer.device (npu 2, cuda 1; the CPU platform 1)"),
}


def check_value(key: str, value: Any, where: str = SECTION) -> Any:
    """``value`` for ``key`` if it has the key's type; else SettingsError naming ``where.key``."""
    if key not in KEYS:
        raise SettingsError(f"{where}.{key}: unknown key (known: {', '.join(sorted(KEYS))})")
    kind = KEYS[key].kind
    if value is None or kind == "section":
        return value
    if kind is bool:
        if not isinstance(value, bool):
            hint = " (write true or false without quotes)" if isinstance(value, str) else ""
            raise SettingsError(f"{where}.{key} must be true or false, got {value!r}{hint}")
    elif isinstance(kind, tuple):
        if value not in kind:
            raise SettingsError(f"{where}.{key} must be one of {list(kind)}, got {value!r}")
    elif kind is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SettingsError(f"{where}.{key} must be a number, got {value!r}")
    elif not isinstance(value, kind) or isinstance(value, bool):
        raise SettingsError(f"{where}.{key} must be {kind.__name__}, got {value!r}")
    minimum = KEYS[key].minimum
    if minimum is not None and value < minimum:
        raise SettingsError(f"{where}.{key} must be at least {minimum}, got {value!r}")
    return value


def _lookup(node: Any, path: str) -> Any:
    for part in path.split("."):
        if node is None:
            return None
        try:
            node = node.get(part, None) if hasattr(node, "get") else getattr(node, part, None)
        except Exception as e:  # noqa: BLE001 - OmegaConf's MissingMandatoryValue ('???') without importing it
            if type(e).__name__ != "MissingMandatoryValue":
                raise
            return None
    return None if node == "???" else node


def plain(node: Any) -> Any:
    """An OmegaConf node as plain dicts and lists ('???' kept as is); anything else unchanged."""
    if type(node).__name__ in ("DictConfig", "ListConfig"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
    return node


def read(section: Any, key: str, where: str = SECTION) -> Any:
    """``key`` of the recipe section ``section`` (a DictConfig, a mapping or None), checked, or its default."""
    value = check_value(key, _lookup(section, key), where)
    return KEYS[key].default if value is None else value


def from_worker(worker_config: Any, key: str) -> Any:
    """``key`` read from a worker's config (verl's actor_rollout_ref section)."""
    return read(_lookup(worker_config, SECTION_IN_WORKER), key)


def from_trainer(config: Any, key: str) -> Any:
    """``key`` read from the trainer's whole config."""
    return read(_lookup(config, SECTION), key)


def from_rollout(rollout_config: Any, key: str) -> Any:
    """``key`` read from the rollout's config (actor_rollout_ref.rollout)."""
    return read(_lookup(rollout_config, SECTION_IN_ROLLOUT), key, where=SECTION)
