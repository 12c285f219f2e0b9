"""megatron-core's DDP built with the recipe's gradient-reduce and parameter-gather overlap.

Upstream: verl/utils/megatron_utils.py:get_model(model_provider_func, model_type, wrap_with_ddp,
use_distributed_optimizer, transformer_config) wraps every model chunk in megatron-core's
DistributedDataParallel with a config written into its body: grad_reduce_in_fp32=True, the
distributed optimizer as the worker says, overlap_grad_reduce=False and no parameter-gather
overlap; no key of verl 0.4.1's config reaches it. We wrap it: while the actor's model is built
with ``recipe.overlap_grad_reduce`` or ``recipe.overlap_param_gather`` on (patch
verl.ddp_overlap.build_model_optimizer hands them over), upstream builds the chunks without DDP (its
own ``wrap_with_ddp=False`` path: provider, tensor-parallel attributes, device, Float16Module) and
our code wraps them as upstream does (the DDP class verl imported, bucketing off for chunks after
the first, parameters broadcast over the data-parallel group) with the config
verl_patches/train/ddp_overlap.py derives, then sets the model config's no_sync_func / grad_sync_func /
param_sync_func as megatron's training loop does. Both keys off, or wrap_with_ddp=False (the
reference), or another worker: upstream runs unchanged.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.train.ddp_overlap import FLAG, OVERLAP, REMOVE_WHEN, ddp_config_values, mark_gathered, wire_sync_funcs


def wrap_chunks_with_ddp(chunks: list[Any], overlap: Any, use_distributed_optimizer: Any) -> list[Any]:
    """Our DDP wrapping of upstream's unwrapped chunks (see the module docstring)."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl.utils import megatron_utils as mu

    values = ddp_config_values(overlap, use_distributed_optimizer=use_distributed_optimizer, num_chunks=len(chunks))
    config = chunks[0].config  # one TransformerConfig for every chunk, as upstream passes it
    out = [mu.DDP(config=config, module=chunk, disable_bucketing=i > 0,
                  ddp_config=mu.DistributedDataParallelConfig(**values)) for i, chunk in enumerate(chunks)]
    for chunk in out:
        chunk.broadcast_params()
    mark_gathered(out)
    wire_sync_funcs(mu.get_model_config(out[0]), out)
    return out


def wrap_get_model(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_model(*args, **kwargs):
        overlap = OVERLAP.get()
        if overlap is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if not bound.arguments["wrap_with_ddp"]:
            return original(*args, **kwargs)
        bound.arguments["wrap_with_ddp"] = False
        chunks = original(*bound.args, **bound.kwargs)
        return wrap_chunks_with_ddp(list(chunks), overlap, bound.arguments["use_distributed_optimizer"])

    return get_model


PATCHES = [
    Patch(
        id="verl.ddp_overlap.get_model",
        target="verl.utils.megatron_utils:get_model",
        kind="wrap", phases=("worker",), upstream="verl", versions="==0.4.1", feature="model_layout", flag=FLAG,
        fingerprint=Fingerprint(signature="def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, "
                                          "wrap_with_ddp=True, use_distributed_optimizer=True, transformer_config=None)",
                                source_sha="3efb563d7c1c6c54"),
        replacement=f"{__name__}:wrap_get_model",
        why="The reference trains with megatron's DDP overlap_grad_reduce=true and overlap_param_gather=true; verl "
            "0.4.1 writes overlap_grad_reduce=False into get_model and never sets the schedules' no_sync / grad_sync "
            "/ param_sync hooks (docs/RECIPE.md parity rows 66-67, docs/DESIGN.md).",
        remove_when=REMOVE_WHEN,
        requires=("verl.ddp_overlap.build_model_optimizer",),
    ),
]
