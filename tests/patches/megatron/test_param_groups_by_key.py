"""The distributed optimizer's param groups, loaded from rank 0's checkpoint, line up with each rank's.

megatron-core 0.12.1's own _get_param_groups builds the groups of two pipeline stages in different
orders (the bug), and the patch pairs the checkpoint's groups with this rank's by their key. The
end-to-end proof is the tiny run's resume check (tests/recipe/test_train_tiny.py): a resumed run
equals the uninterrupted one only with this patch.
"""

import pytest
import torch

from verl_patches.patches.megatron import patch_core_optimizer_distrib_optimizer as P


class _Chunk(torch.nn.Module):
    """A model chunk as megatron's optimizer sees it: modules plus its DDP config."""

    def __init__(self, first: str):
        super().__init__()
        from megatron.core.distributed import DistributedDataParallelConfig

        self.ddp_config = DistributedDataParallelConfig()
        if first == "embedding":  # stage 0: the embedding comes first (weight decay on)
            self.embedding = torch.nn.Embedding(8, 4)
        self.norm = torch.nn.LayerNorm(4)  # no weight decay (1-D)
        self.linear = torch.nn.Linear(4, 4, bias=False)


def _groups(first: str):
    from megatron.core.optimizer import _get_param_groups

    return _get_param_groups([_Chunk(first)], None, None, 1.0, 1e-3, 0.0, None, None)


def _saved(groups):
    """What the checkpoint's common state holds for them: torch's param groups without the params."""
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]


def test_upstream_orders_the_groups_of_two_stages_differently():
    stage0, stage1 = _groups("embedding"), _groups("norm")
    assert [g["wd_mult"] for g in stage0] == [1.0, 0.0]
    assert [g["wd_mult"] for g in stage1] == [0.0, 1.0]


def test_rank_0s_groups_are_reordered_to_this_ranks_by_key():
    saved = _saved(_groups("embedding"))
    for g, step in zip(saved, (7.0, 7.0)):
        g["step"] = step
    live = _groups("norm")
    aligned = P.align_param_groups(saved, live)
    assert [g["wd_mult"] for g in aligned] == [g["wd_mult"] for g in live] == [0.0, 1.0]
    assert aligned[0] is saved[1] and aligned[1] is saved[0]
    # Already in order: the checkpoint's list itself, untouched.
    assert P.align_param_groups(saved, _groups("embedding")) is saved


def test_the_wrapper_hands_upstream_the_aligned_groups():
    live = _groups("norm")
    self = type("DistOpt", (), {})()
    self.optimizer = torch.optim.AdamW(live, lr=1e-3)
    seen = {}

    def upstream(_self, state_dict):
        seen["groups"] = state_dict["optimizer"]["param_groups"]

    saved = _saved(_groups("embedding"))
    sd = {"optimizer": {"param_groups": saved}, "grad_scaler": None}
    P.wrap_load_state_dict(upstream)(self, sd)
    assert [g["wd_mult"] for g in seen["groups"]] == [0.0, 1.0]
    assert sd["optimizer"]["param_groups"] is saved  # the caller's dict is not modified


def test_a_group_the_checkpoint_lacks_is_named():
    saved = [g for g in _saved(_groups("embedding")) if g["wd_mult"] == 1.0]
    with pytest.raises(P.ParamGroupMismatch, match=r"lack \[wd_mult=0.0, lr_mult=1.0, is_expert_parallel=False"):
        P.align_param_groups(saved, _groups("norm"))


def test_duplicate_keys_are_refused():
    saved = _saved(_groups("embedding"))
    with pytest.raises(P.ParamGroupMismatch, match="two param groups with the same"):
        P.align_param_groups(saved + [dict(saved[0])], _groups("norm"))
