"""Planner on the reference 256-die DeepSeek-V3 layouts (metadata only), plan-time errors for
layouts that cannot be routed, box splitting, and the `plan` CLI."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from verl_patches.reshard.cli import main as plan_main
from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
from verl_patches.reshard.model import LayoutError, ModelConfig
from verl_patches.reshard.placements import build_placements
from verl_patches.reshard.box import split_box
from verl_patches.reshard.planner import build_plan
from verl_patches.reshard.weight_sync import plan_summaries

REPO = Path(__file__).resolve().parents[2]
DSV3 = str(REPO / "configs/model/deepseek_v3.json")
TINY = str(REPO / "configs/model/tiny_deepseek_v3.json")
REF_TRAIN = "tp=4,pp=8,ep=8,layers=7,7,8,8,8,8,8,7"


def test_deepseek_v3_config_is_671b():
    P = build_placements(ModelConfig.load(DSV3), TrainLayout.parse(REF_TRAIN), RolloutLayout.parse("tp=2,dp=128"))
    total = sum(t.numel for t in P.tensors)
    assert 670e9 < total < 672e9
    # every logical tensor is tiled exactly once by the training parts
    for t in P.tensors:
        assert sum(_n(p.box) for p in t.train) == t.numel, t.name


def _n(box):
    n = 1
    for a, b in box:
        n *= b - a
    return n


@pytest.mark.parametrize("rollout,b_ratio,a_ratio", [("tp=2,dp=128", 3.0, 50.0),
                                                      # zero redundancy caps these ratios: see docs
                                                      ("tp=2,dp=64,instances=2", 2.8, 45.0)])
@pytest.mark.slow
def test_reference_layouts(rollout, b_ratio, a_ratio):
    t0 = time.perf_counter()
    plan = build_plan(DSV3, REF_TRAIN, rollout)
    assert time.perf_counter() - t0 < 60, "the 256-die plan must compute in seconds"
    assert plan.world == 256
    for s in plan.ranks:
        assert s.recv_bytes == s.shard_bytes - s.local_bytes
        assert s.peak_extra_bytes <= 2 * plan.bucket_bytes
    direct, upstream, recipe = plan_summaries(plan)
    assert direct["max_recv_bytes"] * b_ratio <= recipe["max_recv_bytes"]
    assert direct["max_recv_bytes"] * a_ratio <= upstream["max_recv_bytes"]
    # No correct method can receive less than what a rank needs and does not hold: ours meets
    # that bound on every rank. With two instances the bound itself is above B / 3 and A / 50
    # (each die hosts two experts per layer, while A's and B's volumes stay the same), so the
    # issue's 3x / 50x cannot be met by any routing there; the asserted ratios are what it is.
    floor = max(s.shard_bytes - s.local_bytes for s in plan.ranks)
    assert direct["max_recv_bytes"] == floor
    if rollout == "tp=2,dp=64,instances=2":
        assert floor * 3 > recipe["max_recv_bytes"] and floor * 50 > upstream["max_recv_bytes"]
    # the spec's anchors: 5.1 GB of routed experts per die at EP256 and ~1.3 TB per die for A
    if rollout == "tp=2,dp=128":
        E = ModelConfig.load(DSV3)
        expert_bytes = 58 * 3 * E.moe_intermediate_size * E.hidden_size * 2
        assert 5.0e9 < expert_bytes < 5.2e9
        assert 1.25e12 < upstream["max_recv_bytes"] < 1.4e12


@pytest.mark.parametrize("train,rollout,needle", [
    ("tp=1,pp=1,ep=1", "tp=3,dp=1", "embed_tokens.*1024.*tp 3"),      # vLLM's padded vocab over TP 3
    ("tp=3,pp=1,ep=1", "tp=1,dp=3", "dims|divid"),                     # training TP 3
    ("tp=1,pp=1,ep=3", "tp=1,dp=3", "experts"),                        # 16 experts over 3
    ("tp=2,pp=2,ep=1", "tp=2,dp=3", "world"),                          # 6 ranks vs tp*pp 4
    ("tp=1,pp=2,ep=1,layers=1,2", "tp=1,dp=2", "layers"),              # 3 layers of 4
    ("tp=1,pp=1,ep=3", "tp=1,dp=4", "ep 3"),                           # dp 4 not divisible by ep
])
def test_unroutable_layouts_fail_at_plan_time(train, rollout, needle):
    import re

    with pytest.raises(LayoutError) as ei:
        build_plan(TINY, train, rollout)
    assert re.search(needle, str(ei.value)), str(ei.value)


def test_error_names_parameter_and_sizes():
    cfg = dict(json.loads(Path(TINY).read_text()), vocab_size=960)  # vocab fine for TP 3, 8 heads are not
    with pytest.raises(LayoutError, match=r"self_attn\.kv_b_proj\.weight: rollout tp=3 splits dim 0 of size 256 into 3 parts"):
        build_plan(cfg, "tp=1,pp=1,ep=1", "tp=3,dp=1")
    with pytest.raises(LayoutError, match=r"kv_a_proj_with_mqa.*size 40 into 3 parts"):
        build_plan(cfg, "tp=3,pp=1,ep=1", "tp=1,dp=3")
    with pytest.raises(LayoutError, match=r"16 experts .* 3"):
        build_plan(TINY, "tp=1,pp=1,ep=3", "tp=1,dp=3")


def test_bad_config_rejected(tmp_path):
    cfg = json.loads(Path(TINY).read_text())
    for key, val, needle in (("quantization_config", {"quant_method": "fp8"}, "quantization"),
                             ("num_nextn_predict_layers", 1, "MTP"), ("tie_word_embeddings", True, "tie")):
        with pytest.raises(LayoutError, match=needle):
            ModelConfig.from_hf(dict(cfg, **{key: val}))
    with pytest.raises(LayoutError, match="hidden_size"):
        ModelConfig.from_hf({k: v for k, v in cfg.items() if k != "hidden_size"})
    with pytest.raises(LayoutError, match="unknown keys"):
        TrainLayout.parse("tp=2,pipeline=3")


def test_split_box_tiles_the_box():
    box = ((0, 5), (3, 10), (0, 64))
    for cap in (1, 7, 64, 100, 448, 10_000):
        pieces = split_box(box, cap)
        assert all(_n(p) <= cap for p in pieces)
        cells = set()
        for p in pieces:
            for i in range(*p[0]):
                for j in range(*p[1]):
                    for k in range(*p[2]):
                        assert (i, j, k) not in cells
                        cells.add((i, j, k))
        assert len(cells) == _n(box)


def test_cli_json_and_table(capsys):
    assert plan_main(["--model", TINY, "--train", "tp=2,pp=2,ep=2,layers=1,3", "--rollout", "tp=4,dp=2",
                      "--bucket-mb", "0.01", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["method"] for m in out["methods"]] == ["direct", "upstream", "alltoallv"]
    for m in out["methods"]:
        assert set(m) == {"method", "max_recv_bytes", "mean_recv_bytes", "total_link_bytes", "collectives",
                          "peak_extra_bytes"}
    direct = out["methods"][0]
    assert direct["peak_extra_bytes"] <= 2 * int(0.01 * (1 << 20))
    assert out["direct_recv_is_shard_minus_local"] is True
    assert plan_main(["--model", TINY, "--train", "tp=2,pp=2,ep=2,layers=1,3", "--rollout", "tp=4,dp=2"]) == 0
    text = capsys.readouterr().out
    assert "direct" in text and "upstream" in text and "alltoallv" in text
    assert plan_main(["--model", TINY, "--train", "tp=1,pp=1,ep=1", "--rollout", "tp=3,dp=1"]) == 2
    assert "embed_tokens" in capsys.readouterr().err


def test_live_binding_reads_the_shared_expert_layout_from_the_engine():
    """vLLM-Ascend's multistream MoE keeps the shared experts whole on every rollout rank."""
    import torch

    from verl_patches.reshard.binding import derive_rollout_layout
    from verl_patches.reshard.layouts import RolloutLayout
    from verl_patches.reshard.model import LayoutError

    cfg = ModelConfig.load(TINY)
    rows = 2 * cfg.moe_intermediate_size * cfg.n_shared_experts
    name = "model.layers.1.mlp.shared_experts.gate_up_proj.weight"
    base = RolloutLayout(tp=2, dp=4)
    assert derive_rollout_layout(cfg, base, {name: torch.empty(rows, cfg.hidden_size)}).shared_replicated
    assert not derive_rollout_layout(cfg, base, {name: torch.empty(rows // 2, cfg.hidden_size)}).shared_replicated
    with pytest.raises(LayoutError, match="shared_experts.gate_up_proj.*rows"):
        derive_rollout_layout(cfg, base, {name: torch.empty(rows // 4, cfg.hidden_size)})
