"""Shared builders for the offload tests: a scaled DeepSeek-V3 die's memory mix, hooks that
check what the schedule promises, and bit-exact digests.
"""

# Sizes keep the per-die ratios of the reference layout (bf16 params P, fp32 grads 2P, sharded
# Adam state 0.75P, rollout shard 4.4P, KV cache 5.8P, reference params P).

from __future__ import annotations

import hashlib

import torch

from verl_patches.base import accelerator
from verl_patches.offload import (Location, OffloadEngine, TensorGroup, grads_group, kv_cache_group,
                                  optimizer_state_group, reference_group, rollout_weights_group,
                                  train_params_group)


def device() -> torch.device:
    return accelerator.current_device()


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (bit-exact, NaN-safe)."""
    # A copy: .numpy() on the tensor itself would pin its storage as non-resizable.
    b = t.detach().contiguous().view(torch.uint8).to("cpu", copy=True)
    return hashlib.sha256(b.numpy().tobytes()).hexdigest()


def group_digests(g: TensorGroup) -> list[str]:
    return [digest(v) for v in g.storage_views()]


def wholly_placed(g) -> bool:
    """Every storage of the group is full (on device) or empty (on host / released), matching its location."""
    if not isinstance(g, TensorGroup):
        return True
    sizes = [t.untyped_storage().nbytes() for t in g.tensors()]
    if g.location is Location.DEVICE:
        return sizes == g._sizes
    return all(n == 0 for n in sizes)


class ScaledDie:
    """Tensors and groups for one die, ``unit`` elements per bf16 'GB' of the real layout."""

    def __init__(self, engine: OffloadEngine, unit: int = 256, *, seed: int = 0, keep_grads: bool = False) -> None:
        dev = device()
        g = torch.Generator().manual_seed(seed)

        def randn(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.randn(n, generator=g).to(dtype).to(dev)

        # Uneven sizes (and an odd one) so storages do not line up with copy chunks or segments.
        p_shapes = [(3, unit), (unit + 7,), (unit // 2, 2), (13,)]
        self.model = torch.nn.Module()
        for i, shape in enumerate(p_shapes):
            t = torch.randn(*shape, generator=g).to(torch.bfloat16).to(dev)
            self.model.register_parameter(f"w{i}", torch.nn.Parameter(t))
        self.params = list(self.model.parameters())
        for p in self.params:  # Megatron keeps fp32 grads in persistent main_grad buffers
            p.main_grad = randn(p.numel(), torch.float32).view(p.shape)
        p_numel = sum(p.numel() for p in self.params)
        # Distributed-optimizer shard: fp32 master, exp_avg, exp_avg_sq of numel/8 each.
        self.optim = torch.optim.Adam([torch.nn.Parameter(randn(p_numel // 8, torch.float32))], lr=1e-3)
        master = self.optim.param_groups[0]["params"][0]
        self.optim.state[master] = {"exp_avg": randn(p_numel // 8, torch.float32),
                                    "exp_avg_sq": randn(p_numel // 8, torch.float32).abs()}
        self.ref = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        r_numel = int(4.4 * p_numel)
        self.rollout = [torch.nn.Parameter(randn(n, torch.bfloat16), requires_grad=False)
                        for n in (r_numel // 2, r_numel // 3, r_numel - r_numel // 2 - r_numel // 3)]
        kv_numel = int(5.8 * p_numel)
        self.kv = [randn(kv_numel // 2, torch.bfloat16), randn(kv_numel - kv_numel // 2, torch.bfloat16)]

        self.groups = {
            "train_params": train_params_group(engine, self.model),
            "grads": grads_group(engine, self.params),
            # The master param is the optimizer's own fp32 copy (Megatron's distributed optimizer).
            "optimizer": optimizer_state_group(engine, self.optim, include_params=True),
            "ref_params": reference_group(engine, self.ref),
            "rollout_weights": rollout_weights_group(engine, self.rollout),
            "kv_cache": kv_cache_group(engine, self.kv),
        }
        self.sizes = {role: grp.nbytes for role, grp in self.groups.items()}
        self.ref_digests = group_digests(self.groups["ref_params"])
        self.train_snapshot: list[str] | None = None
        self.optim_snapshot: list[str] | None = None
        self.calls = {"reshard": 0, "generate": 0, "ref_forward": 0, "train": 0}
        self.keep_grads = keep_grads  # schedule copies grads (True) or re-allocates them zeroed
        self.grads_snapshot: list[str] | None = None

    # -- hooks: each checks what the schedule promised and changes what training changes --
    def expected_rollout(self) -> list[torch.Tensor]:
        """What the test reshard writes: the train params' bytes tiled, built on the host so
        the hook adds no device memory the ledger does not see."""
        src = torch.cat([v.cpu() for v in self.groups["train_params"].storage_views()])
        out = []
        for n in self.groups["rollout_weights"]._sizes:
            reps = -(-n // src.numel())
            out.append(src.repeat(reps)[:n])
        return out

    def reshard(self, train_group, rollout_group) -> None:
        assert train_group.location is Location.DEVICE and rollout_group.location is Location.DEVICE
        for dst, exp in zip(rollout_group.storage_views(), self.expected_rollout()):
            dst.copy_(exp)
        self.calls["reshard"] += 1

    def generate(self) -> None:
        # Rollout weights must hold exactly the reshard's output (the train params are on host now).
        rollout = self.groups["rollout_weights"].storage_views()
        assert self._rollout_expect is not None
        for got, exp in zip(rollout, self._rollout_expect):
            assert torch.equal(got.cpu(), exp), "rollout weights differ from what the reshard wrote"
        for t in self.kv:  # the KV cache is usable memory
            t.fill_(1)
        self.calls["generate"] += 1

    def ref_forward(self) -> None:
        assert group_digests(self.groups["ref_params"]) == self.ref_digests, "reference params changed"
        self.calls["ref_forward"] += 1

    def train(self) -> None:
        tp, opt = self.groups["train_params"], self.groups["optimizer"]
        if self.train_snapshot is not None:
            assert group_digests(tp) == self.train_snapshot, "training params not restored bit-exactly"
            assert group_digests(opt) == self.optim_snapshot, "optimizer state not restored bit-exactly"
        if self.keep_grads:
            if self.grads_snapshot is not None:
                assert group_digests(self.groups["grads"]) == self.grads_snapshot, "grads not restored"
            for p in self.params:
                p.main_grad.zero_()
        for p in self.params:
            assert torch.count_nonzero(p.main_grad) == 0, "grads not re-allocated zeroed"
            p.main_grad.add_(0.5)
            with torch.no_grad():
                p.add_(p.main_grad.to(p.dtype) * 0.01)
        with torch.no_grad():
            for v in opt.tensors():
                v.mul_(0.9).add_(0.1)
        self.train_snapshot, self.optim_snapshot = group_digests(tp), group_digests(opt)
        self.grads_snapshot = group_digests(self.groups["grads"])
        self.calls["train"] += 1

    def hooks(self) -> dict:
        return {"reshard": self._reshard_and_remember, "generate": self.generate,
                "ref_forward": self.ref_forward, "train": self.train}

    _rollout_expect: list[torch.Tensor] | None = None

    def _reshard_and_remember(self, train_group, rollout_group) -> None:
        self._rollout_expect = self.expected_rollout()
        self.reshard(train_group, rollout_group)
