"""The NPU rehearsal platform: a declared stand-in, like the CPU platform, that takes the Ascend code path
(torch_npu, MindSpeed's features applied as on an NPU, MindSpeed-LLM's modules) on a host without an NPU.

Selected only explicitly: ``VERL_PATCHES_PLATFORM=npu-rehearsal`` (verl_patches/base/env.py). Then, and
only then, ``activate()`` puts ``site/`` in front of ``sys.path``, where three stand-in packages live:

- ``torch_npu`` (``site/torch_npu``): the device API mapped onto the host (``torch.npu``: one device, the
  host; streams and events that are the program order, synchronous; host memory figures; the host's
  generator), ``torch_npu.contrib.transfer_to_npu`` mapping ``torch.cuda`` onto it as the real one maps
  CUDA onto the NPU, the ``hccl`` (and ``nccl``) backend names answered by gloo, and torch_npu's operators
  answered by host implementations with torch_npu's documented signatures (``OPERATORS`` of the ``ops``
  package, one module per operator family, each operator with its own reference test);
- ``torchair`` (``site/torchair``): the names MindSpeed's op builders import at module level for graph
  mode (GE converters); nothing here compiles a graph, and every GE operation raises;
- ``acl`` (``site/acl``): the SoC name MindSpeed-LLM reads (a name, not a device).

MindSpeed's own compiled kernels (``MindSpeedOpBuilder.load()``, a JIT build against CANN) are answered,
by builder name, with the host implementations of ``MINDSPEED_KERNELS``; an unknown builder raises.
Anything the stand-in does not implement raises, naming the attribute or operator and where to add it:
there is no permissive stub and nothing is silently a no-op.

Never used where a real torch_npu is installed: ``activate()`` refuses, naming both. ``describe()`` is the
line the doctor and the run's banner print (which torch_npu is in use).

The modules: ``platform`` (selection, activation, refusal beside a real torch_npu, the operator tables read at
each call), ``ops/`` (the host operators and kernels), ``op_builders`` (MindSpeed's op builders answered from
those) and ``records`` (which CPU records apply on the rehearsal). This package is the rig wing's one door: the
recipe's modules that choose the process's platform import it, and nothing else of the rigs
(tests/test_import_graph.py: RIG_DOOR_USERS).

What the rehearsal proves: the Python integration (imports, MindSpeed's and MindSpeed-LLM's patch order,
shapes, parameter names, the math of the operators as torch_npu documents it). What only an NPU proves:
the kernels themselves, HCCL, TorchAir graph mode, device memory, streams that overlap.
"""

from __future__ import annotations

from verl_patches.rigs.npu_rehearsal.platform import (  # noqa: F401
    ENV, PLATFORM, SITE, STAND_INS, RehearsalError, activate, active, describe, mindspeed_kernels, missing_operator,
    operators, real_torch_npu_origin, selected,
)
from verl_patches.core import apply
from verl_patches.rigs.npu_rehearsal.op_builders import PATCHES
from verl_patches.rigs.npu_rehearsal.records import applies_on_rehearsal  # noqa: F401


def activate_mindspeed_kernels() -> list[str]:
    """Bind MindSpeed's op builders to the host kernels (op_builders.PATCHES); needs the stand-in active and
    MindSpeed importable. Returns the ids applied."""
    if not active():
        raise RehearsalError("activate() the torch_npu stand-in before binding MindSpeed's op builders to host kernels")

    return apply.apply_all(PATCHES)
