"""The recipe's checkpoints (issue 36): every run config states its checkpoint settings (saved every N steps into
the directory the launcher passes from CKPT_SAVE_DIR, resumed automatically, a bounded number kept, written
synchronously), and scripts/cluster/README.md's table of one checkpoint's size and write time at 671B is what
verl_patches/checks/recipe_memory.checkpoint_size computes from configs/model/deepseek_v3.json and each config's
own layout (recomputed here, row by row)."""

from __future__ import annotations

import pytest

from tests.helpers import REPO
from verl_patches.checks import recipe_config as RC
from verl_patches.checks.recipe_memory import checkpoint_size

README = REPO / "scripts" / "cluster" / "README.md"
RUNS = ("deepseekv3_256die_random_init", "deepseekv3_256die_true_weight", "deepseekv3_128gpu_random_init",
        "deepseekv3_128gpu_true_weight", "deepseekv3_128gpu_h100_random_init", "deepseekv3_128gpu_h100_true_weight")
OVERRIDES = ["actor_rollout_ref.actor.megatron.dist_checkpointing_path=/ckpt/dsv3",
             "trainer.default_local_dir=/shared/ckpt"]
# The aggregate write bandwidth of the cluster's shared storage the table assumes (paper: no cluster measured).
BANDWIDTHS_GB_S = (10, 50)
TIMEOUT_S = 600  # actor_rollout_ref.nccl_timeout of the configs (checked below)


@pytest.fixture(scope="module")
def model():
    return RC.load_model_config(RC.DEFAULT_MODEL_CONFIG)


def _layout(name: str, model: dict) -> dict:
    rep = RC.validate(RC.compose(name, OVERRIDES), model)
    assert not rep.errors, (name, rep.errors)
    return rep.layout


def _size(name: str, model: dict):
    """A config's layout and its checkpoint's size."""
    layout = _layout(name, model)
    t = layout["train"]
    return layout, checkpoint_size(model, world=layout["world"], tp=t["tp"], pp=t["pp"],
                                   expert_group=t["expert_group"], layer_list=t["num_layer_list"])


def row(name: str, model: dict) -> str:
    """The README's row for a config's layout."""
    layout, size = _size(name, model)
    t = layout["train"]
    ten, fifty = (size.write_seconds(b * 1e9) / 60 for b in BANDWIDTHS_GB_S)
    return (f"| {layout['world']} ranks: TP{t['tp']} PP{t['pp']}, experts over {t['expert_group']} | "
            f"{size.weights / 1e12:.2f} TB | {size.optimizer / 1e12:.2f} TB | {size.total / 1e12:.2f} TB | "
            f"{size.per_rank_min / 1e9:.1f}-{size.per_rank_max / 1e9:.1f} GB | {ten:.1f} min | {fifty:.1f} min | "
            f"{size.idle_seconds(BANDWIDTHS_GB_S[0] * 1e9):.0f} s |")


def test_the_readme_states_each_layouts_checkpoint_as_computed(model):
    text = " ".join(README.read_text().split())  # lines joined: a figure may sit across a line break
    rows = {row(name, model) for name in RUNS}
    assert len(rows) == 2  # the 256-die layout and the 128-GPU one (H200 and H100 alike)
    missing = [r for r in sorted(rows) if r not in text]
    assert not missing, "scripts/cluster/README.md's checkpoint table differs; the rows are:\n" + "\n".join(missing)
    for b in BANDWIDTHS_GB_S:
        assert f"{b} GB/s" in text
    _, size = _size(RUNS[0], model)
    # The bandwidth below which the wait reaches the timeout, and the directory's peak during a save (2 kept + 1).
    assert f"less than about {(size.total - size.ranks * size.per_rank_min) / TIMEOUT_S / 1e9:.1f} GB/s" in text
    assert f"holds 3 checkpoints ({3 * size.total / 1e12:.0f} TB)" in text
    assert f"about {size.write_seconds(BANDWIDTHS_GB_S[0] * 1e9) / 60:.0f} minutes per 10 steps" in text


def test_the_lightest_ranks_wait_within_the_timeout_at_the_assumed_bandwidth(model):
    """The save ends with a collective every rank joins; at the table's 10 GB/s the lightest stage's ranks wait
    for the heaviest's well within the configs' process-group timeout."""
    for name in RUNS:
        _, size = _size(name, model)
        assert size.idle_seconds(BANDWIDTHS_GB_S[0] * 1e9) < TIMEOUT_S, name
        # Every tensor once: the ranks' shares add up to the whole.
        assert size.ranks * size.per_rank_min <= size.total <= size.ranks * size.per_rank_max


@pytest.mark.parametrize("name", RUNS)
def test_every_run_config_states_its_checkpoint_and_timeout_settings(name):
    cfg = RC.compose(name, OVERRIDES)
    tr = cfg.trainer
    assert tr.save_freq == 10 and tr.resume_mode == "auto" and tr.max_actor_ckpt_to_keep == 2, name
    assert cfg.actor_rollout_ref.actor.checkpoint.async_save is False
    assert list(cfg.actor_rollout_ref.actor.checkpoint.save_contents) == ["model", "optimizer", "extra"]
    assert cfg.actor_rollout_ref.nccl_timeout == TIMEOUT_S
    # The directory is the launcher's (CKPT_SAVE_DIR): the override above, never the config's own default.
    assert tr.default_local_dir == "/shared/ckpt"


@pytest.mark.parametrize("override, needle", [
    ("actor_rollout_ref.actor.checkpoint.async_save=True",
     "actor_rollout_ref.actor.checkpoint.async_save=True with trainer.save_freq=10: an asynchronous save returns"),
    ("trainer.resume_mode=latest", "trainer.resume_mode='latest': one of auto, resume_path, disable"),
    ("trainer.resume_mode=resume_path", "trainer.resume_mode=resume_path needs trainer.resume_from_path"),
])
def test_the_dry_run_refuses_checkpoint_settings_the_commit_cannot_serve(model, override, needle):
    rep = RC.validate(RC.compose(RUNS[0], [*OVERRIDES, override]), model)
    assert any(needle in e for e in rep.errors), rep.errors
