"""What the driver and the workers agree on when the TensorCache is on: the meta_info key that
carries a request or a reply, the row-id column, and which batch keys each stage reads.
"""

from __future__ import annotations

# meta_info key of a TensorCache request (driver -> workers) and of the reply (workers -> driver).
META_KEY = "verl_patches.tensor_cache"
# Batch column the driver keeps next to its host fields: the global row id of each sequence in the
# generation layout. It follows every reorder the trainer makes (batch balancing), so the workers
# can fetch exactly the rows of the driver's current order.
ROW_KEY = "verl_patches_row"

# What the host computes on after generation: the reward manager decodes prompts and responses and
# counts valid tokens with the attention mask; response_mask, token counts and metrics come from
# the same three. input_ids, position_ids and rollout log-probs stay on the devices.
HOST_KEYS_FROM_GENERATION = ("prompts", "responses", "attention_mask")

_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")
# Batch keys each worker stage reads (MegatronPPOActor.compute_log_prob / make_minibatch_iterator).
STAGE_INPUTS = {
    "compute_log_prob": _MODEL_INPUTS,
    "compute_ref_log_prob": _MODEL_INPUTS,
    # rollout_log_probs (rollout.calculate_log_probs=True): the update compares them with its own
    # log-probs under old log-prob reuse (verl_patches/train/mismatch.py).
    "update_actor": _MODEL_INPUTS + ("old_log_probs", "advantages", "ref_log_prob", "rollout_log_probs"),
}
# Non-tensor keys the workers read (multi-modal models); everything else stays on the host.
WORKER_NON_TENSOR_KEYS = ("multi_modal_inputs",)
