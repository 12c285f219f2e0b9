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

from verl_patches.train import mismatch as M  # noqa: E402
from verl_patches.launch.local_ranks import run_distributed  # noqa: E402

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


def _reported(results, name, keys=M.MISMATCH_METRICS + (M.ENTROPY,)):
    ours = [{k: v for k, v in r[name]["metrics"].items() if k in keys} for r in results]
    assert ours[0] == ours[1], "the ranks report different figures"  # verl collects one rank's
    return {k: v[0] for k, v in ours[0].items()}


@pytest.mark.parametrize("name", ["token-mean", "dynamic"])
def test_metrics_equal_a_direct_computation_over_the_global_batch(results, name):
    # "dynamic": verl's use_dynamic_bsz split reorders the rows into micro-batches of 2 and 4; the
    # rollout's log-probs are a field of the same rows, so the figures are those of the whole batch.
    g = _global(results, name)
    m = g["mask"]
    a, r = g["log_prob"][m], g["rollout"][m]
    pd = (a.exp() - r.exp()).abs()  # verl's definition (ray_trainer.py, training/rollout_probs_diff_*)
    q = (a - r).exp()
    want = {
        M.PROBS_DIFF + "mean": pd.mean(), M.PROBS_DIFF + "max": pd.max(), M.PROBS_DIFF + "std": pd.std(),
        M.LOGPROB_DIFF + "mean": (a - r).abs().mean(), M.LOGPROB_DIFF + "max": (a - r).abs().max(),
        M.KL_K3: ((q - 1) - q.log()).mean(), M.ENTROPY: _entropy(g, "token-mean"),
    }
    got = _reported(results, name)
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


def test_the_update_reports_how_it_split_the_batch(results):
    # Fixed: 6 rows per rank in micro-batches of 2. Dynamic (18 tokens per micro-batch): verl's split
    # by tokens of the rows 9, 3, 9, 3, 9, 3 tokens long, rows [0, 2] and [1, 3, 4, 5].
    fixed = _reported(results, "token-mean", M.MICRO_METRICS)
    assert fixed == {M.MICRO_BATCHES: 3.0, M.MICRO_ROWS + "min": 2.0, M.MICRO_ROWS + "max": 2.0,
                     M.MICRO_TOKENS_MAX: 18.0}, fixed  # rows 4 and 5: 9 + 9 tokens
    dynamic = _reported(results, "dynamic", M.MICRO_METRICS)
    assert dynamic == {M.MICRO_BATCHES: 2.0, M.MICRO_ROWS + "min": 2.0, M.MICRO_ROWS + "max": 4.0,
                       M.MICRO_TOKENS_MAX: 18.0}, dynamic
    mask = _global(results, "dynamic")["mask"]
    assert int(mask.sum()) == 2 * (3 * 5 + 3 * 2)  # both ranks: three full responses, three of 2 tokens


@pytest.mark.parametrize("reuse, recompute", [("token-mean", "fixed, recomputed"), ("dynamic", "dynamic, recomputed")])
def test_reuse_takes_the_step_the_recomputed_path_takes(results, reuse, recompute):
    # verl's own path: compute_log_prob's forward (with the dynamic split, rows put back in order by verl)
    # gives old_log_probs, then the update. Under reuse the update's log_prob.detach() stands in for them:
    # the same forward on the same micro-batches, so the ratio is exactly 1 on both paths and the step
    # is the same bit for bit (SGD, fp32, CPU).
    for r in results:
        a, b = r[reuse], r[recompute]
        assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
        assert len(a["after"]) == len(b["after"])
        for x, y in zip(a["after"], b["after"]):
            assert torch.equal(x, y)
        # verl's compute_log_prob returned the rows in the batch's order (the TensorCache keeps them
        # by row): they are the policy's log-probs of each row's own response.
        d = b["direct"]
        torch.testing.assert_close(b["direct"]["old_log_probs"][d["mask"]], d["log_prob"][d["mask"]],
                                   rtol=1e-5, atol=1e-6)
