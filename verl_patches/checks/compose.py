"""The recipe's Hydra config as verl's main_ppo composes it, and the model config.json a run reads: shared by the
config checker (verl_patches/checks/recipe_config.py) and the layer-spec report (verl_patches/checks/layer_spec.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from verl_patches.core.lock import REPO_ROOT

CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_MODEL_CONFIG = CONFIG_DIR / "model" / "deepseek_v3.json"


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = (), config_dir: Path = CONFIG_DIR):
    """The config verl's main_ppo would see for ``--config-path config_dir --config-name config_name``."""
    # Lazy: verl, Hydra and OmegaConf load when configs are composed (several seconds; --help runs without them).
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    # A previous compose in this process (tests) leaves Hydra initialised.
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def load_model_config(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model config not found: {path}")
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: model config is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: model config must be a JSON object, got {type(cfg).__name__}")
    need = ("num_hidden_layers", "first_k_dense_replace", "n_routed_experts")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"{path}: model config lacks {missing}")
    bad = [k for k in need if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < (k != "first_k_dense_replace")]
    if bad:
        raise ValueError(f"{path}: model config values {[(k, cfg[k]) for k in bad]} must be positive integers")
    return cfg


def find_model_config(cfg, explicit: Path | None = None) -> Path:
    """The model's config.json: explicit, else under actor_rollout_ref.model.path, else configs/model/."""
    if explicit:
        return Path(explicit)
    model_dir = Path(os.path.expanduser(str(cfg.actor_rollout_ref.model.path)))
    if (model_dir / "config.json").is_file():
        return model_dir / "config.json"
    return DEFAULT_MODEL_CONFIG
