"""Bad values generated from the declarations of verl's keys (verl_patches/config/verl_keys.py) and of the recipe's
(verl_patches/config/settings.py), each set into the shipped run config and refused by the validator the dry run
runs, naming the key; all of them at once named in one pass; the relations (GRPO's group of two); and the output
directories' checks (verl_patches/checks/output_dirs.py)."""

from __future__ import annotations

import copy
import os
import shutil
from collections import namedtuple

import pytest
from omegaconf import OmegaConf

from verl_patches.checks import output_dirs, recipe_config as RC
from verl_patches.config import settings as S, verl_keys as VK

RUN = "deepseekv3_256die_random_init"


@pytest.fixture(scope="module")
def base():
    return RC.compose(RUN)


@pytest.fixture(scope="module")
def model():
    return RC.load_model_config(RC.DEFAULT_MODEL_CONFIG)


def _with(cfg, values: dict):
    out = copy.deepcopy(cfg)
    for key, value in values.items():
        OmegaConf.update(out, key, value, merge=False)
    return out


def _recipe_bad_values(key: S.Key) -> list:
    """Bad values for a recipe key, from its declaration: the wrong types, the non-finite, each side of its range."""
    if isinstance(key.kind, tuple):
        return ["no-such-choice", 1]
    if key.kind is bool:
        return ["false", 1]
    if key.kind is str:
        return [1, True]
    out = ["abc", True]
    if key.kind is int:
        out += [1.5, (0 if key.minimum is None else key.minimum) - 1]
        out += [] if key.maximum is None else [key.maximum + 1]
    else:
        out += [float("nan"), float("inf"), 0 if key.minimum is None else key.minimum - 0.5]
    return out


VERL_CASES = [(k.path, v) for k in VK.KEYS for v in k.bad_values()]
RECIPE_CASES = [(f"{S.SECTION}.{name}", v) for name, key in S.KEYS.items()
                if key.kind != "section" and not isinstance(key.kind, str) for v in _recipe_bad_values(key)]


def test_the_shipped_run_config_passes(base, model):
    assert RC.validate(base, model).errors == []


@pytest.mark.parametrize("path, value", VERL_CASES + RECIPE_CASES, ids=lambda x: repr(x)[:40])
def test_each_generated_bad_value_is_refused_by_name(base, model, path, value):
    rep = RC.validate(_with(base, {path: value}), model)
    # A mapping in place of a number also makes its keys unknown ones (check_unknown_keys: "path.a: unknown key").
    named = [e for e in rep.errors if e.startswith((f"{path} ", f"{path}="))]
    assert named, (path, value, rep.errors)
    assert len(named) == 1, named  # said once, however many rules read it
    shown = "null" if value is None else (repr(value) if not isinstance(value, (list, dict)) else "Config")
    assert shown in named[0], named[0]


def test_every_bad_value_is_named_in_one_pass(base, model):
    bad = {path: value for path, value in reversed(VERL_CASES + RECIPE_CASES)}  # one per key: the first generated
    rep = RC.validate(_with(base, bad), model)
    missing = [path for path in bad if not any(e.startswith((f"{path} ", f"{path}=")) for e in rep.errors)]
    assert missing == [], (missing, rep.errors)
    assert len(bad) == len(VK.KEYS) + len({path for path, _ in RECIPE_CASES}) > 40


@pytest.mark.parametrize("key", VK.KEYS, ids=lambda k: k.path)
def test_each_declared_key_accepts_its_good_value(key):
    assert key.problem(key.good_value()) is None


@pytest.mark.parametrize("rel", VK.RELATIONS, ids=lambda r: r.name)
def test_each_relation_is_refused_by_name(base, model, rel):
    rep = RC.validate(_with(base, dict(rel.breaking)), model)
    assert [e for e in rep.errors if all(k.rsplit(".", 1)[1] in e for k in rel.keys)], rep.errors


def test_grpo_with_one_response_per_prompt_is_refused(base, model):
    rep = RC.validate(_with(base, {f"{VK.R}.n": 1}), model)
    assert any(e.startswith(f"{VK.R}.n=1 with algorithm.adv_estimator=grpo") for e in rep.errors), rep.errors
    assert RC.validate(_with(base, {f"{VK.R}.n": 2}), model).errors == []


def test_one_response_per_prompt_without_grpo_is_not_a_group_problem(base):
    # verl's other estimators do not normalise within a group; the recipe itself needs grpo (batch_rules says so).
    cfg = _with(base, {f"{VK.R}.n": 1, "algorithm.adv_estimator": "reinforce_plus_plus"})
    found, named = VK.problems(lambda k: RC._select(cfg, k))
    assert found == [] and named == set()


# ---------- the output directories ----------

def test_a_path_through_a_file_is_refused_even_as_root(tmp_path):
    (tmp_path / "file").write_text("x")
    found = output_dirs.dir_problem(output_dirs.OutputDir("trainer.default_local_dir", str(tmp_path / "file" / "ck")))
    assert found and found.startswith("trainer.default_local_dir=") and "is not a directory" in found


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o555 directory: the path-through-a-file and "
                                              "read-only-mount cases stand for it")
def test_a_read_only_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        found = output_dirs.dir_problem(output_dirs.OutputDir("LOG_DIR", str(ro / "logs")))
    finally:
        ro.chmod(0o755)
    assert found and found.startswith("LOG_DIR=") and "cannot be written" in found


def test_a_read_only_mount_is_refused():
    # /proc is mounted read-only for files a process may create, as root too.
    found = output_dirs.dir_problem(output_dirs.OutputDir("LOG_DIR", "/proc/verl_patches_logs"))
    assert found and found.startswith("LOG_DIR=/proc/verl_patches_logs") and "cannot be written" in found


def test_a_writable_directory_passes_and_nothing_is_left(tmp_path):
    (tmp_path / "mine").write_text("the user's")
    assert output_dirs.dir_problem(output_dirs.OutputDir("LOG_DIR", str(tmp_path / "new" / "logs"))) is None
    assert output_dirs.dir_problem(output_dirs.OutputDir("LOG_DIR", str(tmp_path))) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_too_little_free_space_is_named(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, 10 << 30, 1 << 29))
    found = output_dirs.dir_problem(output_dirs.OutputDir("trainer.default_local_dir", str(tmp_path), 2 << 30))
    assert found and "0.5 GiB free" in found and "at least 2.0 GiB" in found


def test_the_checkpoint_directory_needs_one_checkpoint(base, model, tmp_path):
    cfg = _with(base, {"trainer.save_freq": 10, "trainer.default_local_dir": str(tmp_path / "ck")})
    rep = RC.validate(cfg, model)
    dirs = {d.what: d for d in RC.output_dirs(cfg, model, rep.layout, str(tmp_path / "logs"))}
    assert dirs["trainer.default_local_dir"].need_bytes > 100 * output_dirs.GIB  # DeepSeek-V3's weights and Adam
    assert dirs["LOG_DIR"].need_bytes == output_dirs.FLOOR_BYTES


def test_the_dry_run_names_an_unwritable_directory(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    # save_freq=-1: the checkpoint directory needs the floor only, not one checkpoint of DeepSeek-V3 (about 8.7 TiB).
    argv = ["--config-name", RUN, "--check-outputs", "--log-dir", str(tmp_path / "file" / "logs"),
            f"trainer.default_local_dir={tmp_path / 'ck'}", "trainer.save_freq=-1", f"{S.SECTION}.profile.stages=[update]",
            f"{S.SECTION}.profile.dir={tmp_path / 'file' / 'profiles'}"]
    assert RC.main(argv) == 1
    err = capsys.readouterr().err
    assert f"error: LOG_DIR={tmp_path / 'file' / 'logs'}" in err
    assert f"error: {S.SECTION}.profile.dir=" in err
    assert "error: trainer.default_local_dir" not in err
