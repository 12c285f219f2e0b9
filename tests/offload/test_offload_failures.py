"""Failures injected mid-copy, mid-allocation and mid-step: every group stays wholly on
device or on host with its data, the ledger tells the truth, nothing leaks, retry works."""

import pytest
import torch

from tests.offload.offload_helpers import ScaledDie, device, group_digests, wholly_placed
from verl_patches.base import accelerator
from verl_patches.offload import (HostBufferPool, HostMemoryError, Location, OffloadEngine, TensorGroup, baseline,
                                  ours)


class Boom(RuntimeError):
    pass


def fail_at(point, chunk, item=0, times=1):
    """A fault hook raising once (by default) at the given copy / allocation."""
    left = [times]

    def hook(p, b, i):
        if p == point and b == chunk and i == item and left[0] > 0:
            left[0] -= 1
            if point == "alloc":
                raise torch.OutOfMemoryError("injected allocation failure")
            raise Boom(f"injected failure in {p} copy chunk {b} item {i}")
    return hook


def group_of(n_tensors=6, numel=300, chunk_bytes=3000):
    eng = OffloadEngine(pool=HostBufferPool(reserve_bytes=0), chunk_bytes=chunk_bytes)
    ts = [torch.randn(numel + k, device=device()) for k in range(n_tensors)]
    return eng, TensorGroup(eng, "g", ts), ts


def test_failure_mid_offload_leaves_the_group_on_device_and_retry_works():
    eng, g, ts = group_of()
    want = group_digests(g)
    assert len(eng.copier.split(g._sizes)) >= 3
    eng.fault_hook = fail_at("d2h", 1, 1)
    with pytest.raises(Boom):
        g.offload()
    assert g.location is Location.DEVICE and wholly_placed(g) and g.device_bytes() == g.nbytes
    assert group_digests(g) == want
    pins = (eng.pool.allocations, eng.pool.reserved_bytes)
    assert g.offload() == g.nbytes  # retry, hook spent
    assert (eng.pool.allocations, eng.pool.reserved_bytes) == pins  # the retry reused the buffer
    g.onload()
    assert group_digests(g) == want


@pytest.mark.parametrize("point,chunk", [("h2d", 2), ("alloc", 1), ("h2d", 0)])
def test_failure_mid_onload_leaves_the_group_on_host_and_retry_works(point, chunk):
    eng, g, ts = group_of()
    want = group_digests(g)
    g.offload()
    accelerator.synchronize()
    dev_before = accelerator.memory_allocated()
    eng.fault_hook = fail_at(point, chunk)
    with pytest.raises((Boom, torch.OutOfMemoryError)):
        g.onload()
    assert g.location is Location.HOST and wholly_placed(g) and g.device_bytes() == 0
    assert accelerator.memory_allocated() == dev_before  # copy chunks already allocated were given back
    g.onload()
    assert group_digests(g) == want


def test_failure_in_allocate_rolls_back():
    eng, g, ts = group_of()
    g.release()
    eng.fault_hook = fail_at("alloc", 2)
    with pytest.raises(torch.OutOfMemoryError):
        g.allocate()
    assert g.location is Location.RELEASED and g.device_bytes() == 0 and wholly_placed(g)
    g.allocate()
    assert g.device_bytes() == g.nbytes


def _consistent(s):
    """The ledger's last entry equals what the storages hold, and each group is whole."""
    e = s.ledger.last
    assert e.resident == {r: g.device_bytes() for r, g in s.groups.items()}
    assert all(wholly_placed(g) for g in s.groups.values())
    for r, g in s.groups.items():
        assert e.resident[r] == (g.nbytes if g.location is Location.DEVICE else 0), r


@pytest.mark.parametrize("step,point,chunk", [
    ("update_onload", "alloc", 0),      # train params onloaded, grads allocation fails
    ("update_onload", "h2d", 0),        # first copy fails
    ("offload_train_params", "d2h", 0),
    ("ref_onload", "h2d", 0),
    ("update_end", "d2h", 0),           # the optimizer's copy
])
def test_failure_inside_a_switch_step_is_retryable(step, point, chunk):
    d = ScaledDie(OffloadEngine(pool=HostBufferPool(reserve_bytes=0), chunk_bytes=4096), unit=256)
    s = ours(d.groups)
    s.run_iteration(**d.hooks())
    s.run_until(s.step_names[s.step_names.index(step) - 1], **d.hooks())
    eng = d.groups["train_params"].engine
    pins = (eng.pool.allocations, eng.pool.reserved_bytes)
    if step == "update_onload" and point == "alloc":
        # Fail in the grads group (its first allocation), after the train params are back.
        seen = {"n": 0}

        def hook(p, b, i):
            if p == "alloc":
                seen["n"] += 1
                if d.groups["train_params"].location is Location.DEVICE and seen["n"] > 0 \
                        and d.groups["grads"].location is not Location.DEVICE:
                    eng.fault_hook = None
                    raise torch.OutOfMemoryError("injected allocation failure in grads")
        eng.fault_hook = hook
    else:
        eng.fault_hook = fail_at(point, chunk)
    with pytest.raises((Boom, torch.OutOfMemoryError)) as err:
        s.advance(**d.hooks())
    assert f"step {step!r} failed" in "\n".join(getattr(err.value, "__notes__", []))
    assert s.state == step and s.ledger.last.error is not None and s.ledger.last.step == step
    _consistent(s)
    if step == "update_onload" and point == "alloc":
        assert s.locations()["train_params"] is Location.DEVICE
        assert s.locations()["grads"] is Location.RELEASED
    assert (eng.pool.allocations, eng.pool.reserved_bytes) == pins  # no pinned memory leaked
    eng.fault_hook = None
    s.advance(**d.hooks())  # retry the step
    assert s.ledger.last.error is None
    _consistent(s)
    s.run_iteration(**d.hooks())  # hooks check every group's data bit-exactly
    s.run_iteration(**d.hooks())
    assert (eng.pool.allocations, eng.pool.reserved_bytes) == pins


def test_failing_hook_keeps_position():
    d = ScaledDie(OffloadEngine(pool=HostBufferPool(reserve_bytes=0)), unit=64)
    s = ours(d.groups)
    s.run_until("alloc_rollout_weights", **d.hooks())

    def bad_reshard(train, rollout):
        raise Boom("reshard died")
    with pytest.raises(Boom):
        s.advance(**dict(d.hooks(), reshard=bad_reshard))
    assert s.state == "reshard"
    _consistent(s)
    s.run_iteration(**d.hooks())
    assert d.calls["generate"] == 1


@pytest.mark.parametrize("make", [ours, baseline])
def test_insufficient_host_memory_fails_before_anything_moves(make):
    pool = HostBufferPool(reserve_bytes=1 << 20, host_mem_info=lambda: (1 << 20, 1 << 30))
    d = ScaledDie(OffloadEngine(pool=pool), unit=64)
    s = make(d.groups)
    before = s.resident()
    with pytest.raises(HostMemoryError, match=r"need \d+\.\d+ GiB .* available 0\.001 GiB") as err:
        s.advance(**d.hooks())
    assert err.value.needed == sum(pool.footprint(d.groups[r].host_nbytes)
                                   for r in ("train_params", "optimizer", "ref_params")
                                   + (("rollout_weights",) if make is baseline else ()))
    assert s.resident() == before and all(g.location is Location.DEVICE for g in d.groups.values())
    assert pool.allocations == 0 and pool.reserved_bytes == 0
    # A single group offload checks too, before moving.
    with pytest.raises(HostMemoryError):
        d.groups["train_params"].offload()
    assert d.groups["train_params"].location is Location.DEVICE and pool.allocations == 0


@pytest.mark.skipif(accelerator.device_type() == "cpu", reason="a real allocation failure needs a device")
def test_real_device_oom_during_onload_rolls_back():
    eng, g, ts = group_of(n_tensors=4, numel=64 << 20, chunk_bytes=256 << 20)  # 4 x 256 MiB
    want = group_digests(g)
    g.offload()
    accelerator.synchronize()
    accelerator.empty_cache()
    used = accelerator.memory_allocated()
    free, total = accelerator.mem_get_info()
    mod = accelerator.device_module()
    # Leave room for about two of the four tensors: the third allocation really fails.
    mod.set_per_process_memory_fraction((used + 2.5 * (256 << 20)) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            g.onload()
        assert g.location is Location.HOST and g.device_bytes() == 0 and wholly_placed(g)
        assert accelerator.memory_allocated() == used
    finally:
        mod.set_per_process_memory_fraction(1.0)
    g.onload()
    assert group_digests(g) == want
