"""Offload engine and the train/rollout switch schedule (docs/DESIGN.md section 3).

Plain torch, every device call through verl_patches.accelerator; importing patches nothing.
"""

from verl_patches.offload.groups import (CallbackGroup, GroupStateError, Location, OffloadGroup, TensorGroup,
                                         grads_group, kv_cache_group, optimizer_state_group, reference_group,
                                         rollout_weights_group, train_params_group)
from verl_patches.offload.ledger import LedgerEntry, MemoryLedger
from verl_patches.offload.pool import (CopyEngine, HostBufferPool, HostMemoryError, OffloadEngine,
                                       segment_sizes)
from verl_patches.offload.stable import AddressMovedError, Region, StableBackend, StableMemoryError
from verl_patches.offload.schedule import (BASELINE_INITIAL, HOOKS, OUR_INITIAL, ROLES, Action, ScheduleError,
                                           StepSpec, SwitchSchedule, baseline, baseline_steps, our_steps, ours)

__all__ = [
    "AddressMovedError", "Region", "StableBackend", "StableMemoryError", "BASELINE_INITIAL", "HOOKS", "OUR_INITIAL", "ROLES", "Action", "CallbackGroup", "CopyEngine", "GroupStateError", "HostBufferPool", "HostMemoryError",
    "LedgerEntry", "Location", "MemoryLedger", "OffloadEngine", "OffloadGroup", "ScheduleError", "StepSpec",
    "SwitchSchedule", "TensorGroup", "baseline", "baseline_steps", "grads_group", "kv_cache_group",
    "optimizer_state_group", "our_steps", "ours", "reference_group", "rollout_weights_group",
    "segment_sizes", "train_params_group",
]
