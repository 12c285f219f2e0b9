"""The logit check with the transformers that is installed: through its own checkpoint loader where its
model names DeepSeek-V3's weights otherwise, and a refusal naming the installed and the locked version
(never a list of names) where even that loader does not take them."""

import json

import pytest
import torch

from tests.helpers import REPO
from verl_patches.reshard import hf_check
from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
from verl_patches.reshard.model import ModelConfig
from verl_patches.reshard.placements import build_placements

MODEL = REPO / "configs" / "model" / "tiny_deepseek_v3.json"


@pytest.fixture(scope="module")
def tiny():
    cfg = json.loads(MODEL.read_text())
    P = build_placements(ModelConfig.from_hf(cfg), TrainLayout.parse("tp=1,pp=1,ep=1"), RolloutLayout.parse("tp=1,dp=1"))
    return cfg, P, hf_check.to_hf(P, hf_check.reference(P, seed=3, step=1, dtype=torch.bfloat16))


def _swap_gate_up(state):
    """Every MLP's (dense, shared and routed experts') gate and up projections exchanged: a
    self-consistent naming slip that only the logits show."""
    out = dict(state)
    for gate in (k for k in state if ".gate_proj." in k):
        up = gate.replace("gate_proj", "up_proj")
        out[gate], out[up] = state[up], state[gate]
    return out


@pytest.mark.parametrize("via_checkpoint", [False, True], ids=["direct", "through_the_loader"])
def test_both_routes_compare_real_logits(tiny, via_checkpoint):
    cfg, P, ref = tiny
    info = hf_check.check_logits(cfg, P, {"reference": ref, "same": {k: v.clone() for k, v in ref.items()}},
                                 via_checkpoint=via_checkpoint)
    assert info["loaded_via_checkpoint"] is via_checkpoint and info["max_abs_logit"] > 0
    # The route loads the weights for real: a swapped gate/up pair changes the logits.
    with pytest.raises(hf_check.LogitCheckError, match="differ"):
        hf_check.check_logits(cfg, P, {"reference": ref, "swapped": _swap_gate_up(ref)}, via_checkpoint=via_checkpoint)


def test_a_naming_the_installed_transformers_cannot_load_is_refused_with_both_versions(tiny):
    # The naming is faked (experts named as another model family does); the check is the real one.
    cfg, P, ref = tiny
    other = {k.replace(".gate_proj.", ".w1.").replace(".up_proj.", ".w3.").replace(".down_proj.", ".w2.")
             if ".experts." in k else k: v for k, v in ref.items()}
    with pytest.raises(hf_check.LogitCheckError) as e:
        hf_check.check_logits(cfg, P, {"reference": ref, "renamed": other})
    installed, locked = hf_check.versions()
    msg = str(e.value)
    assert f"installed transformers {installed}" in msg and f"locked transformers {locked}" in msg
    assert locked == "4.52.4" and "model.layers" not in msg and "[" not in msg, msg
