"""megatron-core's DDP gradient-reduce and parameter-gather overlap, wired by the overlay's patches into verl
0.4.1's real get_model and update_policy, on a real megatron-core 0.12.1 GPTModel with its real
DistributedOptimizer over 2 gloo ranks (stand-ins declared in ddp_overlap_rank.py).

Each configuration runs 2 updates of 2 optimizer steps (mini-batches) of 2 micro-batches each:
- the losses, the gradient buffers after every backward and the parameters after every update are
  bit-identical with the overlap and without it: the same collectives run on the same bytes (the
  same buckets, reduce-scatter and all-gather), only launched earlier or later;
- the overlap engaged: every gradient reduce was launched asynchronously from DDP's backward hooks
  while autograd's backward was running (one per bucket and step: no_sync held the first micro-batch's);
  after each step but the update's last, the next forward's pre-hooks gathered the parameters
  asynchronously (before that forward the other ranks' shards were stale, after it they were new);
  the gather of the update's last step was finished when update_policy returned;
- the switch's moves (params and optimizer to host and back, grads released and re-allocated)
  between updates leave the buckets the same objects, views of the same buffers, and training
  bit-identical; moving params or grads with a gather in flight or stale parameters is refused
  by name, and overlap_param_gather without the distributed optimizer too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_overlap_rank as R  # noqa: E402

from verl_patches.launch.local_ranks import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow  # two spawned processes

WORLD = 2


@pytest.fixture(scope="module")
def res():
    return run_distributed(R.run_all, WORLD, timeout=240, env={"VERL_PATCHES_DEVICE": "cpu"})


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_configs_are_what_the_recipe_asked_for(res):
    for r in res:
        assert r["off"]["ddp"] == {"overlap_grad_reduce": False, "overlap_param_gather": False,
                                   "align_param_gather": False, "use_distributed_optimizer": True}
        assert r["on"]["ddp"] == {"overlap_grad_reduce": True, "overlap_param_gather": True,
                                  "align_param_gather": False, "use_distributed_optimizer": True}
        assert r["off"]["hooks"] == {"no_sync_func": False, "grad_sync_func": False, "param_sync_func": False}
        assert r["on"]["hooks"] == {"no_sync_func": True, "grad_sync_func": True, "param_sync_func": False}
        assert r["off"]["forward_pre_hooks"] == 0 and r["on"]["forward_pre_hooks"] > 0


@pytest.mark.parametrize("run", ["on", "on_offload"])
def test_bit_identical_to_training_without_overlap(res, run):
    for r in res:
        off, on = r["off"], r[run]
        assert len(off["losses"]) == R.UPDATES * R.MINI * R.MICRO
        assert on["losses"] == off["losses"]
        assert _same(on["grads"], off["grads"])
        assert _same(on["params"], off["params"])
    # Data parallel: the ranks saw different tokens, and hold the same parameters after each update.
    assert res[0]["off"]["losses"] != res[1]["off"]["losses"]
    assert _same(res[0][run]["params"], res[1][run]["params"])
    # And training moved them.
    assert not torch.equal(res[0]["off"]["params"][0], res[0]["off"]["params"][1])


def test_the_gradient_reduce_was_launched_from_the_backward_hooks(res):
    for r in res:
        on = [e for e in r["on"]["events"] if e["op"] == "grad_reduce"]
        assert len(on) == R.UPDATES * R.MINI * r["on"]["buckets"]
        assert all(e["in_backward"] and e["async"] and e["phase"] == "forward_backward" for e in on)
        # Without the overlap megatron reduces synchronously in finalize_model_grads, after the backward.
        off = [e for e in r["off"]["events"] if e["op"] == "grad_reduce"]
        assert off and not any(e["in_backward"] or e["async"] for e in off)


def test_the_parameter_gather_overlapped_the_next_forward_and_was_finished_by_the_update(res):
    for r in res:
        on, off = r["on"], r["off"]
        gathers = [e for e in on["events"] if e["op"] == "param_gather"]
        in_forward = [e for e in gathers if e["phase"] == "forward_backward"]
        # One asynchronous gather per bucket group in the forward after each step but an update's last ...
        assert len(in_forward) == R.UPDATES * (R.MINI - 1) * on["buckets"]
        assert all(e["async"] and not e["force_sync"] for e in in_forward)
        # ... and the last step's, finished synchronously when update_policy returned.
        finished = [e for e in gathers if e["phase"] == "idle"]
        assert len(finished) == R.UPDATES * on["buckets"] and all(e["force_sync"] for e in finished)
        # Before the forward after a step the other ranks' shards were due (stale), after it they were new.
        assert on["due_before_forward"] == [False, True] * R.UPDATES
        assert on["forward_gathered_others"] == [False, True] * R.UPDATES
        # Without the overlap the step gathers: nothing is ever due before a forward.
        assert off["due_before_forward"] == [False] * (R.UPDATES * R.MINI)
        assert off["forward_gathered_others"] == [False] * (R.UPDATES * R.MINI)
        assert not [e for e in off["events"] if e["op"] == "param_gather" and e["phase"] == "forward_backward"]


def test_the_switch_moves_keep_the_buckets(res):
    for r in res:
        trips = r["on_offload"]["round_trips"]
        assert len(trips) == R.UPDATES
        for t in trips:
            assert t == {"freed": True, "same_bucket_objects": True, "aliased": True, "params_back": True,
                         "hooked": "HookedGroup"}


def test_unsettled_communication_is_refused_by_name(res):
    for r in res:
        g = r["guards"]
        assert "parameters not gathered since the last optimizer step" in g["stale"]
        assert "a parameter all-gather is in flight" in g["in_flight"]
        assert "moving grads" in g["grads_release"]
        assert g["after_completion"] == "moved"
        assert "overlap_param_gather needs actor_rollout_ref.actor.megatron.use_distributed_optimizer=True" \
            in g["no_distopt"]
