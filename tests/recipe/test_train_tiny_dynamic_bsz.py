"""The tiny run (scripts/train_tiny.sh: verl's trainer with every patch, CPU platform) with dynamic
batch sizes: ``actor.use_dynamic_bsz=True`` and ``actor.ppo_max_token_len_per_gpu`` at its smallest,
one padded sequence (prompt 384 + response 16 = 400 tokens). verl then splits each rank's 32
sequences (DP1: the whole batch of 8 prompts x 4) by token count, rows reordered
(rearrange_micro_batches), in the update and in the reference's log-prob forward (ref's
log_prob_* settings follow the actor's in verl's YAML); the fixed-size run cuts 4 micro-batches of 8.

What it shows, with the overlay's TensorCache, old log-prob reuse and direct reshard on:
- the split really varied: the update reports it (actor/micro_batch*: verl_patches/train/mismatch.py),
  with the number of micro-batches verl's rule gives for the step's tokens, of unequal sizes;
- the rows stayed together: the rollout-vs-update log-prob comparison (which under reuse compares
  each micro-batch's own rows with what the rollout computed for them) stays within the bounds of
  the fixed-size run, and the KL to the reference at step 1 (same weights; the reference's
  log-probs came back through verl's reordering and the TensorCache's rows) is as small as there;
- it learns as the fixed-size run does: the toy reward rises by the same margin over the same 6 steps.
Why the same bounds and not the fixed run's numbers: the same data, seeds, weights and rollouts, but
the update's gradient is another sum: Megatron averages each micro-batch's token-mean loss over the
micro-batches, so with unequal micro-batches the tokens weigh differently, and bf16 sums run in
another order. The run is not bit-equal to the fixed one, so it is held to what the fixed one is held to.

Measured (6 steps): 5 micro-batches of 6 or 7 sequences every step (about 1,900 tokens a step, up to
418 in one micro-batch), the KL at step 1 0, the toy reward 0.09 -> 0.37.

The same run then carries the weight-fingerprint faults (test-only VERL_PATCHES_INJECT_FAULT,
verl_patches/reshard/faults.py), applied right after step 7's reshard: one bit of one parameter
flipped on rollout rank 1, and a routed-expert w13 stack written transposed on rank 2 (the shape of
vLLM-Ascend's extra transpose in wake_up). The fingerprint must stop verl's trainer at step 7, naming
the step, both ranks and both parameters, after 6 clean steps each checked. Each fault alone is caught
on 8 ranks over several layouts in tests/reshard/test_fingerprint.py.
CI cost: one run of 7 steps without validation (a trainer start is most of a tiny run's cost, so the
faults ride on this run instead of a run of their own), the tiny assets shared with test_train_tiny.py.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.recipe.test_train_tiny import MISMATCH_BOUNDS, REWARD_RISE, STEPS, _log, _metrics, _run
from verl_patches.train import mismatch as M

pytestmark = pytest.mark.slow

MAX_TOKENS = 400  # configs/tiny_deepseek_v3.yaml: data.max_prompt_length 384 + data.max_response_length 16
ROWS_PER_RANK = 32  # train_batch_size 8 x rollout.n 4, actor DP1 (TP2 x PP2 on 4 workers)
FIXED_MICRO = 8  # actor.ppo_micro_batch_size_per_gpu: the fixed-size run's micro-batches
# The KL loss (low_var_kl) at step 1, where actor and reference hold the same weights: in the fixed run
# 0 to the printed digits; misaligned rows would give the KL between different tokens' log-probs (order 1).
KL_AT_STEP_1 = 1e-3
FAULT_STEP = STEPS + 1
FAULTS = f"flip,step={FAULT_STEP},rank=1;transpose,step={FAULT_STEP},rank=2"


@pytest.fixture(scope="module")
def faulted(tmp_path_factory, tiny_assets):
    """The run: its metrics by step, and the console with the trainer's whole log (it ends in the fault)."""
    base = tmp_path_factory.mktemp("tiny_dynamic")
    r = _run(base / "run", tiny_assets, f"trainer.total_training_steps={FAULT_STEP}", "trainer.save_freq=-1",
             "trainer.val_before_train=False", "trainer.test_freq=-1",
             "actor_rollout_ref.actor.use_dynamic_bsz=True",
             f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={MAX_TOKENS}",
             env={"VERL_PATCHES_INJECT_FAULT": FAULTS})
    text = r.stdout + _log(base / "run", "trainer.log")
    rows = base / "run" / "metrics.jsonl"
    assert rows.exists(), text[-6000:]
    return r.returncode, text, _metrics(base / "run"), [json.loads(x)["step"] for x in rows.read_text().splitlines()
                                                          if x.strip()]


@pytest.fixture(scope="module")
def run(faulted):
    """The steps before the fault: the dynamic-batch run proper."""
    return {step: row for step, row in faulted[2].items() if step <= STEPS}


def test_every_step_logged_without_nan(run):
    assert sorted(run) == list(range(1, STEPS + 1)), sorted(run)
    for step, row in run.items():
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (step, bad)


def test_the_micro_batches_varied_by_verls_token_rule(run):
    for step, row in run.items():
        missing = [k for k in M.MICRO_METRICS if k not in row]
        assert not missing, (step, missing)
        # verl's rule (rearrange_micro_batches): ceil(the rank's tokens / the budget) micro-batches. With
        # DP1 every rank holds the step's whole batch, whose tokens verl's trainer logs.
        want = min(ROWS_PER_RANK, math.ceil(row["perf/total_num_tokens"] / MAX_TOKENS))
        assert row[M.MICRO_BATCHES] == want, (step, row[M.MICRO_BATCHES], row["perf/total_num_tokens"])
        # Not the fixed split, and micro-batches of different sizes.
        assert row[M.MICRO_BATCHES] != ROWS_PER_RANK // FIXED_MICRO, step
        assert row[M.MICRO_ROWS + "min"] < row[M.MICRO_ROWS + "max"], (step, row[M.MICRO_ROWS + "min"])
        # The largest holds at least its share of the tokens (verl balances the split; it may pass the budget).
        assert want * row[M.MICRO_TOKENS_MAX] >= row["perf/total_num_tokens"], step


def test_the_rows_stayed_together_through_the_split(run):
    for step, row in run.items():
        for key, bound in MISMATCH_BOUNDS.items():
            assert 0 <= row[key] < bound, (step, key, row[key])
    assert 0 <= run[1]["actor/kl_loss"] < KL_AT_STEP_1, run[1]["actor/kl_loss"]


def test_it_learns_as_the_fixed_size_run_does(run):
    rewards = [run[s]["critic/score/mean"] for s in range(1, STEPS + 1)]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + REWARD_RISE, rewards


def test_a_corrupted_rollout_stops_the_run_at_that_step_naming_rank_and_parameter(faulted):
    rc, text, _, steps = faulted
    assert rc != 0, "the run went on with corrupted rollout weights:\n" + text[-6000:]
    injected = dict(re.findall(rf"FAULT INJECTED \(VERL_PATCHES_INJECT_FAULT\): \w+ of (\S+) on rank (\d+) "
                               rf"at step {FAULT_STEP}\b", text))
    injected = {int(rank): name for name, rank in injected.items()}
    assert sorted(injected) == [1, 2], text[-6000:]
    assert injected[2].endswith("mlp.experts.w13_weight"), injected
    assert (f"weight fingerprint at step {FAULT_STEP}: 2 rollout parameter(s) do not hold what the training side "
            "sent") in text, text[-6000:]
    for rank, name in injected.items():
        assert f"rollout rank {rank}, {name}: expected 0x" in text, (rank, name, text[-6000:])
    # Every step before it ran and was checked; nothing of the faulted step reached the log.
    assert steps == list(range(1, FAULT_STEP)), steps


def test_every_step_before_the_fault_passed_the_fingerprint(run):
    assert all(row["switch/fingerprint_passed"] == 1.0 and row["switch/fingerprint_params"] > 0
               for row in run.values()), {s: row.get("switch/fingerprint_passed") for s, row in run.items()}
