"""STAND-IN for torchair (Ascend's TorchDynamo backend to the GE graph engine), NPU rehearsal platform only.

MindSpeed's op builders import it at module level to register graph-mode converters
(mindspeed/op_builder/gmm_builder.py: ``register_fx_node_ge_converter`` and the ``ge`` names used in the
converters' annotations). The rehearsal never compiles a GE graph: converters are kept in CONVERTERS and never
run, and every GE operation raises naming itself.
"""

from __future__ import annotations

from typing import Any, Callable

from verl_patches.rigs import npu_rehearsal as _platform

if not _platform.selected():
    raise ImportError(f"this torchair is the NPU rehearsal platform's STAND-IN ({__file__}); it is used only with "
                      f"{_platform.ENV}={_platform.PLATFORM}")

__version__ = "rehearsal-stand-in"
STAND_IN = True
CONVERTERS: dict[Any, Callable[..., Any]] = {}


def register_fx_node_ge_converter(aten_op: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        CONVERTERS[aten_op] = fn  # graph mode only: never run on the rehearsal platform
        return fn

    return register


from torchair import ge  # noqa: E402,F401


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"torchair.{name} is not implemented by the torchair stand-in of the NPU rehearsal platform "
                         "(no GE graph is compiled on the host)")
