"""vLLM's per-forward "tokens on each DP rank" all-reduce on the device group instead of gloo.

Upstream: vllm/forward_context.py:DPMetadata.num_tokens_across_dp all-reduces a CPU int32
vector on get_dp_group().cpu_group before every forward with DP > 1 (GPUModelRunner's DP
padding, set_forward_context). vLLM-Ascend's model runner has its own agreement (see
patches/vllm_ascend/patch_worker_model_runner_v1.py); this one serves CUDA. We wrap it: with
the flag on, the same SUM runs on the DP coordinator's device group and the result comes back
as the CPU tensor callers expect.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def wrap_num_tokens_across_dp(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def num_tokens_across_dp(num_tokens: int, dp_size: int, dp_rank: int):
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.rollout.dp_sync import tokens_across_dp, vllm_device_dp_group

        target = vllm_device_dp_group(dp_size)
        if target is None:
            return original(num_tokens, dp_size, dp_rank)
        return tokens_across_dp(num_tokens, dp_size, dp_rank, *target)

    return num_tokens_across_dp


PATCHES = [
    Patch(
        feature="dp_domain",
        id="vllm.dp_sync.tokens_on_device",
        target="vllm.forward_context:DPMetadata.num_tokens_across_dp",
        kind="wrap",
        # engine_core too: with vLLM's own engine process and TP 1 the model runner lives there.
        phases=("worker", "engine_core"),
        upstream="vllm",
        versions="==0.9.1",
        fingerprint=Fingerprint(
            signature="def num_tokens_across_dp(num_tokens: int, dp_size: int, dp_rank: int) -> torch.Tensor",
            source_sha="96a1528b91daae53",
        ),
        replacement=f"{__name__}:wrap_num_tokens_across_dp",
        flag="actor_rollout_ref.rollout.recipe.dp_sync_on_device (default True; exported as "
             "VERL_PATCHES_DP_SYNC_ON_DEVICE=0/1)",
        why="With DP > 1 every forward (each decode step) all-reduces the per-rank token counts on gloo; on the "
            "device communicator the agreement costs a fraction (docs/RECIPE.md item 6). This is the CUDA path; "
            "vLLM-Ascend agrees in its model runner instead.",
        remove_when="vLLM performs the DP token-count agreement on the device group (later vLLM releases move "
                    "it to the device when the platform supports it).",
    ),
]
