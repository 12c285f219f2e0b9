"""Which process we are in: the driver (verl's single controller), a worker, or an engine core.

``VERL_PATCHES_PHASE`` overrides the detection (e.g. for a process started by hand).
"""

from __future__ import annotations

import multiprocessing
import os

from verl_patches.core.record import PHASES
from verl_patches.base import env


def current_phase() -> str:
    forced = env.get("VERL_PATCHES_PHASE")
    if forced:
        assert forced in PHASES, forced  # env's table lists PHASES (tests/test_env.py checks they agree)
        return forced
    # vLLM v1 names the process it starts for the engine core "EngineCore_<n>".
    if multiprocessing.current_process().name.startswith("EngineCore"):
        return "engine_core"
    # verl's RayWorkerGroup starts every worker actor with WG_BACKEND=ray in its env
    # (single_controller/ray/base.py). The single controller, which in verl 0.4.1 runs
    # inside the TaskRunner actor, is also a Ray worker process but has no such variable.
    if os.environ.get("WG_BACKEND") == "ray":
        return "worker"
    return "driver"
