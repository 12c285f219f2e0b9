"""The switch's figures for the run's report, gathered on a generation worker when the sharding manager
enters rollout (patch verl.sharding_manager.reshard) and put in the timing dict verl returns with every
generation, its one channel from the generation workers to the driver (verl averages it over ranks;
verl_patches/reporting/report.py moves the ``switch/...`` keys out of ``timing_s/``).

- ``switch_figures``: what this rank received and sent in the reshard, the host-link bytes and the
  resident peak from the switch loop's ledger, and the self-checks' figures;
- ``memory_figures``: the device's watermarks per step of the switch loop, maximum over ranks;
- ``addresses_checked``: the captured-graph addresses the engine's groups compared since the previous
  report (graph mode).

Each remembers what it reported already (on the object it reads, through verl_patches.core.stash), so
every figure counts since the previous switch.
"""

from __future__ import annotations

from typing import Any

from verl_patches.core import stash
from verl_patches.reporting.report import DEVICE_PEAKS, MEM_PREFIX, SWITCH_PREFIX
from verl_patches.base import accelerator
import torch
import torch.distributed as dist


def switch_figures(stats: Any, ledger: Any, checks: dict[str, float] | None = None) -> dict[str, float]:
    """The switch's own numbers for the run's report (verl_patches/reporting/report.py), sent to the driver in
    the timing dict verl returns with every generation (averaged over ranks): what this rank received
    and sent in the reshard, the host-link bytes and resident peak from the switch loop's ledger, and
    the self-checks' figures (``checks``, from the sharding manager's self_check)."""
    out = {f"{SWITCH_PREFIX}reshard_recv_bytes": float(stats.recv_bytes),
           f"{SWITCH_PREFIX}reshard_sent_bytes": float(stats.sent_bytes)}
    out.update({f"{SWITCH_PREFIX}{k}": float(v) for k, v in (checks or {}).items()})
    if ledger is not None:
        # Since the previous switch: the update's onloads, the reference's, and this switch's offloads.
        last = stash.get(ledger, "moved_reported", 0)
        out[f"{SWITCH_PREFIX}link_bytes"] = float(ledger.moved_bytes - last)
        out[f"{SWITCH_PREFIX}ledger_peak_bytes"] = float(ledger.peak_bytes)
        stash.put(ledger, "moved_reported", ledger.moved_bytes)
    return out


def addresses_checked(manager: Any) -> float:
    """Captured-graph addresses the engine's groups compared since the previous report (graph mode)."""
    memory = stash.get(manager.inference_engine, "memory")
    if memory is None or not hasattr(memory, "addresses_checked"):
        return 0.0
    total = memory.addresses_checked()
    last = stash.get(manager, "addresses_reported", 0)
    stash.put(manager, "addresses_reported", total)
    return float(total - last)


def memory_figures(switch: Any) -> dict[str, float]:
    """The device's watermarks per step of the switch loop (verl_patches/offload/live.py), for the report:
    ``switch/mem/<step>/allocated_peak_bytes`` and ``.../reserved_peak_bytes`` for every step of the loop
    (the latest measurement of each; 0 until a step first ran), and their maxima over what ran since the
    previous switch, excursions included, as ``switch/device_allocated_peak_bytes`` and
    ``switch/device_reserved_peak_bytes``. The maximum over ranks is taken here: verl's timing channel
    then averages equal values. Nothing on the CPU platform (the loop measures no device there); the
    keys are the same on every rank (the loop's steps), as verl's average needs."""
    if switch is None or not switch.measure_device:
        return {}
    ledger = switch.ledger
    last = stash.get(ledger, "mem_reported", None)
    fresh: dict[str, tuple[int, int]] = {}
    for entry in reversed(ledger.entries):
        if entry is last:
            break
        if entry.measured_peak is not None:
            a, r = fresh.get(entry.step, (0, 0))
            fresh[entry.step] = (max(a, entry.measured_peak), max(r, entry.measured_reserved_peak or 0))
    if ledger.entries:
        stash.put(ledger, "mem_reported", ledger.entries[-1])
    names = [s.name for s in switch.steps]
    known = stash.get(switch, "mem_known", None) or {}
    known.update({k: v for k, v in fresh.items() if k in names})
    stash.put(switch, "mem_known", known)
    out = {}
    for name in names:
        a, r = known.get(name, (0, 0))
        out[f"{MEM_PREFIX}{name}/allocated_peak_bytes"] = float(a)
        out[f"{MEM_PREFIX}{name}/reserved_peak_bytes"] = float(r)
    out[DEVICE_PEAKS[0]] = float(max((a for a, _ in fresh.values()), default=0))
    out[DEVICE_PEAKS[1]] = float(max((r for _, r in fresh.values()), default=0))
    return max_over_ranks(out)


def max_over_ranks(figures: dict[str, float]) -> dict[str, float]:
    """Each figure's maximum over the default process group's ranks (unchanged without one)."""
    if not figures or not dist.is_initialized():
        return figures
    keys = sorted(figures)
    values = torch.tensor([figures[k] for k in keys], dtype=torch.float32, device=accelerator.current_device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(keys, values.tolist()))


__all__ = ["addresses_checked", "max_over_ranks", "memory_figures", "switch_figures"]
