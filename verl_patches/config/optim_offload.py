"""The optimizer-offload settings of verl's ``actor.optim`` (megatron-core's HybridDeviceOptimizer): read,
checked and set on megatron-core's OptimizerConfig. The patch that hands them to the optimizer verl builds
(verl_patches/patches/verl/patch_utils_megatron_utils_switch.py) and the launch-time validator
(verl_patches/checks/recipe_config.py) both use these rules; they import nothing of upstream.
"""

from __future__ import annotations

from typing import Any

FLAG = "actor_rollout_ref.actor.optim.optimizer_cpu_offload"
KEYS = ("optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d")


class OptimizerOffloadError(ValueError):
    """The optimizer-on-host settings are malformed, or cannot combine with the rest of the run."""


def offload_settings(optim_config: Any) -> dict | None:
    """The optimizer-offload settings of verl's ``actor.optim`` (a mapping), checked; None when off.

    Returns ``{"fraction": float, "overlap": bool | None}``."""
    get = optim_config.get
    on = get("optimizer_cpu_offload", None)
    fraction = get("optimizer_offload_fraction", None)
    overlap = get("overlap_cpu_optimizer_d2h_h2d", None)
    if on is None or on is False:
        if fraction is not None or overlap is not None:
            raise OptimizerOffloadError(
                "actor.optim.optimizer_offload_fraction / overlap_cpu_optimizer_d2h_h2d are set but "
                "actor.optim.optimizer_cpu_offload is not true: set it to true, or drop them")
        return None
    if on is not True:
        raise OptimizerOffloadError(f"actor.optim.optimizer_cpu_offload must be true or false, got {on!r}"
                                    + (" (write it without quotes)" if isinstance(on, str) else ""))
    if fraction is None:
        fraction = 1.0
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < float(fraction) <= 1.0:
        raise OptimizerOffloadError(f"actor.optim.optimizer_offload_fraction must be a number in (0, 1] (the share "
                                    f"of the optimizer state on the host; 1.0: all of it), got {fraction!r}")
    if overlap is not None and not isinstance(overlap, bool):
        raise OptimizerOffloadError(f"actor.optim.overlap_cpu_optimizer_d2h_h2d must be true or false, got {overlap!r}")
    return {"fraction": float(fraction), "overlap": overlap}


def apply_offload(config: Any, settings: dict) -> Any:
    """Set the offload fields on megatron-core's OptimizerConfig ``config``."""
    if config.optimizer not in ("adam", "sgd"):
        raise OptimizerOffloadError(f"actor.optim.optimizer_cpu_offload=True needs optimizer adam or sgd "
                                    f"(megatron-core's HybridDeviceOptimizer), got {config.optimizer!r}")
    if not config.use_distributed_optimizer:
        raise OptimizerOffloadError("actor.optim.optimizer_cpu_offload=True needs megatron-core's distributed "
                                    "optimizer (use_distributed_optimizer=True, what verl builds)")
    config.optimizer_cpu_offload = True
    config.optimizer_offload_fraction = settings["fraction"]
    config.use_precision_aware_optimizer = True
    if settings["overlap"] is not None:
        config.overlap_cpu_optimizer_d2h_h2d = settings["overlap"]
    return config
