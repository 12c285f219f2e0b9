"""STAND-IN for ``torch_npu.utils.collect_env`` (NPU rehearsal platform).

``get_cann_version()`` answers the CANN release the lock pins (configs/upstream.lock.toml, [components.cann]
ref): MindSpeed picks code paths by it (mindspeed/core/transformer/moe/moe_feature/overlap/token_dispatcher.py),
and the rehearsal takes the paths of the CANN the recipe runs on. There is no CANN on the host.
"""

from __future__ import annotations

from verl_patches.rigs import npu_rehearsal as _platform
from verl_patches.core.lock import load_lock


def get_cann_version() -> str:
    return str(load_lock()["cann"].ref)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise _platform.missing_operator(f"torch_npu.utils.collect_env.{name}")
