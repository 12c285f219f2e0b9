"""patch mindspeed.float64_all_reduce_returns: a float64 all-reduce through MindSpeed's bypass returns its result.

MindSpeed 2.2.0's wrapper reduces a float32 copy of a float64 tensor and drops the result (each rank keeps its
own values). Both wrappers are applied here to an in-place reduction standing for torch.distributed.all_reduce on
two ranks (the HCCL transport they stand in front of exists only on an NPU; a gloo pair of processes hung once in
CI while other tests had network namespaces up): MindSpeed's own, read from its source, shows the fault the patch
removes."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from verl_patches.patches.mindspeed.patch_core_megatron_basic_requirements_basic import (
    torch_all_reduce_double_dtype_bypass_wrapper as ours)

OTHER_RANK = torch.tensor([1.0, 1.0], dtype=torch.float64)  # what the other rank holds


def _sum_with_the_other_rank(tensor, op=None, group=None, async_op=False):
    """torch.distributed.all_reduce(SUM) of two ranks, as seen by this one: in place, in the tensor's dtype."""
    assert tensor.dtype != torch.float64, "the bypass hands HCCL a float32 copy"
    tensor.add_(OTHER_RANK[: tensor.numel()].to(tensor.dtype).view_as(tensor))
    return None


def _mindspeeds():
    spec = importlib.util.find_spec("mindspeed")
    if spec is None:
        pytest.skip("mindspeed is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "core", "megatron_basic", "requirements_basic.py")
    module_spec = importlib.util.spec_from_file_location("_mindspeed_requirements_basic", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)  # its package's __init__ is not imported: no torch_npu here
    return module.torch_all_reduce_double_dtype_bypass_wrapper


def test_ours_returns_the_reduced_float64_values_by_position_and_by_name():
    all_reduce = ours(_sum_with_the_other_rank)
    t = torch.tensor([0.25, 1.0], dtype=torch.float64)
    assert all_reduce(t) is None
    assert t.dtype == torch.float64 and t.tolist() == [1.25, 2.0]
    k = torch.tensor([0.5], dtype=torch.float64)
    all_reduce(tensor=k)
    assert k.tolist() == [1.5]


def test_other_dtypes_go_straight_through():
    seen = []
    all_reduce = ours(lambda tensor, **kw: seen.append(tensor) or "handle")
    f = torch.tensor([1.0], dtype=torch.float32)
    assert all_reduce(f) == "handle" and seen == [f]  # the caller's own tensor, the wrapped call's return


def test_mindspeeds_own_wrapper_drops_the_result_and_fails_by_name():
    all_reduce = _mindspeeds()(_sum_with_the_other_rank)
    t = torch.tensor([0.25, 1.0], dtype=torch.float64)
    all_reduce(t)
    assert t.tolist() == [0.25, 1.0]  # this rank's own values, silently
    with pytest.raises(IndexError):
        all_reduce(tensor=torch.tensor([0.5], dtype=torch.float64))
