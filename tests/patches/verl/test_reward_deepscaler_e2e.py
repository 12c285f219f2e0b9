"""End to end: verl 0.4.1's real NaiveRewardManager and trainer compute_reward score a DataProto with
deepscaler rows through the patched default_compute_score (verl.reward_score.deepscaler).

Stand-in: the tokenizer (one character per token id, so the test needs no tokenizer download);
the reward manager, the DataProto, the dispatch on data_source and the reward are the real ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_patches.core import apply as ap
from verl_patches.patches.verl import patch_utils_reward_score as reward_patch


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids if int(i) > 0)


def _batch(rows):
    """rows: (data_source, response text, ground truth); left-padded prompts, right-padded responses."""
    from verl.protocol import DataProto

    P, R = 8, 48
    prompts = torch.zeros(len(rows), P, dtype=torch.int64)
    responses = torch.zeros(len(rows), R, dtype=torch.int64)
    mask = torch.zeros(len(rows), P + R, dtype=torch.int64)
    for i, (_, text, _) in enumerate(rows):
        q = "Q: 1+1?"
        prompts[i, P - len(q):] = torch.tensor([ord(c) for c in q])
        responses[i, : len(text)] = torch.tensor([ord(c) for c in text])
        mask[i, P - len(q): P + len(text)] = 1
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": mask},
        non_tensors={"data_source": np.array([r[0] for r in rows], dtype=object),
                     "reward_model": np.array([{"ground_truth": r[2]} for r in rows], dtype=object)},
    )


ROWS = [
    ("deepscaler", r"1+1 is \boxed{2}", "2"),
    ("deepscaler", r"so the answer is \boxed{\frac{4}{2}}", "2"),  # equivalent, not equal
    ("deepscaler", r"\boxed{3}", "2"),
    ("deepscaler", "no boxed answer 2", "2"),
    ("openai/gsm8k", "#### 2", "2"),  # another source still reaches verl's own scorer
]


def test_naive_reward_manager_scores_deepscaler_rows_through_the_patch():
    from verl.trainer.ppo.reward import compute_reward
    from verl.workers.reward_manager.naive import NaiveRewardManager

    ap.apply_all(reward_patch.PATCHES)
    try:
        manager = NaiveRewardManager(tokenizer=CharTokenizer(), num_examine=0)
        batch = _batch(ROWS)
        reward_tensor, _ = compute_reward(batch, manager)
    finally:
        ap.undo()
    valid = batch.batch["attention_mask"][:, 8:].sum(-1)
    # The score sits on each row's last valid response token, zeros elsewhere.
    assert reward_tensor[torch.arange(len(ROWS)), valid - 1].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert float(reward_tensor.sum()) == 3.0


def test_without_the_patch_verl_cannot_score_deepscaler():
    from verl.workers.reward_manager.naive import NaiveRewardManager

    manager = NaiveRewardManager(tokenizer=CharTokenizer(), num_examine=0)
    with pytest.raises(NotImplementedError):
        manager(_batch(ROWS[:1]))


def test_verls_legacy_scorer_passes_seven_positional_arguments_through_the_patch():
    # verl.utils.reward_score._default_compute_score calls default_compute_score with all seven of its
    # arguments positionally; a narrowed replacement raised TypeError there.
    from verl.utils import reward_score as rs

    ap.apply_all(reward_patch.PATCHES)
    try:
        assert rs._default_compute_score("deepscaler", r"\boxed{2}", "2", None, None, None, None) == 1.0
        assert rs._default_compute_score("openai/gsm8k", "#### 2", "2", None, None, None, None) == 1.0
        assert rs.default_compute_score("deepscaler", r"\boxed{3}", "2", None, sandbox_fusion_url=None) == 0.0
    finally:
        ap.undo()
