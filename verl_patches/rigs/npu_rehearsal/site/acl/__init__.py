"""STAND-IN for ``acl`` (CANN's Python runtime binding, pyACL), NPU rehearsal platform only.

MindSpeed-LLM imports it at module level (mindspeed_llm/training/utils.py) and asks only for the SoC name, to
choose between the Atlas A2 (``910B``) and A3 code paths. The rehearsal answers with an Atlas A3 SoC name,
the recipe's target (docs/RECIPE.md: Atlas A3 cluster); it is a name, not a device. Every other name raises.
"""

from __future__ import annotations

from verl_patches.rigs import npu_rehearsal as _platform

if not _platform.selected():
    raise ImportError(f"this acl is the NPU rehearsal platform's STAND-IN ({__file__}); it is used only with "
                      f"{_platform.ENV}={_platform.PLATFORM}")

STAND_IN = True
SOC_NAME = "Ascend910_9391"  # an Atlas A3 SoC name (the recipe's target), answered by name only


def get_soc_name() -> str:
    return SOC_NAME


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"acl.{name} is not implemented by the acl stand-in of the NPU rehearsal platform "
                         f"({_platform.ENV}={_platform.PLATFORM}); only get_soc_name() is")
