"""verl_patches/train/mismatch.py: the per-micro-batch statistics merged on the device equal a direct
computation over all tokens (mask, unbiased std, max, k3, entropy per loss_agg_mode, verl's own
agg_loss for the latter); the entropy hand-over between forward and loss refuses out-of-order use."""

from __future__ import annotations

import math

import pytest
import torch

from verl_patches.train import mismatch as M


def _micro_batches(seed=0, n=3, b=4, r=7, s=11):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = -torch.rand(b, r, generator=g) * 4
        rollout = a + 0.5 * torch.randn(b, r, generator=g)
        mask = torch.ones(b, r, dtype=torch.bool)
        lengths = torch.randint(1, r + 1, (b,), generator=g)
        for i, n_tok in enumerate(lengths):
            mask[i, n_tok:] = False
        rollout = rollout.masked_fill(~mask, -1.0)  # verl pads the rollout's log-probs with -1
        a = a.masked_fill(~mask, 0.0)  # verl's log-probs are 0 beyond the response
        entropy = torch.rand(b, s, generator=g) * 3  # [B, prompt + response], as the forward gives it
        out.append((a, rollout, mask, entropy))
    return out


def _probe(batches, mode="token-mean", compare=True):
    p = M.UpdateProbe(compare, mode)
    for a, r, m, e in batches:
        p.put_entropy(e)
        p.add(a, m, p.take_entropy(m.shape[-1]), rollout_log_prob=r if compare else None, loss_agg_mode=mode)
    return p


def _direct(batches):
    a = torch.cat([x[0] for x in batches])
    r = torch.cat([x[1] for x in batches])
    m = torch.cat([x[2] for x in batches])
    pd = (a.exp() - r.exp()).abs()[m]
    d = (a - r)[m]
    q = d.exp()
    return {M.PROBS_DIFF + "mean": pd.mean(), M.PROBS_DIFF + "max": pd.max(), M.PROBS_DIFF + "std": pd.std(),
            M.LOGPROB_DIFF + "mean": d.abs().mean(), M.LOGPROB_DIFF + "max": d.abs().max(),
            M.KL_K3: ((q - 1) - q.log()).mean()}


def test_merged_micro_batches_equal_the_direct_computation():
    batches = _micro_batches()
    got = _probe(batches).reduce()
    for k, v in _direct(batches).items():
        assert got[k] == pytest.approx(float(v), rel=1e-5, abs=1e-7), k
    # The mask matters: unmasked, the padded -1 rollout log-probs change the figures.
    unmasked = [(a, r, torch.ones_like(m), e) for a, r, m, e in batches]
    assert _probe(unmasked).reduce()[M.PROBS_DIFF + "mean"] != pytest.approx(got[M.PROBS_DIFF + "mean"], rel=1e-3)


def test_ranks_combine_like_one_batch():
    """Per-rank statistics stacked (what the all_gather gives) combine to the figures of all tokens."""
    batches = _micro_batches(seed=1, n=4)
    ranks = [_probe(batches[:1]), _probe(batches[1:3]), _probe(batches[3:])]
    rows = torch.stack([p.local_stats() for p in ranks]).double()
    got = M.metrics_from(rows, True, "token-mean")
    want = _probe(batches).reduce()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6), k
    for k, v in _direct(batches).items():
        assert got[k] == pytest.approx(float(v), rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("mode", M.AGG_MODES)
def test_entropy_is_verl_agg_loss_over_the_batch(mode):
    from verl.trainer.ppo.core_algos import agg_loss

    batches = _micro_batches(seed=2)
    m = torch.cat([x[2] for x in batches])
    r = m.shape[-1]
    ent = torch.cat([x[3][:, -r - 1:-1] for x in batches])  # the response positions, as verl slices
    want = float(agg_loss(loss_mat=ent, loss_mask=m.float(), loss_agg_mode=mode))
    assert _probe(batches, mode).reduce()[M.ENTROPY] == pytest.approx(want, rel=1e-6)


def test_k3_is_zero_when_the_policies_agree_and_nonnegative_per_token():
    a, _, m, e = _micro_batches(seed=3, n=1)[0]
    got = _probe([(a, a.clone(), m, e)]).reduce()
    assert got[M.KL_K3] == 0.0 and got[M.PROBS_DIFF + "max"] == 0.0 and got[M.LOGPROB_DIFF + "max"] == 0.0
    # Tiny differences: about d^2 / 2 per token, computed in float32 (expm1(d) - d).
    near = a + 1e-4
    dd = (near - a).double()[m]  # the differences float32 really holds
    got = _probe([(near, a, m, e)]).reduce()
    assert got[M.KL_K3] == pytest.approx(float((torch.expm1(dd) - dd).mean()), rel=5e-3)


def test_without_rollout_log_probs_only_the_entropy():
    got = _probe(_micro_batches(), compare=False).reduce()
    assert set(got) == {M.ENTROPY} and math.isfinite(got[M.ENTROPY])


def test_no_response_token_is_nan_not_zero():
    a, r, m, e = _micro_batches(n=1)[0]
    got = _probe([(a, r, torch.zeros_like(m), e)]).reduce()
    assert all(math.isnan(v) for v in got.values())


def test_entropy_hand_over_refuses_out_of_order_use():
    p = M.UpdateProbe(True, "token-mean")
    with pytest.raises(M.MismatchError, match="verl.old_log_prob.entropy"):
        p.take_entropy(3)
    p.put_entropy(torch.zeros(2, 5))
    with pytest.raises(M.MismatchError, match="verl.old_log_prob.policy_loss"):
        p.put_entropy(torch.zeros(2, 5))
    with pytest.raises(M.MismatchError, match="expected .batch, prompt . response. with a response of 7"):
        p.take_entropy(7)
    with pytest.raises(M.MismatchError, match="received none"):
        p.add(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    with pytest.raises(M.MismatchError, match="aggregates with 'seq-mean-token-sum'"):
        p.add(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), "seq-mean-token-sum")
    with pytest.raises(ValueError, match="loss_agg_mode 'mean'"):
        M.UpdateProbe(True, "mean")


def test_chunked_entropy_equals_one_pass():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 37, 19, generator=g, requires_grad=True)

    def entropy(x):
        logp = torch.log_softmax(x, -1)
        return -(logp.exp() * logp).sum(-1)

    got = M.chunked_entropy(logits, entropy, chunk=8)
    assert got.shape == (1, 37) and not got.requires_grad
    torch.testing.assert_close(got, entropy(logits.detach()), rtol=0, atol=0)


def test_the_split_is_reported_and_combines_over_ranks():
    # Rank 0 ran micro-batches of 2 and 4 rows (verl's dynamic split), rank 1 three of 2 (a smaller batch
    # on a rank cannot happen with verl's equal chunks, but the combination must not care).
    batches = _micro_batches()
    ranks = [_probe(batches[:1]), _probe(batches[1:])]
    ranks[0].note_split([2, 4], torch.tensor(18))
    ranks[1].note_split([2, 2, 2], torch.tensor(11))
    rows = torch.stack([torch.cat([p.local_stats(), p.local_split()]) for p in ranks]).double()
    got = M.metrics_from(rows, True, "token-mean")
    assert {k: got[k] for k in M.MICRO_METRICS} == {
        M.MICRO_BATCHES: 3.0, M.MICRO_ROWS + "min": 2.0, M.MICRO_ROWS + "max": 4.0, M.MICRO_TOKENS_MAX: 18.0}
    # The split's slots change none of the other figures.
    plain = M.metrics_from(torch.stack([p.local_stats() for p in ranks]).double(), True, "token-mean")
    assert {k: v for k, v in got.items() if k not in M.MICRO_METRICS} == plain
    # One rank's reduce reports its own split.
    assert ranks[0].reduce()[M.MICRO_ROWS + "max"] == 4.0


def test_a_second_split_in_one_update_adds_up_and_bad_splits_are_refused():
    p = M.UpdateProbe(False, "token-mean")
    p.note_split([3, 5], torch.tensor(40))
    p.note_split([1, 7], torch.tensor(30))
    assert [float(x) for x in p.local_split()] == [4.0, 1.0, 7.0, 40.0]
    with pytest.raises(M.MismatchError, match="at least one"):
        p.note_split([], torch.tensor(0))
    with pytest.raises(M.MismatchError, match="at least one"):
        p.note_split([4, 0], torch.tensor(9))
