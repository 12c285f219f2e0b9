"""The weight fingerprint stops verl's real trainer loop (scripts/train_tiny.sh, CPU platform) at the
step where the rollout stops holding the trainer's weights, naming the step, the rollout rank and the
parameter. The faults come from the test-only switch VERL_PATCHES_INJECT_FAULT
(verl_patches/reshard/faults.py), applied right after step 3's reshard: one bit of one parameter
flipped on rank 1, and a routed-expert w13 stack written transposed on rank 2 (the shape of
vLLM-Ascend's extra transpose in wake_up). One run carries both, so CI pays for one run; each
fault alone is caught on 8 ranks over several layouts in tests/reshard/test_fingerprint.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow

FAULTS = "flip,step=3,rank=1;transpose,step=3,rank=2"


def test_a_corrupted_rollout_stops_the_run_at_that_step_naming_rank_and_parameter(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, TINY_OUT=str(out), VERL_PATCHES_INJECT_FAULT=FAULTS)
    r = subprocess.run(["bash", str(REPO / "scripts" / "train_tiny.sh"), "trainer.total_training_steps=4",
                        "trainer.save_freq=-1", "trainer.val_before_train=False", "trainer.test_freq=-1"],
                       env=env, cwd=str(REPO), capture_output=True, text=True, timeout=900)
    log = out / "logs" / "trainer.log"  # the trainer's whole output; the console keeps the report's lines
    text = r.stdout + r.stderr + (log.read_text(errors="replace") if log.exists() else "")
    assert r.returncode != 0, "the run went on with corrupted rollout weights:\n" + text[-6000:]
    injected = dict(re.findall(r"FAULT INJECTED \(VERL_PATCHES_INJECT_FAULT\): \w+ of (\S+) on rank (\d+) at step 3",
                               text))
    injected = {int(rank): name for name, rank in injected.items()}
    assert sorted(injected) == [1, 2], text[-6000:]
    assert injected[2].endswith("mlp.experts.w13_weight"), injected
    assert "weight fingerprint at step 3: 2 rollout parameter(s) do not hold what the training side sent" in text, \
        text[-6000:]
    for rank, name in injected.items():
        assert f"rollout rank {rank}, {name}: expected 0x" in text, (rank, name, text[-6000:])
    # Steps 1 and 2 ran and were checked; nothing of step 3 reached the log.
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["switch/fingerprint_passed"] == 1.0 and row["switch/fingerprint_params"] > 0 for row in rows)
