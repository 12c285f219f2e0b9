"""A Megatron actor's and reference's device memory as offload groups by role; the switch loop
(verl_patches.offload.live, docs/DESIGN.md section 3) moves them and keeps the ledger.

Where megatron-core 0.12.1 keeps things (see verl.utils.megatron_utils offload_megatron_model_to_cpu):
1. A DDP chunk's ``buffers`` and ``expert_parallel_buffers`` each hold ``param_data`` and ``grad_data``.
2. ``param_data``: the params are views of it with the distributed optimizer (None without it).
3. ``grad_data``: every ``param.main_grad`` is a view of it.
4. The optimizer's inner torch optimizers hold the state and, for mixed precision, the fp32 master
   copies as their params.
Groups resize storages in place. So megatron-core's DDP buckets, the optimizer and vLLM's reshard keep
their references.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from verl_patches.offload import groups
from verl_patches.offload.groups import HookedGroup, Location, OffloadGroup, TensorGroup, _storage_key
from verl_patches.offload.pool import OffloadEngine
from verl_patches.offload.live import live_switch
from verl_patches.train.ddp_overlap import check_settled


def _chunks(modules: Any) -> list[torch.nn.Module]:
    chunks = list(modules) if isinstance(modules, (list, tuple, torch.nn.ModuleList)) else [modules]
    if not chunks or not all(isinstance(m, torch.nn.Module) for m in chunks):
        raise TypeError(f"expected a Megatron module list (verl's actor_module), got {type(modules).__name__}"
                        + (f" holding {sorted({type(m).__name__ for m in chunks})}" if chunks else " (empty)"))
    return chunks


def megatron_buffers(chunk: torch.nn.Module) -> list[Any]:
    # DDP's ``buffers`` attribute (a list of _ParamAndGradBuffer) shadows nn.Module.buffers().
    out = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = chunk.__dict__.get(name)
        if isinstance(value, (list, tuple)):
            out += list(value)
    return out


def _overlapped(chunk: torch.nn.Module) -> bool:
    ddp = getattr(chunk, "ddp_config", None)
    return bool(ddp is not None and (ddp.overlap_grad_reduce or ddp.overlap_param_gather))


def param_tensors(modules: Any) -> list[torch.Tensor]:
    """Every parameter of the chunks, plus DDP's contiguous param_data (params are views of it)."""
    out: list[torch.Tensor] = []
    for chunk in _chunks(modules):
        out += [b.param_data for b in megatron_buffers(chunk) if getattr(b, "param_data", None) is not None]
        out += list(chunk.parameters())
    return out


def grad_tensors(modules: Any) -> list[torch.Tensor]:
    """DDP's grad_data per buffer, and any main_grad / grad outside them (an unwrapped chunk)."""
    out: list[torch.Tensor] = []
    for chunk in _chunks(modules):
        out += [b.grad_data for b in megatron_buffers(chunk)]
        for p in chunk.parameters():
            for g in (getattr(p, "main_grad", None), p.grad):
                if isinstance(g, torch.Tensor):
                    out.append(g)
    return out


def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer: ChainedOptimizer.chained_optimizers, each
    MegatronOptimizer's ``.optimizer``, or a torch optimizer itself."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [o for c in chained for o in inner_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return [inner]
    raise TypeError(f"optimizer of type {type(optimizer).__name__} holds no torch optimizer "
                    "(expected a torch.optim.Optimizer, a Megatron optimizer with .optimizer, or a ChainedOptimizer)")


def hybrid_optimizers(optimizer: Any) -> list[Any]:
    """megatron-core's HybridDeviceOptimizer instances inside ``optimizer`` (optimizer_cpu_offload: the
    fp32 masters, Adam's moments and pinned fp32 grad copies of ``offload_fraction`` of the parameters
    live on the host, its ``gpu_optimizer`` holds the rest on the device)."""
    return [o for o in inner_optimizers(optimizer) if hasattr(o, "cpu_optimizers") and hasattr(o, "sub_optimizers")]


def host_optimizer_bytes(optimizer: Any) -> int:
    """Host bytes a HybridDeviceOptimizer holds: its CPU sub-optimizers' params (fp32 masters) and state,
    and the pinned grad copies it fills before each CPU step (0 without one)."""
    seen: dict[int, int] = {}
    for hdo in hybrid_optimizers(optimizer):
        tensors = [p for o in hdo.cpu_optimizers for g in o.param_groups for p in g["params"]]
        tensors += [v for o in hdo.cpu_optimizers for st in o.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
        tensors += list(getattr(hdo, "cpu_copy_map_grad", {}).values())
        for t in tensors:
            if t.device.type == "cpu" and t.untyped_storage().nbytes():
                seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: Any, exclude: set[int]) -> list[torch.Tensor]:
    """A Megatron optimizer's state and fp32 master copies, not sharing storage with ``exclude``
    (fp32 training params are their own masters). Tensors elsewhere (a swap optimizer's host
    copies, a HybridDeviceOptimizer's host masters and moments) are not ours to move."""
    return groups.optimizer_tensors(inner_optimizers(optimizer), include_params=True, exclude=exclude)


class _Memory:
    """What the actor's and the reference's memory share: their groups by role, read live."""

    engine: OffloadEngine

    def groups(self) -> dict[str, OffloadGroup]:
        raise NotImplementedError

    def resident(self) -> dict[str, int]:
        """Device bytes per group now, read from the storages."""
        return {k: g.device_bytes() for k, g in self.groups().items()}

    def locations(self) -> dict[str, Location]:
        return {k: g.location for k, g in self.groups().items()}

    def close(self) -> None:
        """Leave the switch loop, bring everything back to device and give back the host buffers."""
        live_switch().detach(self)
        for g in self.groups().values():
            if g.location is Location.HOST:
                g.onload()
            elif g.location is Location.RELEASED:
                g.allocate()
            g.close()


def _engine(engine: Any) -> OffloadEngine:
    if not isinstance(engine, OffloadEngine):
        raise TypeError(f"engine must be an OffloadEngine, got {type(engine).__name__}")
    return engine


class ActorMemory(_Memory):
    """Training params, grads and optimizer state of a Megatron actor as three offload groups
    (roles train_params, grads, optimizer); the switch loop (verl_patches.offload.live) moves them.

    ``keep_grads=False`` (the recipe): the loop releases the grads after the update and brings
    them back zeroed, as Megatron zeroes its grad buffers before every backward anyway; True
    copies them both ways. ``optimizer=None`` leaves the optimizer alone (MindSpeed's swap
    optimizer moves its own state). The optimizer group exists once Adam's state does (Adam
    creates its moments at the first step); it is regrouped while on device if the state grew.
    With megatron-core's optimizer offload (a HybridDeviceOptimizer inside) the group holds only the
    device part (its ``gpu_optimizer``'s fp32 masters and moments; none at offload fraction 1.0): the
    host masters, moments and grad copies are already where the switch would put them and are never
    moved (``host_optimizer_bytes`` counts them).
    """

    def __init__(self, modules: Any, optimizer: Any = None, *, engine: OffloadEngine, name: str = "actor",
                 keep_grads: bool = False) -> None:
        self.engine = _engine(engine)
        self.modules, self.optimizer, self.name = _chunks(modules), optimizer, name
        self.keep_grads = keep_grads
        self.params = TensorGroup(engine, f"{name}_params", param_tensors(self.modules))
        grads = grad_tensors(self.modules)
        if not grads:
            raise ValueError(f"{name}: no gradient buffer found (expected megatron-core DDP chunks with grad_data, "
                             "or parameters with main_grad / grad)")
        self.grads = TensorGroup(engine, f"{name}_grads", grads, zero_on_allocate=True)
        self._param_keys = {_storage_key(t) for t in self.params.tensors()}
        if optimizer is not None:
            inner_optimizers(optimizer)  # a clear error now rather than at the first offload
        self.opt: TensorGroup | None = None
        self._opt_keys: frozenset[int] = frozenset()
        # megatron-core's overlapped DDP (verl_patches/train/ddp_overlap.py): its DDP buckets are views of the
        # buffers moved here (resized in place, so they stay the same objects), but an asynchronous
        # reduce or gather in flight would write into a freed buffer, and parameters not gathered since
        # the last step are stale: moving them is refused, naming what is unsettled.
        self._moved = {"train_params": self.params, "grads": self.grads}
        if any(_overlapped(c) for c in self.modules):
            def check(role: str) -> Callable[[], None]:
                return lambda: check_settled(self.modules, f"{name}: moving {role}")

            self._moved = {role: HookedGroup(g, before={"offload": check(role), "release": check(role)})
                           for role, g in self._moved.items()}

    def groups(self) -> dict[str, OffloadGroup]:
        out: dict[str, OffloadGroup] = dict(self._moved)
        opt = self._optimizer_group()
        if opt is not None:
            out["optimizer"] = opt
        return out

    def _optimizer_group(self) -> TensorGroup | None:
        if self.optimizer is None:
            return None
        if self.opt is not None and self.opt.location is not Location.DEVICE:
            return self.opt
        tensors = optimizer_tensors(self.optimizer, self._param_keys)
        keys = frozenset(_storage_key(t) for t in tensors)
        if self.opt is not None and keys == self._opt_keys:
            return self.opt
        if self.opt is not None:  # the state grew (first step after a build): regroup while on device
            self.opt.close()
            self.opt = None
        if tensors:
            self.opt, self._opt_keys = TensorGroup(self.engine, f"{self.name}_optimizer", tensors), keys
        return self.opt


class ReferenceMemory(_Memory):
    """The frozen reference model (role ref_params): copied to host once, then each offload only frees it."""

    def __init__(self, modules: Any, *, engine: OffloadEngine, name: str = "ref") -> None:
        self.engine = _engine(engine)
        self.modules = _chunks(modules)
        for chunk in self.modules:
            for m in chunk.modules():
                # megatron-core's router turns its expert bias into a new fp32 tensor at its first forward
                # (Float16Module made it bf16); done now, the group registers the tensor it will keep.
                if hasattr(m, "_maintain_float32_expert_bias"):
                    m._maintain_float32_expert_bias()
        tensors = param_tensors(self.modules)
        for chunk in self.modules:  # rotary and router buffers: read-only too (nn.Module.buffers, not DDP's list)
            tensors += list(torch.nn.Module.buffers(chunk))
        self.params = TensorGroup(engine, f"{name}_params", tensors, read_only=True)

    def groups(self) -> dict[str, OffloadGroup]:
        return {"ref_params": self.params}


__all__ = ["ActorMemory", "ReferenceMemory", "grad_tensors", "host_optimizer_bytes", "hybrid_optimizers",
           "inner_optimizers", "megatron_buffers", "optimizer_tensors", "param_tensors"]

