"""patch mindspeed.float64_all_reduce_returns: a float64 all-reduce through MindSpeed's bypass returns its result.

MindSpeed 2.2.0's wrapper reduces a float32 copy of a float64 tensor and drops the result (each rank keeps its
own values). Here the recipe's replacement wraps the real torch.distributed.all_reduce on two gloo processes (the
HCCL transport it stands in front of exists only on an NPU), and MindSpeed's own wrapper, read from its source,
shows the fault the patch removes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


RANK = r"""
import importlib.util, json, os, sys
import torch, torch.distributed as dist
rank, init, which = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if which == "ours":
    from verl_patches.patches.mindspeed.patch_core_megatron_basic_requirements_basic import \
        torch_all_reduce_double_dtype_bypass_wrapper as wrap
else:  # MindSpeed's, from its file (its package's __init__ is not imported: no torch_npu here)
    spec = importlib.util.find_spec("mindspeed")
    path = os.path.join(spec.submodule_search_locations[0], "core", "megatron_basic", "requirements_basic.py")
    module_spec = importlib.util.spec_from_file_location("_mindspeed_requirements_basic", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    wrap = module.torch_all_reduce_double_dtype_bypass_wrapper
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
all_reduce = wrap(dist.all_reduce)
t = torch.tensor([0.25 + rank, 1.0], dtype=torch.float64)
all_reduce(t)  # positional, SUM
k = torch.tensor([float(rank)], dtype=torch.float64)
if which == "ours":
    all_reduce(tensor=k, op=dist.ReduceOp.MAX)  # keyword (MindSpeed's own raises IndexError on this form)
else:
    all_reduce(k, op=dist.ReduceOp.MAX)
f = torch.tensor([float(rank + 1)], dtype=torch.float32)
all_reduce(f)  # not float64: straight through
print("RESULT " + json.dumps([str(t.dtype), t.tolist(), k.tolist(), f.tolist()]))
dist.destroy_process_group()
"""


def _run(which: str, tmp_path) -> list:
    if which == "mindspeed" and importlib.util.find_spec("mindspeed") is None:
        pytest.skip("mindspeed is not installed")
    init = f"file://{tmp_path}/store_{which}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), init, which], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:]))
    return outs


def test_ours_returns_the_reduced_float64_values_on_every_rank(tmp_path):
    for got in _run("ours", tmp_path):
        assert got == ["torch.float64", [1.5, 2.0], [1.0], [3.0]]


def test_mindspeeds_own_wrapper_drops_them(tmp_path):
    zero, one = _run("mindspeed", tmp_path)
    assert zero[1] == [0.25, 1.0] and one[1] == [1.25, 1.0]  # each rank kept its own values
    assert zero[2] == [0.0] and one[2] == [1.0]
    assert zero[3] == one[3] == [3.0]  # float32 goes through
