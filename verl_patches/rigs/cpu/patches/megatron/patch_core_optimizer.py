"""megatron-core's (distributed) optimizer built and stepped with CUDA tensors made on the host (CPU platform only).

Upstream: megatron/core/optimizer/__init__.py:get_megatron_optimizer, which verl's Megatron
worker calls (verl_patches aliases it through verl.utils.megatron.optimizer). The optimizers it
builds make scalars with ``device='cuda'`` (found-inf, loss scale, grad-norm buffers) and accept
only parameters whose ``.type()`` is a CUDA type. On the host the optimizer is built, stepped,
saved and loaded under verl_patches/rigs/cpu/cuda_runtime.py:CudaOnCpu: those scalars are made on the
host and host parameters report their CUDA type. The optimizers themselves are upstream's (the
DistributedOptimizer the recipe uses, its fp32 main shards and Adam state).

Without Transformer Engine or Apex the inner optimizer is torch's AdamW, which creates its state at
its first step, and megatron-core 0.12.1 reads that state's ``step`` to build a checkpoint's state
dict: resuming into a fresh optimizer fails (``assert len(steps) == 1``). Before a sharded state
dict is built, a fresh optimizer gets AdamW's own initial state (zero moments, step 0), which the
checkpoint then overwrites. Loading has two more faults on that path: megatron-core copies every
per-parameter state key back from the checkpoint, which never holds ``step`` (kept in the param
groups), and it gives every parameter one shared ``step`` tensor, which torch's AdamW then advances
once per parameter. Loading runs with ``step`` supplied from the state itself (a copy onto itself),
and each parameter gets its own ``step`` afterwards.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

# What verl's worker and checkpoint manager call on the optimizer it got back.
HOST_METHODS = ("step", "zero_grad", "state_dict", "load_state_dict", "reload_model_params", "get_loss_scale")


def init_adam_state(optimizer) -> int:
    """Give every parameter of torch AdamW optimizers inside ``optimizer`` that has no state yet the
    state AdamW's first step would create; returns how many were initialised."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch
    from verl_patches.offload.megatron_memory import inner_optimizers

    n = 0
    for opt in inner_optimizers(optimizer):
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if state:
                    continue
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                n += 1
    return n


def unshare_steps(optimizer) -> None:
    """One ``step`` tensor per parameter: AdamW advances each in place."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.offload.megatron_memory import inner_optimizers

    for opt in inner_optimizers(optimizer):
        seen: set[int] = set()
        for state in opt.state.values():
            step = state.get("step")
            if step is not None and id(step) in seen:
                state["step"] = step.clone()
            elif step is not None:
                seen.add(id(step))


def _step_from_own_state(optimizer):
    """During a load: megatron-core's _set_main_param_and_optimizer_states copies every state key of
    a parameter from the checkpoint's tensors, which have no ``step``; it is given the state's own."""
    @contextlib.contextmanager
    def scope():
        targets = [o for o in _chained(optimizer) if hasattr(o, "_set_main_param_and_optimizer_states")]
        saved = []
        for o in targets:
            original = o._set_main_param_and_optimizer_states

            def set_states(model_param, tensors, _o=o, _original=original):
                if "step" not in tensors:
                    gi, go = _o.model_param_group_index_map[model_param]
                    own = _o.optimizer.state[_o.optimizer.param_groups[gi]["params"][go]].get("step")
                    if own is not None:
                        tensors = {**tensors, "step": own}
                return _original(model_param, tensors)

            o._set_main_param_and_optimizer_states = set_states
            saved.append(o)
        try:
            yield
        finally:
            for o in saved:
                del o._set_main_param_and_optimizer_states

    return scope()


def _chained(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def wrap_get_megatron_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_megatron_optimizer(*args, **kwargs):
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.rigs.cpu.cuda_runtime import on_host

        optimizer = on_host(original)(*args, **kwargs)
        for name in HOST_METHODS:
            method = getattr(optimizer, name, None)
            if callable(method):
                setattr(optimizer, name, on_host(method))
        build_sharded, load = optimizer.sharded_state_dict, optimizer.load_state_dict

        @on_host
        def sharded_state_dict(*a, **k):
            init_adam_state(optimizer)
            return build_sharded(*a, **k)

        @on_host
        def load_state_dict(*a, **k):
            with _step_from_own_state(optimizer):
                out = load(*a, **k)
            unshare_steps(optimizer)
            return out

        optimizer.sharded_state_dict = sharded_state_dict
        optimizer.load_state_dict = load_state_dict
        return optimizer

    return get_megatron_optimizer


PATCHES = [
    Patch(
        feature="cpu_platform",
        id="cpu.megatron.optimizer_on_host",
        target="megatron.core.optimizer:get_megatron_optimizer",
        kind="wrap",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint(
            "def get_megatron_optimizer(config: OptimizerConfig, model_chunks: List[MegatronModule], "
            "no_weight_decay_cond: Optional[Callable]=None, scale_lr_cond: Optional[Callable]=None, "
            "lr_mult: float=1.0, use_gloo_process_groups: bool=True) -> MegatronOptimizer", "cf634afbf27313d4"),
        replacement=f"{__name__}:wrap_get_megatron_optimizer",
        flag="the CPU platform (no accelerator)",
        why="megatron-core's optimizers allocate scalars on 'cuda' and accept only CUDA parameter types, so the "
            "recipe's distributed optimizer cannot be built or stepped on the host otherwise.",
        remove_when="megatron-core's optimizers allocate on the parameters' device and check dtypes, not CUDA "
                    "type names.",
        platforms=("cpu",),
    ),
]
