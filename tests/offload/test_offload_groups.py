"""Offloadable groups: bit-exact round trips, Parameter and view identity, dedup by storage,
state rules, and 1000 offload/onload cycles with no growth of host or device memory."""

import gc

import pytest
import torch

from tests.offload.offload_helpers import ScaledDie, device, digest, group_digests, wholly_placed
from verl_patches.base import accelerator
from verl_patches.offload import (CallbackGroup, GroupStateError, HostBufferPool, Location, OffloadEngine,
                                  TensorGroup, optimizer_state_group, train_params_group)


def engine(chunk_bytes=4096):
    return OffloadEngine(pool=HostBufferPool(reserve_bytes=0), chunk_bytes=chunk_bytes)


def test_round_trip_keeps_parameter_identity_views_and_bytes():
    eng = engine()
    m = torch.nn.Sequential(torch.nn.Linear(64, 33), torch.nn.Linear(33, 5)).to(device())
    params = list(m.parameters())
    ids = [id(p) for p in params]
    view = params[0][3]  # a view taken before the offload must see the restored data
    before = [digest(p) for p in params]
    g = train_params_group(eng, m)
    assert g.offload() == g.nbytes
    assert g.location is Location.HOST and g.device_bytes() == 0 and wholly_placed(g)
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    assert g.onload() == g.nbytes
    assert [id(p) for p in m.parameters()] == ids
    assert [digest(p) for p in m.parameters()] == before
    assert torch.equal(view, params[0][3])
    out = m(torch.ones(2, 64, device=device()))  # the module still works
    assert out.shape == (2, 5)


def test_tied_weights_and_views_are_copied_once():
    eng = engine()
    base = torch.randn(1000, device=device())
    a, b = base[:500], base[500:]
    g = TensorGroup(eng, "tied", [a, b, base])
    assert g.num_storages == 1 and g.nbytes == 4000
    with pytest.raises(ValueError, match="already belongs to group 'tied'"):
        TensorGroup(eng, "again", [b])
    with pytest.raises(ValueError, match="name 'tied' is already used"):
        TensorGroup(eng, "tied", [torch.randn(3, device=device())])


def test_read_only_group_copies_once_then_only_releases():
    eng = engine()
    from verl_patches.offload import reference_group

    ref = [torch.randn(300, device=device()), torch.randn(7, device=device())]
    want = [digest(t) for t in ref]
    g = reference_group(eng, ref)
    assert g.offload() == g.nbytes  # first time: copy
    for _ in range(3):
        assert g.onload() == g.nbytes
        assert [digest(t) for t in ref] == want
        assert g.offload() == 0  # host copy still exact: nothing moves
    assert g.onload() and g.offload(force_copy=True) == g.nbytes


def test_release_and_allocate_rules():
    eng = engine()
    t = [torch.randn(100, device=device())]
    g = TensorGroup(eng, "rollout", t, zero_on_allocate=True)
    g.release()
    assert g.location is Location.RELEASED and g.device_bytes() == 0
    assert g.release() == 0  # idempotent
    with pytest.raises(GroupStateError, match="no host copy"):
        g.onload()
    with pytest.raises(GroupStateError, match="released"):
        g.offload()
    g.allocate()
    assert g.location is Location.DEVICE and torch.count_nonzero(t[0]) == 0
    assert g.allocate() == 0 and g.onload() == 0  # already on device


def test_optimizer_group_and_claim_conflict():
    eng = engine()
    p = torch.nn.Parameter(torch.randn(50, device=device()))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones_like(p)
    opt.step()
    g = optimizer_state_group(eng, opt)
    names = {k for st in opt.state.values() for k, v in st.items() if v.device.type == device().type}
    assert {"exp_avg", "exp_avg_sq"} <= names and g.nbytes >= 2 * 50 * 4
    with pytest.raises(ValueError, match="already belongs"):
        optimizer_state_group(eng, opt, name="opt2")


def test_a_tensor_whose_data_was_replaced_is_refused_before_anything_moves():
    """megatron-core's router does ``expert_bias.data = expert_bias.data.to(float32)`` at its first
    forward. A group made before that would copy and free the old bf16 storage's size of the new
    fp32 one (the reference's expert bias came back half garbage, a silently wrong KL), and its
    registry key would be a dead storage's address that a new storage can reuse."""
    eng = engine()
    bias = torch.zeros(16, dtype=torch.bfloat16, device=device())
    bias.add_(torch.arange(16, dtype=torch.bfloat16, device=device()))
    g = TensorGroup(eng, "ref_params", [bias], read_only=True)
    bias.data = bias.data.to(torch.float32)
    with pytest.raises(GroupStateError, match=r"shape \(16,\) \(torch.float32\) holds another storage.*replaced its \.data"):
        g.offload()
    with pytest.raises(GroupStateError, match="replaced its .data"):
        g.release()
    assert bias.untyped_storage().nbytes() == 64 and torch.equal(bias, torch.arange(16, dtype=torch.float32,
                                                                                   device=device()))


def test_group_rejects_what_it_cannot_free():
    eng = engine()
    with pytest.raises(ValueError, match="no tensor with allocated storage"):
        TensorGroup(eng, "empty", [torch.empty(0, device=device())])
    if device().type == "cpu":
        import numpy as np

        with pytest.raises(ValueError, match="non-resizable"):
            TensorGroup(eng, "np", [torch.from_numpy(np.zeros(8))])
    else:
        with pytest.raises(ValueError, match="only device tensors"):
            TensorGroup(eng, "host", [torch.zeros(8)])


def test_callback_group_accounts_what_the_owner_allocates():
    held = []

    def alloc():
        held[:] = [torch.zeros(128, device=device()), torch.zeros(64, device=device())]
        return list(held)

    g = CallbackGroup("kv", alloc, held.clear)
    assert g.device_bytes() == 0 and g.location is Location.RELEASED
    g.allocate()
    assert g.device_bytes() == 192 * 4 == g.nbytes
    g.offload()
    assert g.device_bytes() == 0 and held == []
    with pytest.raises(GroupStateError):
        g.onload()


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found")


# Stated tolerance: host RSS may move by allocator noise of a few pages, not by a buffer.
RSS_TOLERANCE = 2 << 20


def test_every_group_round_trips_bit_exactly_for_1000_cycles_without_memory_growth():
    eng = engine(chunk_bytes=2048)
    die = ScaledDie(eng, unit=64)
    g = die.groups
    copied = ["train_params", "grads", "optimizer", "ref_params"]
    rebuilt = ["rollout_weights", "kv_cache"]  # release/allocate: contents come from their owner
    want = {r: group_digests(g[r]) for r in copied}
    fill = {r: [v.clone() for v in g[r].storage_views()] for r in rebuilt}

    def cycle():
        for r in copied:
            g[r].offload(force_copy=True)
            assert g[r].device_bytes() == 0
        for r in rebuilt:
            g[r].release()
            assert g[r].device_bytes() == 0
        for r in copied:
            g[r].onload()
        for r in rebuilt:
            g[r].allocate()
            for dst, src in zip(g[r].storage_views(), fill[r]):  # the reshard / vLLM refill
                dst.copy_(src)

    def verify(where: str) -> None:
        bad = [r for r in copied if group_digests(g[r]) != want[r]]
        assert not bad, f"{where}: {bad} not bit-exact"
        for r in rebuilt:
            assert all(torch.equal(a, b) for a, b in zip(g[r].storage_views(), fill[r])), (where, r)

    cycle()
    # Verify once before measuring: on CUDA the first use of a kernel loads its module
    # (lazy loading), which grows host RSS by tens of MB once; that is not the offload's.
    verify("cycle 1")
    gc.collect()
    accelerator.synchronize()
    rss1, dev1, allocs1 = _rss(), accelerator.memory_allocated(), eng.pool.allocations
    host1 = eng.pool.reserved_bytes
    trace = {1: 0}
    for i in range(2, 1001):
        cycle()
        if i % 111 == 0:
            verify(f"cycle {i}")
        if i in (10, 100, 500):
            trace[i] = _rss() - rss1
    gc.collect()
    accelerator.synchronize()
    grew = trace[1000] = _rss() - rss1
    verify("cycle 1000")
    assert eng.pool.allocations == allocs1, "host buffers were allocated again after the first cycle"
    assert eng.pool.reserved_bytes == host1
    dev = accelerator.memory_allocated()
    assert dev == dev1, f"device memory went from {dev1} to {dev} bytes"
    assert grew <= RSS_TOLERANCE, f"host RSS grew by {grew} bytes over 999 cycles (growth by cycle: {trace})"


def test_rollout_group_leaves_buffers_alone_and_optimizer_group_takes_several():
    from verl_patches.offload import rollout_weights_group

    eng = engine()
    m = torch.nn.Linear(8, 8).to(device())
    m.register_buffer("rotary_cache", torch.arange(16.0, device=device()))
    g = rollout_weights_group(eng, m)
    g.release()
    assert m.rotary_cache.untyped_storage().nbytes() == 64  # still there after the release
    assert m.weight.untyped_storage().nbytes() == 0
    opts = []
    for _ in range(2):  # a Megatron ChainedOptimizer holds several inner optimizers
        p = torch.nn.Parameter(torch.randn(10, device=device()))
        p.grad = torch.ones_like(p)
        o = torch.optim.Adam([p])
        o.step()
        opts.append(o)
    og = optimizer_state_group(eng, opts, include_params=True)
    assert og.num_storages == 2 * 3  # exp_avg, exp_avg_sq, and the param, per optimizer
