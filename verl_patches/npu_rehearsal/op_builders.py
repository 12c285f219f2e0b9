"""MindSpeed's compiled kernels on the NPU rehearsal platform: ``MindSpeedOpBuilder.load()`` answered by name.

Upstream: mindspeed/op_builder/builder.py:MindSpeedOpBuilder.load(self, verbose=True) JIT-compiles the
builder's C++ sources against CANN and torch_npu (torch.utils.cpp_extension.load) and returns the extension
module, cached per builder ``name``. On the host there is neither CANN nor an NPU to run the result. While the
torch_npu stand-in is active, the wrapper returns a module holding the host implementations the rehearsal
registers for that builder name (``MINDSPEED_KERNELS`` of ops.py / ops_extra.py); a builder it has none for
raises, naming the builder and the table to add it to. Where the stand-in is not active (an NPU) the original
runs. Applied by verl_patches.npu_rehearsal.activate_mindspeed_kernels(), on the rehearsal platform only.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


class MissingKernel(RuntimeError):
    """A MindSpeed op builder the rehearsal platform has no host implementation for."""


def host_kernels(name: str) -> types.ModuleType:
    from verl_patches import npu_rehearsal

    table = npu_rehearsal.mindspeed_kernels()
    if name not in table:
        raise MissingKernel(f"MindSpeed op builder {name!r} has no host implementation on the NPU rehearsal platform "
                            f"(known: {sorted(table)}); add it to MINDSPEED_KERNELS in verl_patches/npu_rehearsal/ops.py "
                            "with a reference test")
    module = types.ModuleType(f"npu_rehearsal_kernels.{name}", f"host implementations of MindSpeed's {name} kernels "
                              "(NPU rehearsal platform)")
    for fn_name, fn in table[name].items():
        setattr(module, fn_name, fn)
    return module


def wrap_load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(self, verbose=True):
        from verl_patches import npu_rehearsal

        if not npu_rehearsal.active():
            return original(self, verbose)
        return host_kernels(self.name)

    return load


PATCHES = [
    Patch(
        feature="model_layout",
        id="npu_rehearsal.mindspeed.op_builder_load",
        target="mindspeed.op_builder.builder:MindSpeedOpBuilder.load",
        kind="wrap",
        phases=("driver", "worker"),
        upstream="mindspeed",
        versions="==0.12.1",
        # The same body in v2.1.0_core_r0.12.1 and v2.2.0_core_r0.12.1.
        fingerprint=Fingerprint(signature="def load(self, verbose=True)", source_sha="0836defe544c31ba"),
        replacement=f"{__name__}:wrap_load",
        flag="VERL_PATCHES_PLATFORM=npu-rehearsal (the torch_npu stand-in active)",
        why="MindSpeed builds its fused kernels by compiling C++ against CANN at first use; the rehearsal platform "
            "has no CANN and no NPU, so each builder is answered by the host implementations registered for it.",
        remove_when="Never on the rehearsal platform (a declared stand-in); not applied on an NPU.",
        upstream_ref="MindSpeed v2.2.0_core_r0.12.1 mindspeed/op_builder/builder.py",
        platforms=("npu",),
    ),
]
