"""recipe.profile (verl_patches/base/profile.py): its settings refused by name, the accelerator facade's profiler
writing a chrome trace a person can open, and the process's profiling bound where the stage calls are wrapped (the
switch's worker wrappers and the switch loop's steps), run here in verl's trainer order on stand-in bodies
(tests/offload/test_switch_calls.py's Trainer): only the chosen stages of the chosen steps on the chosen rank write
traces, a switch phase inside a stage's session is a named range of that trace, and one outside any session a
trace of its own. The tiny run writes them through verl's trainer (tests/recipe/test_train_tiny.py); the NPU
rehearsal's torch_npu.profiler stand-in has its own test (tests/npu_rehearsal/test_profiler.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.offload.test_switch_calls import Trainer
from verl_patches.base import accelerator, profile
from verl_patches.config import settings
from verl_patches.core import stash

P = f"{settings.SECTION}.profile"


@pytest.mark.parametrize("section, message", [
    ({"stages": ["update", "rollot"], "dir": "d"}, f"{P}.stages: unknown stage(s) ['rollot']; the stages are "
                                                   "['rollout', 'old_log_prob', 'ref_log_prob', 'update', 'switch']"),
    ({"stages": "update", "dir": "d"}, f"{P}.stages must be a list of stage names"),
    ({"stages": ["update", "update"], "dir": "d"}, f"{P}.stages names a stage twice"),
    ({"steps": [3, 2]}, f"{P}.steps must be [first, last] global steps with 1 <= first <= last, got [3, 2]"),
    ({"steps": [0, 2]}, f"{P}.steps must be [first, last]"),
    ({"steps": [1]}, f"{P}.steps must be [first, last]"),
    ({"steps": [1, True]}, f"{P}.steps must be [first, last]"),
    ({"ranks": "some"}, f"{P}.ranks must be \"all\" or a non-empty list of global ranks (integers >= 0), got the "
                        "string 'some'"),
    ({"ranks": [-1]}, f"{P}.ranks must be \"all\""),
    ({"ranks": []}, f"{P}.ranks must be \"all\""),
    ({"level": "Level1"}, f"{P}.level must be one of ['level0', 'level1', 'level2'], got the string 'Level1'"),
    ({"dri": "x"}, f"{P}.dri: unknown key (did you mean 'dir'?)"),
    ({"dir": 3}, f"{P}.dir must be a string (a path), got 3 (int)"),
    ({"stages": ["update"]}, f"{P}.dir is not set but {P}.stages names ['update']: name the directory"),
    ("update", f"{P} must be a mapping of ['dir', 'level', 'ranks', 'stages', 'steps'], got the string 'update'"),
])
def test_a_bad_profile_setting_is_refused_naming_it(section, message):
    found = settings.problems({"profile": section})
    assert len(found) == 1 and found[0].startswith(message), found
    with pytest.raises(settings.SettingsError, match="profile"):
        settings.build({"profile": section})


def test_profiling_is_off_by_default_and_the_settings_choose_stage_step_and_rank():
    assert settings.build(None).profile == settings.ProfileSettings() and not settings.build({}).profile.on
    p = settings.build({"profile": {"stages": ["update", "switch"], "steps": [2, 3], "ranks": [1], "dir": "d",
                                    "level": "level2"}}).profile
    assert (p.stages, p.steps, p.ranks, p.level, p.dir) == (("update", "switch"), (2, 3), (1,), "level2", "d")
    assert [p.wants("update", s, 1) for s in (1, 2, 3, 4, None)] == [False, True, True, False, False]
    assert not p.wants("update", 2, 0) and not p.wants("rollout", 2, 1) and p.wants("switch", 3, 1)
    assert settings.build({"profile": {"stages": ["rollout"], "ranks": "all", "dir": "d"}}).profile.wants("rollout", 1, 7)


def _events(path: Path) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_the_facade_writes_a_chrome_trace_with_the_named_range_and_the_ops(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")
    with accelerator.profiler(str(tmp_path), "rank0", "level1"), accelerator.profiler_label("recipe/update"):
        torch.ones(16, 16) @ torch.ones(16, 16)
    (trace,) = tmp_path.iterdir()
    assert trace.name.startswith("rank0.") and trace.name.endswith(".pt.trace.json.gz")
    events = _events(trace)
    names = {e.get("name") for e in events}
    assert {"recipe/update", "aten::mm"} <= names
    # level1 records the ops' input shapes.
    assert any(e.get("name") == "aten::mm" and e.get("args", {}).get("Input Dims") == [[16, 16], [16, 16]]
               for e in events)
    with pytest.raises(ValueError, match=r"profiler level 'Level1': the levels are \['level0', 'level1', 'level2'\]"):
        accelerator.profiler(str(tmp_path), "rank0", "Level1")


def _data(step, validate=False):
    return SimpleNamespace(meta_info={stash.STEP_META_KEY: step, **({"validate": True} if validate else {})})


def _trees(root: Path) -> dict[str, list[str]]:
    """folder (relative to root) -> the trace files in it."""
    return {str(d.relative_to(root)): sorted(f.name for f in d.iterdir()) for d in sorted(root.rglob("rank*"))
            if d.is_dir()}


@pytest.fixture
def trainer(monkeypatch):
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")
    yield Trainer()
    profile.configure(None, 0)


def _step(t: Trainer, step: int) -> None:
    for method in ("generate_sequences", "compute_log_prob", "compute_ref_log_prob", "update_actor"):
        t.call(method, _data(step))


def test_only_the_chosen_stages_of_the_chosen_steps_on_the_chosen_rank_write_traces(trainer, tmp_path):
    chosen = settings.build({"profile": {"stages": ["update", "switch"], "steps": [2, 2], "ranks": [1],
                                         "dir": str(tmp_path)}}).profile
    profile.configure(chosen, 0)  # rank 0 is not chosen: nothing
    _step(trainer, 2)
    assert not any(tmp_path.iterdir())
    p = profile.configure(chosen, 1)
    trainer.call("generate_sequences", _data(0, validate=True))  # a validation: no step, not profiled
    for step in (1, 2, 3):
        _step(trainer, step)
    trees = _trees(tmp_path)
    assert set(trees) == {"step2/update/rank1", "step2/switch/rank1"}, trees
    (update,) = trees["step2/update/rank1"]
    assert update.startswith("rank1.") and update.endswith(".pt.trace.json.gz")
    names = {e.get("name") for e in _events(tmp_path / "step2/update/rank1" / update)}
    # The update's own range, and the switch phases verl's call reaches inside it, as ranges of its trace.
    assert {"recipe/update", "recipe/switch/update_onload", "recipe/switch/update_end"} <= names, names
    # Outside any session, each phase of the switch is a trace of its own: the rollout's moves and reshard, the
    # reference's onload and offload, the old log-prob forward's excursion.
    phases = sorted({f.split(".")[0].removeprefix("rank1_") for f in trees["step2/switch/rank1"]})
    assert phases == sorted(["alloc_rollout_weights", "reshard", "offload_train_params", "init_kv_cache",
                             "free_kv_cache", "release_rollout_weights", "compute_log_prob_in",
                             "compute_log_prob_out", "ref_onload", "ref_offload"]), phases
    reshard = next(f for f in trees["step2/switch/rank1"] if f.startswith("rank1_reshard."))
    assert "recipe/switch/reshard" in {e.get("name") for e in _events(tmp_path / "step2/switch/rank1" / reshard)}
    # One session per folder written: the update's and each phase's.
    assert sorted(p.written) == [tmp_path / "step2/switch/rank1"] * len(phases) + [tmp_path / "step2/update/rank1"]


def test_a_stage_chosen_with_its_phases_holds_them_as_ranges_and_all_ranks_profile(trainer, tmp_path):
    profile.configure(settings.build({"profile": {"stages": ["rollout", "ref_log_prob", "switch"], "ranks": "all",
                                                  "dir": str(tmp_path), "level": "level0"}}).profile, 3)
    _step(trainer, 1)
    trees = _trees(tmp_path)
    # The rollout's and the reference's phases ran inside their sessions; the old log-prob's excursion and the
    # update's moves did not.
    assert set(trees) == {"step1/rollout/rank3", "step1/ref_log_prob/rank3", "step1/switch/rank3"}, trees
    assert sorted(f.split(".")[0] for f in trees["step1/switch/rank3"]) == [
        "rank3_compute_log_prob_in", "rank3_compute_log_prob_out", "rank3_update_end", "rank3_update_onload"]
    (rollout,) = trees["step1/rollout/rank3"]
    names = {e.get("name") for e in _events(tmp_path / "step1/rollout/rank3" / rollout)}
    assert {"recipe/rollout", "recipe/switch/reshard", "recipe/switch/init_kv_cache",
            "recipe/switch/release_rollout_weights"} <= names, names


def test_without_the_recipes_offload_the_stage_calls_still_profile(trainer, tmp_path):
    profile.configure(settings.build({"profile": {"stages": ["update"], "dir": str(tmp_path)}}).profile, 0)
    worker = SimpleNamespace()  # no actor memory: the wrappers call verl's body as it is
    from verl_patches.patches.verl import patch_workers_megatron_workers_switch as worker_patch

    update = worker_patch.wrap_update_actor_offload(lambda w, data: torch.ones(4, 4) @ torch.ones(4, 4))
    update(worker, _data(1))
    (trace,) = (tmp_path / "step1/update/rank0").iterdir()
    assert {"recipe/update", "aten::mm"} <= {e.get("name") for e in _events(trace)}


@pytest.mark.parametrize("ref_in_actor", [False, True])
def test_the_driver_sends_the_trainers_step_with_every_stage_call(ref_in_actor):
    """Patch verl.self_check.step_to_workers: generate_sequences, compute_log_prob, update_actor and the reference's
    compute_ref_log_prob carry trainer.global_steps at the time of the call (the workers' profiles choose by it)."""
    from verl_patches.patches.verl.patch_trainer_ppo_ray_trainer_self_check import wrap_init_workers_step

    seen = []

    def group():
        return SimpleNamespace(**{name: (lambda data, name=name: seen.append((name, dict(data.meta_info))))
                                  for name in ("generate_sequences", "compute_log_prob", "update_actor",
                                               "compute_ref_log_prob")})

    trainer = SimpleNamespace(actor_rollout_wg=group(), ref_policy_wg=group(), use_reference_policy=True,
                              ref_in_actor=ref_in_actor, global_steps=0)
    wrap_init_workers_step(lambda self: None)(trainer)
    ref = trainer.actor_rollout_wg if ref_in_actor else trainer.ref_policy_wg
    for step in (3, 4):
        trainer.global_steps = step
        for call in (trainer.actor_rollout_wg.generate_sequences, trainer.actor_rollout_wg.compute_log_prob,
                     ref.compute_ref_log_prob, trainer.actor_rollout_wg.update_actor):
            call(SimpleNamespace(meta_info={}))
    assert [(name, meta[stash.STEP_META_KEY]) for name, meta in seen] == [
        (name, step) for step in (3, 4)
        for name in ("generate_sequences", "compute_log_prob", "compute_ref_log_prob", "update_actor")]


def test_the_settings_accept_the_levels_the_accelerator_profiler_takes():
    """The level names stand twice: in the settings (loaded without torch) and in the accelerator facade (the floor,
    importing only config.env); neither may import the other, so this test keeps them one list."""
    assert settings.PROFILE_LEVELS == accelerator.PROFILER_LEVELS
