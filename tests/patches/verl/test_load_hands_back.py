"""patch verl.model.load_hands_back: what megatron-core's dist_checkpointing.load returns goes back into the model.

The end-to-end case (MindSpeed's GroupedMLP experts, a ShardedTensorFactory, loaded from the tiny assets'
checkpoint through verl's worker build) is tests/npu_rehearsal/test_platform.py
(test_the_npu_model_loads_the_tiny_assets_mindspeed_llm_checkpoint). Here: which entries are copied, and the
refusals."""

from __future__ import annotations

import pytest
import torch

from verl_patches.patches.verl.patch_utils_model import CheckpointLoadError, hand_back


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 3))
        self.v = torch.nn.Parameter(torch.zeros(4))
        self.register_buffer("b", torch.zeros(1))


def test_returned_copies_are_handed_back_and_tensors_loaded_in_place_are_left():
    m = Tiny()
    in_place = m.v.data  # as dist_checkpointing.load fills a ShardedTensor's own data
    in_place.fill_(7.0)
    built = torch.arange(6.0).view(2, 3)  # as a factory's merge returns a new tensor
    n = hand_back(m, {"w": built, "v": in_place, "b": torch.ones(1), "w._extra_state": object(), "x._extra_state": None})
    assert n == 2
    assert torch.equal(m.w.detach(), built) and m.w.data_ptr() != built.data_ptr()
    assert torch.equal(m.v.detach(), torch.full((4,), 7.0)) and torch.equal(m.b, torch.ones(1))


def test_a_returned_key_the_model_lacks_is_refused_naming_it():
    with pytest.raises(CheckpointLoadError, match=r"'decoder.other.weight'.*another layer spec"):
        hand_back(Tiny(), {"decoder.other.weight": torch.zeros(1)})


def test_a_returned_shape_that_differs_is_refused_naming_both():
    m = Tiny()
    with pytest.raises(CheckpointLoadError, match=r"'w' of shape \(3, 2\), the model's is \(2, 3\)"):
        hand_back(m, {"w": torch.zeros(3, 2)})
    assert not m.w.detach().any()
