"""DeepSeek-V3's TransformerConfig: what verl 0.4.1's converter leaves out, added under the user's overrides.

Upstream: verl/models/mcore/registry.py:hf_to_mcore_config, the one entry point the Megatron worker
(and get_mcore_weight_converter) use; it dispatches through a dict that holds
config_converter.hf_to_mcore_config_dpskv3 itself, so wrapping the converter function would not
reach it. For DeepseekV3ForCausalLM we pass verl_patches.config.megatron_args.deepseek_v3_overrides
(group-limited routing n_group / topk_group, the RoPE type when the config names it rope_type)
as keyword overrides, with the caller's own override_transformer_config entries winning; the
converter's MLA, sigmoid router, expert bias, shared experts, moe_layer_freq from
first_k_dense_replace, grouped GEMM and alltoall dispatcher are right and stay as they are.

Entropy from the update's own forward (old log-prob reuse): verl/models/mcore/registry.py:
get_mcore_forward_fn hands MegatronPPOActor's forward_step the model's forward function (looked up
at each micro-batch as ``verl.models.mcore.get_mcore_forward_fn``); that function calls the actor's
logits_processor on the last pipeline stage's logits and maps its outputs back to [batch, sequence].
While an update under reuse is measuring (an UpdateProbe is active), we hand out a forward whose
logits_processor also returns verl's vocab_parallel_entropy of the same logits, without autograd and
in chunks of tokens, so the entropy gets exactly the layout of the log-probs; the forward then takes
it out of the outputs and leaves it for the loss of the same micro-batch. It is computed before the
actor's processor runs, because megatron-core's vocab_parallel_cross_entropy overwrites fp32 logits
with their softmax in place. The actor's own entropy (entropy_coeff != 0) keeps its key and gradient.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.config.megatron_args import deepseek_v3_overrides, merge_overrides
from verl_patches.train.old_log_prob import active_probe

ARCH = "DeepseekV3ForCausalLM"
# Our output of the actor's logits_processor (verl's own "entropy", computed when entropy_coeff != 0,
# keeps its gradient and its key).
ENTROPY_KEY = "verl_patches_entropy"


def _with_entropy(logits_processor: Callable[..., Any]) -> Callable[..., Any]:
    def logits_processor_with_entropy(logits, *args, **kwargs):
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy
        from verl_patches.train.mismatch import chunked_entropy

        # Before the processor: megatron-core's vocab_parallel_cross_entropy turns fp32 logits into
        # their softmax in place (Float16Module hands the last stage fp32 logits).
        entropy = chunked_entropy(logits, vocab_parallel_entropy)
        ret = dict(logits_processor(logits, *args, **kwargs))
        ret[ENTROPY_KEY] = entropy
        return ret

    return logits_processor_with_entropy


def _forward_with_entropy(forward_fn: Callable[..., Any], probe: Any) -> Callable[..., Any]:
    @functools.wraps(forward_fn)
    def forward(*args, logits_processor=None, **kwargs):
        if logits_processor is None:
            return forward_fn(*args, logits_processor=logits_processor, **kwargs)
        output = forward_fn(*args, logits_processor=_with_entropy(logits_processor), **kwargs)
        if isinstance(output, dict) and ENTROPY_KEY in output:  # the last pipeline stage
            probe.put_entropy(output.pop(ENTROPY_KEY))
        return output

    return forward


def wrap_get_mcore_forward_fn(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_mcore_forward_fn(hf_config):
        forward_fn = original(hf_config)

        probe = active_probe()
        return forward_fn if probe is None else _forward_with_entropy(forward_fn, probe)

    return get_mcore_forward_fn


def wrap_hf_to_mcore_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def hf_to_mcore_config(hf_config, dtype, **override_transformer_config_kwargs):
        if list(getattr(hf_config, "architectures", None) or []) != [ARCH]:
            return original(hf_config, dtype, **override_transformer_config_kwargs)

        ours = deepseek_v3_overrides(hf_config.to_dict())
        return original(hf_config, dtype, **merge_overrides(override_transformer_config_kwargs, ours))

    return hf_to_mcore_config


PATCHES = [
    Patch(
        feature="model_layout",
        id="verl.mcore_config.deepseek_v3",
        target="verl.models.mcore.registry:hf_to_mcore_config",
        kind="wrap",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint(
            signature="def hf_to_mcore_config(hf_config: PretrainedConfig, dtype: torch.dtype, "
                      "**override_transformer_config_kwargs) -> TransformerConfig",
            source_sha="db9da8c97878a099"),
        replacement=f"{__name__}:wrap_hf_to_mcore_config",
        flag="always on for DeepseekV3ForCausalLM; any key in actor.megatron.override_transformer_config wins",
        why="DeepSeek-V3 routes each token to 8 experts inside 4 of 8 expert groups (n_group / topk_group); "
            "verl 0.4.1 drops the groups, so the trained router differs from the model's and from vLLM's.",
        remove_when="verl's hf_to_mcore_config_dpskv3 sets moe_router_num_groups / moe_router_group_topk "
                    "(later verl releases do) and reads rope_type.",
    ),
    Patch(
        feature="old_log_prob_reuse",
        id="verl.old_log_prob.entropy",
        requires=("verl.old_log_prob.update_policy",),
        target="verl.models.mcore.registry:get_mcore_forward_fn",
        kind="wrap",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint(signature="def get_mcore_forward_fn(hf_config: PretrainedConfig) -> Callable",
                                source_sha="b55b2760a10acd5a"),
        replacement=f"{__name__}:wrap_get_mcore_forward_fn",
        flag="actor_rollout_ref.actor.recompute_old_log_prob=False (acts only inside the update's measurement)",
        why="verl 0.4.1 measures actor/entropy in the old-log-prob forward, which reuse skips; the update's forward "
            "sees the same logits. The forward function is the one seam where an extra output of the actor's "
            "logits_processor is mapped back to [batch, sequence] like the log-probs (the processor is a closure "
            "inside forward_step).",
        remove_when="verl's actor reports the entropy of its update forward (later verl releases compute it in "
                    "the update when entropy is requested), or reuse is dropped.",
    ),
]
