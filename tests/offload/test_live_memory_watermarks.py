"""The device-memory watermarks of the switch loop (verl_patches/offload/live.py) and the figures the
sharding manager sends to the run's report (memory_figures in verl_patches/reporting/switch_report.py).

The allocator's statistics need a device: here a stand-in allocator (the only fake; it counts what
the test says each phase allocates) takes the place of torch.cuda / torch.npu behind
verl_patches.base.accelerator. The loop, its groups and the steps are the real ones of test_live_switch."""

from __future__ import annotations

import pytest

from tests.offload.test_live_switch import ACTOR, REF, ROLLOUT, attached, training_step
from verl_patches.base import accelerator
from verl_patches.reporting.report import DEVICE_PEAKS, MEM_PREFIX
from verl_patches.reporting.switch_report import memory_figures

GEN_PEAK, UPDATE_PEAK, BASE = 7_000, 5_000, 1_000


class Allocator:
    """Stand-in for the device's caching allocator: a current figure and the peaks since a reset."""

    def __init__(self) -> None:
        self.current, self.peak, self.reserved_peak, self.resets = BASE, BASE, 2 * BASE, 0

    def touch(self, peak: int) -> None:
        self.peak = max(self.peak, peak)
        self.reserved_peak = max(self.reserved_peak, peak + BASE)

    def reset(self) -> None:
        self.peak, self.reserved_peak, self.resets = self.current, self.current + BASE, self.resets + 1


@pytest.fixture
def device(monkeypatch):
    alloc = Allocator()
    monkeypatch.setattr(accelerator, "synchronize", lambda: None)
    monkeypatch.setattr(accelerator, "reset_peak_memory_stats", alloc.reset)
    monkeypatch.setattr(accelerator, "memory_allocated", lambda: alloc.current)
    monkeypatch.setattr(accelerator, "max_memory_allocated", lambda: alloc.peak)
    monkeypatch.setattr(accelerator, "max_memory_reserved", lambda: alloc.reserved_peak)
    return alloc


def _measured(alloc, *parts):
    # Built as on the CPU platform (nothing measured while attaching, on any machine), then measuring
    # as on a device (the loop turns it on off the CPU platform), through the stand-in allocator.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(accelerator, "device_type", lambda: "cpu")
        d, switch = attached(*parts)
    switch.measure_device = True
    gen, train = d.generate, d.train

    def generate():  # verl's generation, between two reached steps
        alloc.touch(GEN_PEAK)
        return gen()

    def update():
        alloc.touch(UPDATE_PEAK)
        return train()

    d.generate, d.train = generate, update
    return d, switch


def test_the_cpu_platform_measures_nothing_and_sends_nothing():
    d, switch = attached(ACTOR, REF, ROLLOUT)
    assert switch.measure_device is (accelerator.device_type() != "cpu")
    if accelerator.device_type() == "cpu":
        training_step(d, switch)
        assert all(e.measured_peak is None and e.measured_reserved_peak is None for e in switch.ledger.entries)
        assert memory_figures(switch) == {}
    assert memory_figures(None) == {}


def test_work_between_steps_counts_in_the_next_entry(device):
    d, switch = _measured(device, ACTOR, REF, ROLLOUT)
    training_step(d, switch)
    by_step = {e.step: e for e in switch.ledger.entries}
    # The generation ran between init_kv_cache and the release: its peak is in the passed step
    # 'generate' (the first entry after it), not lost between two resets.
    assert by_step["generate"].measured_peak == GEN_PEAK
    assert by_step["generate"].measured_reserved_peak == GEN_PEAK + BASE
    assert by_step["update"].measured_peak == UPDATE_PEAK
    assert by_step["release_rollout_weights"].measured_peak == BASE  # reset after 'generate'
    measured = [e for e in switch.ledger.entries if e.measured_peak is not None]  # (attach ran before it was on)
    assert device.resets == len(measured) == len(switch.ledger.entries) - 3  # one reset per entry, at its end


def test_memory_figures_per_step_and_since_the_previous_switch(device):
    d, switch = _measured(device, ACTOR, REF, ROLLOUT)
    training_step(d, switch)
    first = memory_figures(switch)
    names = [s.name for s in switch.steps]
    assert set(first) == {f"{MEM_PREFIX}{n}/{k}_peak_bytes" for n in names for k in ("allocated", "reserved")} \
        | set(DEVICE_PEAKS)
    assert first[f"{MEM_PREFIX}generate/allocated_peak_bytes"] == GEN_PEAK
    assert first[f"{MEM_PREFIX}update/allocated_peak_bytes"] == UPDATE_PEAK
    assert first[DEVICE_PEAKS[0]] == GEN_PEAK and first[DEVICE_PEAKS[1]] == GEN_PEAK + BASE
    # Nothing ran since: the maxima of what ran are zero, each step keeps its latest measurement.
    again = memory_figures(switch)
    assert again[DEVICE_PEAKS[0]] == 0 and again[f"{MEM_PREFIX}generate/allocated_peak_bytes"] == GEN_PEAK
    assert set(again) == set(first)  # the same keys every time (verl averages them over ranks by position)
    # A step that has not run yet reads 0 (here: none; a fresh loop has them all at 0).
    _, fresh = _measured(device, ACTOR, REF, ROLLOUT)
    assert set(memory_figures(fresh).values()) == {0.0}


@pytest.mark.skipif(accelerator.device_type() == "cpu", reason="the allocator's statistics need a device")
def test_on_a_device_the_generation_peak_is_in_its_entry_and_the_figures():
    """The real allocator (torch.cuda / torch.npu behind verl_patches.base.accelerator): a generation that
    holds 64 MiB for a moment shows in 'generate' and in the figures' maximum, reserved >= allocated."""
    import torch

    d, switch = attached(ACTOR, REF, ROLLOUT)
    assert switch.measure_device
    gen, burst = d.generate, 64 * 2**20

    def generate():
        x = torch.empty(burst, dtype=torch.uint8, device=accelerator.current_device())
        x.fill_(1)
        del x
        return gen()

    d.generate = generate
    training_step(d, switch)
    by_step = {e.step: e for e in switch.ledger.entries}
    e = by_step["generate"]
    assert e.measured_peak >= burst + e.measured_allocated - 2**20, e
    assert e.measured_reserved_peak >= e.measured_peak
    assert by_step["release_rollout_weights"].measured_peak < burst  # reset after 'generate'
    figures = memory_figures(switch)
    assert figures[DEVICE_PEAKS[0]] == max(x.measured_peak for x in switch.ledger.entries)
    assert figures[f"{MEM_PREFIX}generate/allocated_peak_bytes"] == e.measured_peak
