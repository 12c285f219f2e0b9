"""MindSpeed's compiled kernels on the NPU rehearsal platform: ``MindSpeedOpBuilder.load()`` answered by name.

Upstream: mindspeed/op_builder/builder.py:MindSpeedOpBuilder.load(self, verbose=True) JIT-compiles the
builder's C++ sources against CANN and torch_npu (torch.utils.cpp_extension.load) and returns the extension
module, cached per builder ``name``. On the host there is neither CANN nor an NPU to run the result. While the
torch_npu stand-in is active, the wrapper returns a module holding the host implementations the rehearsal
registers for that builder name (``MINDSPEED_KERNELS`` of the ``ops`` package); a builder it has none for
raises, naming the builder and the table to add it to. Where the stand-in is not active (an NPU) the original
runs. The ATB builders (mindspeed/op_builder/atb_builder.py:AtbOpBuilder.load, which first needs the CANN NNAL
package's ``ATB_HOME_PATH``) are answered the same way. Applied by
verl_patches.rigs.npu_rehearsal.activate_mindspeed_kernels(), on the rehearsal platform only.

MindSpeed also defines its own operators in the ``mindspeed`` torch library (``torch.ops.mindspeed.npu_gmm``,
...) and registers their Python implementations (which call the builders' kernels) for the NPU's dispatch
key only, ``PrivateUse1`` (mindspeed/ops/gmm.py: ``@impl(AS_LIBRARY, "npu_gmm.Tensor", "PrivateUse1")``). The
rehearsal's tensors are host tensors, dispatched under ``CPU``: while the stand-in is active, each such
registration of the ``mindspeed`` library is made for ``CPU`` as well, so the same MindSpeed function runs
(torch.library:Library.impl, wrapped; every other library and key is untouched).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.rigs.npu_rehearsal.platform import mindspeed_kernels, active


class MissingKernel(RuntimeError):
    """A MindSpeed op builder the rehearsal platform has no host implementation for."""


def host_kernels(name: str) -> types.ModuleType:
    table = mindspeed_kernels()
    if name not in table:
        raise MissingKernel(f"MindSpeed op builder {name!r} has no host implementation on the NPU rehearsal platform "
                            f"(known: {sorted(table)}); add it to MINDSPEED_KERNELS in "
                            "verl_patches/rigs/npu_rehearsal/ops/__init__.py with a reference test")
    module = types.ModuleType(f"npu_rehearsal_kernels.{name}", f"host implementations of MindSpeed's {name} kernels "
                              "(NPU rehearsal platform)")
    for fn_name, fn in table[name].items():
        setattr(module, fn_name, fn)
    return module


def wrap_load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(self, verbose=True):
        if not active():
            return original(self, verbose)
        return host_kernels(self.name)

    return load


def wrap_library_impl(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def impl(self, op_name, fn, dispatch_key="", *, with_keyset=False):
        result = original(self, op_name, fn, dispatch_key, with_keyset=with_keyset)

        if active() and self.ns == "mindspeed" and dispatch_key == "PrivateUse1":
            original(self, op_name, fn, "CPU", with_keyset=with_keyset)  # the host is the NPU here
        return result

    return impl


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
    Patch(
        feature="model_layout",
        id="npu_rehearsal.mindspeed.atb_op_builder_load",
        target="mindspeed.op_builder.atb_builder:AtbOpBuilder.load",
        kind="wrap",
        phases=("driver", "worker"),
        upstream="mindspeed",
        versions="==0.12.1",
        fingerprint=Fingerprint(signature="def load(self, verbose=True)", source_sha="c4706e6fdcb3c120"),
        replacement=f"{__name__}:wrap_load",
        flag="VERL_PATCHES_PLATFORM=npu-rehearsal (the torch_npu stand-in active)",
        why="MindSpeed's ATB builders (the grouped weight-gradient accumulation npu_groupmatmul_add_fp32, ...) first "
            "read the CANN NNAL package's ATB_HOME_PATH, then compile; the rehearsal platform has neither, so they are "
            "answered by name like every other builder (on an NPU the launcher sources NNAL's set_env.sh: "
            "scripts/cluster/bringup.sh).",
        remove_when="Never on the rehearsal platform (a declared stand-in); not applied on an NPU.",
        upstream_ref="MindSpeed v2.2.0_core_r0.12.1 mindspeed/op_builder/atb_builder.py",
        platforms=("npu",),
    ),
    Patch(
        feature="model_layout",
        id="npu_rehearsal.torch.mindspeed_library_on_host",
        target="torch.library:Library.impl",
        kind="wrap",
        phases=("driver", "worker"),
        upstream="torch",
        versions="==2.5.1",
        fingerprint=Fingerprint(signature="def impl(self, op_name, fn, dispatch_key='', *, with_keyset=False)",
                                source_sha="07cb07334cd4cc59"),
        replacement=f"{__name__}:wrap_library_impl",
        flag="VERL_PATCHES_PLATFORM=npu-rehearsal (the torch_npu stand-in active)",
        why="MindSpeed registers its operators' Python implementations for the NPU's dispatch key (PrivateUse1) only; "
            "the rehearsal's tensors are host tensors (CPU key), so the same registrations are made for CPU.",
        remove_when="Never on the rehearsal platform (a declared stand-in); not applied on an NPU.",
        upstream_ref="MindSpeed v2.2.0_core_r0.12.1 mindspeed/ops/gmm.py",
        platforms=("npu",),
    ),
]
