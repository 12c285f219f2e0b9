"""The prelude: what each process applies at its start (``apply_prelude``: the patches of its phase, in the
catalogue's order, after the NPU rehearsal's stand-in and before or after MindSpeed-LLM's adaptor as an Ascend
rank needs). The entry points (verl_patches/entry_points.py, verl_patches/prelude_patch.py) call it.
"""

from __future__ import annotations

import importlib.util
import sys

from verl_patches.rigs import npu_rehearsal
from verl_patches.base import env
from verl_patches.core.apply import apply_all
from verl_patches.core.phase import current_phase
from verl_patches.core.record import Patch
from verl_patches.patches import in_application_order, load_catalogue
from verl_patches.base import accelerator
from verl_patches.rollout.compile_context import save_real_compile
from verl_patches.train.mindspeed_adaptor import import_mindspeed_llm_at_rank_start


def disabled_ids() -> set[str]:
    """VERL_PATCHES_DISABLE=id1,id2 leaves those patches out (an escape hatch for bisecting)."""
    return set(env.get("VERL_PATCHES_DISABLE"))


def patches_for(phase: str, registry: list[Patch] | None = None, device_type: str | None = None) -> list[Patch]:
    """The patches this process applies, in the order it applies them (the CPU platform's first, then
    the catalogue's order): its phase, its accelerator, not disabled."""
    off = disabled_ids()
    dev = device_type or accelerator.device_type()
    applies = lambda p: p.applies_on(dev)  # noqa: E731
    if dev == "npu" and device_type is None and npu_rehearsal.active():
        # The NPU rehearsal platform: the NPU's records, and the host records decided per record
        # (verl_patches/rigs/npu_rehearsal/records.py: APPLY where the host lacks what the stand-in's device
        # mapping cannot give, never the host layer spec).
        applies = npu_rehearsal.applies_on_rehearsal
    return [p for p in in_application_order(registry if registry is not None else load_catalogue())
            if phase in p.phases and p.id not in off and applies(p)]


def boot_rehearsal() -> bool:
    """On the NPU rehearsal platform (VERL_PATCHES_PLATFORM=npu-rehearsal, only then): the torch_npu stand-in
    active and MindSpeed's op builders bound to the host kernels, before verl's device helpers, MindSpeed or the
    patch records read the accelerator. Refuses beside a real torch_npu (npu_rehearsal.activate). Returns whether
    the platform is selected. Idempotent."""
    if not npu_rehearsal.selected():
        return False
    npu_rehearsal.activate()
    device = sys.modules.get("verl.utils.device")
    if device is not None and not getattr(device, "is_npu_available", False):
        # verl decides its device once, at `import verl` (verl/utils/device.py: is_npu_available), by importing
        # torch_npu: the stand-in must be importable before that, in every process.
        raise npu_rehearsal.RehearsalError(
            f"verl was imported before the torch_npu stand-in was importable, so verl runs on "
            f"{device.get_device_name()}: put {npu_rehearsal.SITE} first on PYTHONPATH for every process "
            "(scripts/train_tiny.sh and scripts/cluster/launch.sh do for DEVICE=npu-rehearsal)")
    if importlib.util.find_spec("mindspeed") is not None:
        npu_rehearsal.activate_mindspeed_kernels()
    return True


# Applied before MindSpeed-LLM's adaptor on an Ascend rank, with the records on MindSpeed itself.
BEFORE_MINDSPEED_ADAPTOR = ("megatron.jit_fuser_mindspeed_compile",)


def apply_prelude(phase: str | None = None) -> list[str]:
    """Apply this phase's patches; return the ids newly applied (empty when already done)."""
    if env.get("VERL_PATCHES_OFF"):
        return []
    boot_rehearsal()  # before anything reads the accelerator (the stand-in is the NPU there)
    # Before MindSpeed's adaptor replaces torch.compile for training (verl_patches/rollout/compile_context.py).
    save_real_compile()
    phase = phase or current_phase()
    patches = patches_for(phase)

    if phase != "worker" or accelerator.device_type() != "npu" or importlib.util.find_spec("mindspeed_llm") is None:
        return apply_all(patches)
    # An Ascend rank with MindSpeed-LLM: its adaptor at the rank's start, before any worker's __init__ seeds
    # megatron-core (import_mindspeed_llm_at_rank_start says why). First the records on MindSpeed itself (they shape
    # what the adaptor registers) and megatron's jit_fuser reading torch.compile when used (the adaptor's features
    # import megatron's fusions while they register), then the adaptor, then every other record (on upstream code
    # as MindSpeed left it, so their fingerprints see what runs).
    first = [p for p in patches if p.upstream == "mindspeed" or p.id in BEFORE_MINDSPEED_ADAPTOR]
    applied = apply_all(first)
    import_mindspeed_llm_at_rank_start()
    applied += apply_all([p for p in patches if p not in first])
    return applied
