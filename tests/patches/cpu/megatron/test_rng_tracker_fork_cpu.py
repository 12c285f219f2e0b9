"""The CPU platform's RNG tracker fork (patch cpu.megatron.rng_tracker_fork) on megatron-core's real
CudaRNGStatesTracker: the fork switches the host generator to the tracker's stream and back, keeps
the stream's advance, and no longer warns 'CPU RNG state changed within GPU RNG context' at every
fork that draws a number (upstream's check compares the host generator with itself here)."""

from __future__ import annotations

import logging

import pytest
import torch

from verl_patches.core import apply as ap
from verl_patches.rigs.cpu.patches.megatron import patch_core_tensor_parallel_random as P
from verl_patches.rigs.cpu.patches.torch import patch_cuda_random as T

WARNING = "CPU RNG state changed within GPU RNG context"
SEED = 1234


@pytest.fixture
def tracker():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    ids = ap.apply_all([*T.PATCHES, P.PATCHES[0]])  # the host generator plays the device's (not the fork)
    try:
        t = CudaRNGStatesTracker()
        t.add("model-parallel-rng", SEED)
        yield t
    finally:
        ap.undo(list(reversed(ids)))


def _draws(tracker, caplog):
    torch.manual_seed(7)
    outside_before = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="megatron.core.tensor_parallel.random"):
        with tracker.fork():
            first = torch.rand(4)
        with tracker.fork():
            second = torch.rand(4)
    return first, second, outside_before


def test_upstream_fork_warns_at_every_fork_on_the_host(tracker, caplog):
    _draws(tracker, caplog)
    assert sum(WARNING in r.getMessage() for r in caplog.records) == 2


def test_our_fork_switches_streams_without_the_warning(tracker, caplog):
    ids = ap.apply_all([P.PATCHES[1]])
    try:
        first, second, outside_before = _draws(tracker, caplog)
        assert torch.equal(torch.get_rng_state(), outside_before)  # the outside stream did not move
        g = torch.Generator().manual_seed(SEED)
        expected = torch.rand(8, generator=g)
        assert torch.equal(torch.cat([first, second]), expected)  # the tracker's stream, continued
        assert not [r for r in caplog.records if WARNING in r.getMessage()]
        with pytest.raises(Exception, match="cuda rng state other is not added"):
            with tracker.fork("other"):
                pass
    finally:
        ap.undo(ids)


def test_the_record_is_cpu_only_and_needs_the_state_setter():
    rec = P.PATCHES[1]
    assert rec.platforms == ("cpu",) and rec.requires == ("cpu.megatron.rng_tracker_set_state",)
