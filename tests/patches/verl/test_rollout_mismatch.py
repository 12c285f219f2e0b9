"""Rollout-vs-train mismatch and entropy under old log-prob reuse, through verl 0.4.1's real update:
MegatronPPOActor.make_minibatch_iterator / update_policy / forward_backward_batch (forward_step,
logits_processor, loss_func), gptmodel_forward with packed sequences and megatron-core's schedule,
on 2 gloo ranks (data parallel 2). The metrics every rank reports equal a direct computation over
both ranks' batches; a missing wrapper stops the update before the optimizer step, naming itself.
Stand-ins: listed in mismatch_rank.py (the model is a two-matrix torch policy).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mismatch_rank  # noqa: E402

from verl_patches import mismatch as M  # noqa: E402
from verl_patches.launch import run_distributed  # noqa: E402

# Multi-process: the slow tier (README: fast tier = -m 'not slow').
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results():
    return run_distributed(mismatch_rank.all_scenarios, 2, timeout=400)


def _global(results, name):
    """Both ranks' chunks, concatenated: the batch the metrics are about."""
    d = [r[name]["direct"] for r in results]
    return {k: torch.cat([x[k] for x in d]) for k in d[0]}


def _entropy(g, mode):
    from verl.trainer.ppo.core_algos import agg_loss

    return float(agg_loss(loss_mat=g["entropy"], loss_mask=g["mask"].float(), loss_agg_mode=mode))


def _reported(results, name):
    ours = [{k: v for k, v in r[name]["metrics"].items() if k in M.MISMATCH_METRICS + (M.ENTROPY,)} for r in results]
    assert ours[0] == ours[1], "the ranks report different figures"  # verl collects one rank's
    return {k: v[0] for k, v in ours[0].items()}


def test_metrics_equal_a_direct_computation_over_the_global_batch(results):
    g = _global(results, "token-mean")
    m = g["mask"]
    a, r = g["log_prob"][m], g["rollout"][m]
    pd = (a.exp() - r.exp()).abs()  # verl's definition (ray_trainer.py, training/rollout_probs_diff_*)
    q = (a - r).exp()
    want = {
        M.PROBS_DIFF + "mean": pd.mean(), M.PROBS_DIFF + "max": pd.max(), M.PROBS_DIFF + "std": pd.std(),
        M.LOGPROB_DIFF + "mean": (a - r).abs().mean(), M.LOGPROB_DIFF + "max": (a - r).abs().max(),
        M.KL_K3: ((q - 1) - q.log()).mean(), M.ENTROPY: _entropy(g, "token-mean"),
    }
    got = _reported(results, "token-mean")
    assert set(got) == set(want)
    for k, v in want.items():
        # fp32 on both sides, sums in another order (per micro-batch, then per rank).
        assert got[k] == pytest.approx(float(v), rel=1e-5, abs=1e-6), k
    # The mask is honoured: padded positions hold -1 rollout log-probs that would change every figure.
    assert int(m.sum()) < m.numel()


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_entropy_is_aggregated_as_verl_aggregates_it(results, mode):
    got = _reported(results, mode)
    assert got[M.ENTROPY] == pytest.approx(_entropy(_global(results, mode), mode), rel=1e-5)


def test_without_rollout_log_probs_only_the_entropy(results):
    got = _reported(results, "no rollout log-probs")
    assert set(got) == {M.ENTROPY}
    assert got[M.ENTROPY] == pytest.approx(_entropy(_global(results, "no rollout log-probs"), "token-mean"), rel=1e-5)


@pytest.mark.parametrize("left_out,needle", [
    # Caught at the second micro-batch's forward: the first one's entropy was never taken by its loss.
    ("verl.old_log_prob.policy_loss", "did not run through patch verl.old_log_prob.policy_loss"),
    ("verl.old_log_prob.entropy", "did not go through patch verl.old_log_prob.entropy"),
    # Nothing intercepted at all: the check between the micro-batches and the optimizer step.
    ("verl.old_log_prob.policy_loss and verl.old_log_prob.entropy",
     "3 micro-batch loss(es) ran but 0 went through the substitution (patch verl.old_log_prob.policy_loss)"),
])
def test_a_missing_wrapper_stops_the_update_before_the_optimizer_step(results, left_out, needle):
    for r in results:
        res = r[f"without {left_out}"]
        assert "MismatchError" in res.get("error", "") and needle in res["error"], res
        assert res["stepped"] is False  # the weights did not move
