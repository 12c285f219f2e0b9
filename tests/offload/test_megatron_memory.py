"""ActorMemory / ReferenceMemory on plain torch modules, moved by the switch loop (the framework-free
contract): byte-exact round trips, grads released and re-zeroed, the optimizer grouped once its state
exists, the loop's ledger, and clear errors. Real megatron-core DDP chunks are covered in tests/patches/verl/test_megatron_worker_memory.py."""

from __future__ import annotations

import pytest
import torch

from verl_patches.base import accelerator
from verl_patches.offload import HostBufferPool, Location, OffloadEngine
from verl_patches.offload.live import LiveSwitch
from verl_patches.offload.megatron_memory import ActorMemory, ReferenceMemory, inner_optimizers


def _engine() -> OffloadEngine:
    return OffloadEngine(pool=HostBufferPool(reserve_bytes=0))


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(accelerator.current_device())
    # Megatron-style: one flat grad buffer, each param's main_grad a view of it.
    flat = torch.zeros(sum(p.numel() for p in m.parameters()), device=accelerator.current_device())
    off = 0
    for p in m.parameters():
        p.main_grad = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
    m.flat_grad = flat
    return m


def _snap(tensors) -> list[bytes]:
    # A clone: .numpy() on the tensor itself would pin its storage (non-resizable).
    return [t.detach().clone().view(torch.uint8).cpu().numpy().tobytes() for t in tensors]


def _step(m, opt):
    for p in m.parameters():
        p.main_grad.copy_(torch.randn_like(p))
        p.grad = p.main_grad.clone()
    opt.step()
    for p in m.parameters():
        p.grad = None


def test_params_grads_optimizer_round_trip_byte_exact_over_cycles():
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    mem = ActorMemory([m], opt, engine=_engine(), keep_grads=True)
    assert mem.opt is None and "optimizer" not in mem.groups()  # no Adam state before the first step
    _step(m, opt)
    switch = LiveSwitch(keep_grads=True)

    def snapshot():
        return (_snap(m.parameters()), _snap([m.flat_grad]),
                _snap([v for s in opt.state.values() for v in s.values() if v.dim() > 0]))

    want = snapshot()
    views = [p.main_grad for p in m.parameters()]
    switch.attach(mem)  # where the loop starts, an update's end: grads and optimizer state on host
    for _ in range(3):
        switch.reach("offload_train_params")
        assert mem.resident() == {"train_params": 0, "grads": 0, "optimizer": 0}
        assert all(p.untyped_storage().nbytes() == 0 for p in m.parameters())
        switch.reach("update_onload")
        assert snapshot() == want
        # The views Megatron and the optimizer hold are the same objects, on the same storage again.
        assert all(a is p.main_grad for a, p in zip(views, m.parameters()))
        assert m.flat_grad.untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()
        switch.call("update", lambda: _step(m, opt))
        want = snapshot()
        switch.reach("update_end")


def test_grads_are_released_and_come_back_zeroed_by_default():
    m = _model()
    mem = ActorMemory([m], engine=_engine())
    m.flat_grad.fill_(3.0)
    switch = LiveSwitch()
    switch.attach(mem)  # released: no copy
    assert mem.grads.location is Location.RELEASED and m.flat_grad.untyped_storage().nbytes() == 0
    assert mem.params.location is Location.DEVICE  # params stay for the reshard
    switch.reach("update_onload")
    assert torch.count_nonzero(m.flat_grad) == 0


def test_the_loops_ledger_records_each_step_with_resident_bytes_and_moves():
    m = _model()
    mem = ActorMemory([m], engine=_engine())
    switch = LiveSwitch()
    switch.attach(mem)
    switch.reach("update_onload")
    steps = [e.step for e in switch.ledger.entries]
    # The reshard is passed (verl runs it inside the sharding manager); no optimizer was given.
    assert steps == ["attach:ActorMemory", "reshard", "offload_train_params", "update_onload"]
    by = {e.step: e for e in switch.ledger.entries}
    nparam = sum(p.numel() * 4 for p in m.parameters())
    assert by["offload_train_params"].d2h_bytes == nparam and by["offload_train_params"].resident["train_params"] == 0
    assert by["update_onload"].h2d_bytes == nparam and by["attach:ActorMemory"].d2h_bytes == 0
    assert by["reshard"].resident["train_params"] == nparam


def test_reference_is_copied_once_then_only_freed():
    ref = _model(1)
    before = _snap(ref.parameters())
    mem = ReferenceMemory([ref], engine=_engine())
    switch = LiveSwitch()
    switch.attach(mem)
    assert switch.ledger.entries[-1].d2h_bytes > 0  # the one copy
    for _ in range(2):
        (onload,) = switch.reach("ref_onload")
        assert onload.h2d_bytes > 0
        switch.call("ref_forward", lambda: _snap(ref.parameters()) == before or pytest.fail("reference changed"))
        (offload,) = switch.reach("ref_offload")
        assert offload.d2h_bytes == 0  # read-only: the host copy is exact, nothing moves
        assert all(p.untyped_storage().nbytes() == 0 for p in ref.parameters())


def test_actor_and_reference_share_one_engine_without_sharing_storage():
    eng = _engine()
    m = _model()
    ActorMemory([m], engine=eng)
    with pytest.raises(ValueError, match="already belongs to group 'actor_params'"):
        ReferenceMemory([m], engine=eng)


def test_bad_input_is_named():
    eng = _engine()
    with pytest.raises(TypeError, match="Megatron module list"):
        ActorMemory("model", engine=eng)
    with pytest.raises(TypeError, match="OffloadEngine"):
        ActorMemory([_model()], engine=object())
    with pytest.raises(ValueError, match="no gradient buffer"):
        ActorMemory([torch.nn.Linear(2, 2).to(accelerator.current_device())], engine=eng)
    with pytest.raises(TypeError, match="holds no torch optimizer"):
        inner_optimizers(object())
    with pytest.raises(TypeError, match="holds no torch optimizer"):
        ActorMemory([_model()], object(), engine=_engine())


def test_megatron_optimizer_shapes_are_unwrapped():
    a, b = (torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0) for _ in range(2))

    class Wrapped:  # MegatronOptimizer keeps its torch optimizer as .optimizer
        def __init__(self, inner):
            self.optimizer = inner

    class Chained:  # ChainedOptimizer
        chained_optimizers = [Wrapped(a), Wrapped(b)]

    assert inner_optimizers(Chained()) == [a, b] and inner_optimizers(a) == [a]
