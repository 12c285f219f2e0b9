"""Offload engine and the train/rollout switch schedule (docs/DESIGN.md section 3).

``schedule`` (the switch as an explicit state machine, and verl 0.4.1's order as a baseline), ``live`` (that
order run on the live memory objects), ``groups`` (the offloadable groups behind one interface), ``ledger`` (the
device bytes per group after each step), ``pool`` (the pinned host buffers and the chunked copy engine),
``stable`` (address-stable device memory for graph mode) and ``megatron_memory`` (a Megatron actor's memory as
groups by role). Plain torch, every device call through verl_patches.base.accelerator; importing patches nothing.
Names are loaded on first use.
"""

from __future__ import annotations

from verl_patches import lazy_names

# Each name and the module it lives in: imported on first use (PEP 562), so that reading the patch
# catalogue (the doctor) needs no torch.
_WHERE = {
    **dict.fromkeys(['CallbackGroup', 'GroupStateError', 'HookedGroup', 'Location', 'OffloadGroup', 'TensorGroup', 'grads_group', 'kv_cache_group', 'optimizer_state_group', 'reference_group', 'rollout_weights_group', 'train_params_group'], 'verl_patches.offload.groups'),
    **dict.fromkeys(['LedgerEntry', 'MemoryLedger'], 'verl_patches.offload.ledger'),
    **dict.fromkeys(['CopyEngine', 'HostBufferPool', 'HostMemoryError', 'OffloadEngine', 'segment_sizes'], 'verl_patches.offload.pool'),
    **dict.fromkeys(['AddressMovedError', 'Region', 'StableBackend', 'StableMemoryError'], 'verl_patches.offload.stable'),
    **dict.fromkeys(['Action', 'BASELINE_INITIAL', 'HOOKS', 'OUR_INITIAL', 'ROLES', 'ScheduleError', 'StepSpec', 'SwitchSchedule', 'baseline', 'baseline_steps', 'locations_after', 'our_steps', 'ours', 'step_roles'], 'verl_patches.offload.schedule'),
    **dict.fromkeys(['LiveSwitch', 'live_switch', 'reset_live_switch'], 'verl_patches.offload.live'),
}

__all__, __getattr__, __dir__ = lazy_names(__name__, _WHERE)
