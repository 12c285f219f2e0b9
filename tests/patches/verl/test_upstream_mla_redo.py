"""verl's own reshard (recipe.reshard_method=upstream) gets MLA's post-load redo whether or not the
training params are still on the device when verl wakes the KV cache. Without the switch loop and
with verl's param offload on they are not (verl offloads them first): the self-check cannot run then,
but W_UK_T / W_UV must still be re-derived from the new kv_b_proj, or the rollout decodes with the
initial weights' MLA tensors.

Stand-ins, declared: the sharding manager (only offload_param and the stash are read on this path)
and the model (one parameter, for its dtype); MLA's redo is recorded, not run (no vLLM model here)."""

from __future__ import annotations

import types

import torch

from verl_patches.patches.verl import patch_workers_sharding_manager_megatron_vllm as sm


def test_mla_is_redone_when_the_training_params_are_offloaded(monkeypatch):
    from verl_patches.rollout import mla

    redone = []
    monkeypatch.setattr(mla, "redo_mla_post_load", lambda model, dtype: redone.append(dtype) or 0)
    manager = types.SimpleNamespace(offload_param=True)  # no switch loop: no actor memory stashed
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert sm.upstream_self_check(manager, settings=None, model=model) == {}  # nothing to check against
    assert redone == [torch.bfloat16]
