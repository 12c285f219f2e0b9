"""Bad inputs tried as a new user would, where the earlier mechanisms did not reach (issue 39): each
ends in a named error or a correct result, never a traceback, a silent choice, a half-written or
mixed output, or a race. The worker node's checks are in tests/recipe/test_cluster_checks.py
(test_a_worker_checks_the_shared_inputs_as_the_head_does)."""

from __future__ import annotations

import importlib.util
import json
import threading

import pytest

from verl_patches.data import prepare as P
from verl_patches.preflight import cli as preflight


def _preflight(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = preflight.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, err


# ---------- python -m verl_patches preflight ----------

def test_preflight_backend_without_its_device_package_is_named(capsys, monkeypatch):
    """hccl without torch_npu ended in AttributeError: module 'torch' has no attribute 'npu'."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_npu" else real(name, *a))
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")
    rc, err = _preflight(capsys, "--backend", "hccl", "--nproc", "1", "--no-plan")
    assert rc == 2
    assert "--backend hccl runs on Ascend NPUs through torch_npu, which is not installed" in err


@pytest.mark.parametrize("opt, value", [("--bucket-mb", "inf"), ("--kv-mb", "1e400"), ("--heartbeat-timeout", "nan")])
def test_preflight_non_finite_number_is_named(capsys, opt, value):
    """--bucket-mb inf ended in OverflowError: cannot convert float infinity to integer (in a rank)."""
    rc, err = _preflight(capsys, opt, value, "--nproc", "1", "--no-plan")
    assert rc == 2
    assert f"argument {opt}: {value!r}: expected a finite number" in err


def test_preflight_unwritable_output_is_named_before_the_run(capsys, tmp_path):
    """--json under a path that cannot be created ended in an OSError traceback after the whole run."""
    (tmp_path / "file").write_text("a file\n")
    rc, err = _preflight(capsys, "--json", str(tmp_path / "file" / "out.json"), "--nproc", "1", "--no-plan")
    assert rc == 2
    assert f"--json {tmp_path / 'file' / 'out.json'}: cannot write in {tmp_path / 'file'}" in err


def test_preflight_unwritable_output_at_the_end_is_named_and_nothing_is_left(capsys, tmp_path, monkeypatch):
    """The results cannot be written after the run (the disk filled): a named error, no partial file."""
    from verl_patches.base import atomic

    target = tmp_path / "r.json"

    def full(path, text, encoding="utf-8"):
        with atomic.atomic_path(path) as tmp:
            tmp.write_text(text[:10])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic, "write_text", full)
    with pytest.raises(preflight.PreflightOutputError, match="--json .*r.json: cannot write the results: No space"):
        preflight.write_json(target, {"report": {}})
    assert list(tmp_path.iterdir()) == []


def test_preflight_option_and_launcher_rank_variable_disagree(capsys, monkeypatch):
    """Under torchrun's variables an explicit --nproc was silently ignored."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    rc, err = _preflight(capsys, "--nproc", "2", "--no-plan")
    assert rc == 2
    assert "--nproc 2 and WORLD_SIZE='1' disagree" in err


def test_preflight_option_and_overlay_variable_disagree(capsys, monkeypatch):
    monkeypatch.setenv("VERL_PATCHES_HEARTBEAT_TIMEOUT_S", "30")
    rc, err = _preflight(capsys, "--heartbeat-timeout", "20", "--no-plan")
    assert rc == 2
    assert "--heartbeat-timeout 20.0 and VERL_PATCHES_HEARTBEAT_TIMEOUT_S='30' disagree" in err
    # An abbreviation argparse accepts is the same option.
    rc, err = _preflight(capsys, "--heartbeat-t", "20", "--no-plan")
    assert rc == 2 and "--heartbeat-timeout 20.0 and VERL_PATCHES_HEARTBEAT_TIMEOUT_S='30' disagree" in err
    # The same value in both is no contradiction.
    assert preflight.parse_args(["--heartbeat-timeout", "30"]).heartbeat_timeout == 30.0


def _fake_results(world: int) -> list[dict]:
    import torch

    return [{"rank": r, "shards": {"direct": {"step": 1, "rollout": {"w": torch.full((2,), float(r))}}}}
            for r in range(world)]


def test_preflight_dump_holds_only_this_runs_files(tmp_path):
    """A dump of 2 ranks, then one of 1 rank into the same directory: rank 1's file of the earlier run
    stayed beside the new manifest. Now the directory is replaced whole and lists what it holds."""
    dump = tmp_path / "dump"
    for world in (2, 1):
        a = preflight.parse_args(["--dump", str(dump), "--nproc", str(world), "--no-plan", "--method", "direct"])
        preflight._dump(dump, preflight._options(a, world), _fake_results(world))
    manifest = json.loads((dump / "manifest.json").read_text())
    assert manifest["world"] == 1
    assert sorted(p.name for p in dump.iterdir()) == sorted([*manifest["written"], "manifest.json"])
    assert not (dump / "rollout_rank00001.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["dump"]  # no temporary sibling left


def test_preflight_dump_never_replaces_a_directory_it_did_not_write(capsys, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine.txt").write_text("keep\n")
    rc, err = _preflight(capsys, "--dump", str(tmp_path / "d"), "--no-plan")
    assert rc == 2 and "holds files an earlier preflight dump did not write (mine.txt)" in err
    assert (tmp_path / "d" / "mine.txt").read_text() == "keep\n"


# ---------- data preparation ----------

def test_prepare_refuses_a_ground_truth_that_is_no_answer(tmp_path):
    """{"answer": "N/A"} was written as a ground truth every response is scored against."""
    f = tmp_path / "in.json"
    f.write_text(json.dumps([{"problem": "1+1?", "answer": "2"}, {"problem": "?", "answer": "N/A"},
                             {"problem": "x", "answer": "a}b"}, {"problem": "y", "answer": "\\boxed{}"}]))
    with pytest.raises(P.MalformedDataError) as e:
        P.prepare("deepscaler", f, tmp_path / "out", test_size=0)
    msg = str(e.value)
    assert "3 malformed row(s)" in msg and "item 2: ground truth 'N/A' is a placeholder, not an answer" in msg
    assert "item 3: ground truth 'a}b' cannot be scored" in msg and "item 4: ground truth '\\\\boxed{}' cannot" in msg
    assert not (tmp_path / "out").exists()
    g = tmp_path / "in.jsonl"
    g.write_text(json.dumps({"question": "q", "answer": "so #### many"}) + "\n")
    with pytest.raises(P.MalformedDataError, match="line 1: the final answer 'many' after '####' is not a number"):
        P.prepare("gsm8k", g, tmp_path / "out", test_size=0)


def test_prepare_refuses_a_split_that_writes_an_unusable_file(tmp_path, capsys):
    """--test-size 0.001 of the sample's rows wrote a test.parquet with no rows and no columns, and succeeded."""
    rows = len(P.load_examples("deepscaler", P.SAMPLES["deepscaler"])[0])
    rc = P.main(["deepscaler", "--out-dir", str(tmp_path / "o"), "--test-size", "0.001"])
    assert rc == 2
    assert f"--test-size 0.001 of {rows} row(s) gives an empty test split" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    # No test split asked for: no test.parquet, and an earlier run's one does not stay beside the new train.
    P.prepare("deepscaler", None, tmp_path / "o", test_size=4)
    assert P.main(["deepscaler", "--out-dir", str(tmp_path / "o"), "--test-size", "0", "--overwrite"]) == 0
    assert "(no test split: no test.parquet written)" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["train.parquet"]


# ---------- a converter's resume ----------

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests.tools.synth_dsv3 import random_bf16, tiny_config, write_hf
    from verl_patches.tools import hf_to_mcore

    root = tmp_path_factory.mktemp("resume")
    cfg = tiny_config()
    write_hf(root / "hf", random_bf16(cfg, seed=3), cfg, shards=2)
    hf_to_mcore.convert(root / "hf", root / "mc", hf_to_mcore.CheckpointLayout(1, 2, 2, None, False),
                        progress=False, verify=False)
    return root


@pytest.mark.parametrize("damage", ["outputs-dropped", "record-garbled", "outputs-not-a-table"])
def test_resume_refuses_an_output_whose_index_is_damaged(converted, tmp_path, capsys, damage):
    """The output's index (its manifest) no longer records .metadata, and .metadata is damaged: the
    resume reported the conversion complete without reading either."""
    import shutil

    from verl_patches.tools import hf_to_mcore, manifest

    mc = tmp_path / "mc"
    shutil.copytree(converted / "mc", mc)
    (mc / ".metadata").write_bytes(b"damaged")
    data = json.loads((mc / manifest.MANIFEST).read_text())
    if damage == "outputs-dropped":
        data["outputs"].pop(".metadata")
    elif damage == "record-garbled":
        data["outputs"][".metadata"] = {"size": "7"}
    else:
        data["outputs"] = []
    (mc / manifest.MANIFEST).write_text(json.dumps(data))
    argv = ["--hf", str(converted / "hf"), "--out", str(mc), "--tp", "1", "--pp", "2", "--ep", "2", "--no-progress",
            "--no-verify"]
    rc = hf_to_mcore.main(argv)
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    assert f"{mc}: its {manifest.MANIFEST}, the index of what hf_to_mcore wrote there, is damaged" in err
    assert f"delete {mc}, or pass --overwrite" in err
    assert hf_to_mcore.main([*argv, "--overwrite"]) == 0  # the named fix works
    from verl_patches.tools import check_ckpt

    assert check_ckpt.problems(mc)[0] == []


def test_two_conversions_into_one_directory_at_once_the_second_is_refused(converted, tmp_path, capsys):
    from verl_patches.base import atomic
    from verl_patches.tools import hf_to_mcore

    out = tmp_path / "mc"
    with atomic.dir_lock(out, wait=False):  # another run holds the directory (a lock is per open file)
        rc = hf_to_mcore.main(["--hf", str(converted / "hf"), "--out", str(out), "--tp", "1", "--pp", "2", "--ep", "2",
                               "--no-progress", "--no-verify"])
    err = capsys.readouterr().err
    assert rc != 0 and f"{out} is being written by another run (process" in err
    assert not out.exists()


# ---------- the tiny run's assets ----------

def test_two_asset_builds_into_one_directory_are_serialised(tmp_path, monkeypatch):
    """Two builds at once: the second deleted the first's temporary files (FileNotFoundError). Now the
    second waits for the first's lock and reuses its finished build."""
    from verl_patches.rigs.tiny import assets

    inside, go, calls = threading.Event(), threading.Event(), []

    def model(out):
        calls.append(out)
        out.mkdir(parents=True, exist_ok=True)
        if len(calls) == 1:
            inside.set()
            assert go.wait(60)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(assets, "write_model", model)
    monkeypatch.setattr(assets, "write_weights", lambda d: (d / "w.safetensors").write_text("w"))
    monkeypatch.setattr(assets, "write_checkpoint",
                        lambda d, o, spec: (o.mkdir(parents=True), (o / ".metadata").write_text("m")))
    monkeypatch.setattr(assets, "write_data", lambda o: (o.mkdir(parents=True), (o / "train.parquet").write_text("t")))
    errors, out = [], tmp_path / "assets"

    def run():
        try:
            assets.build(out)
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    first = threading.Thread(target=run)
    first.start()
    assert inside.wait(60)
    second = threading.Thread(target=run)
    second.start()
    second.join(0.5)  # it waits for the lock (without the lock it deleted the first's files here)
    waited = second.is_alive()
    go.set()
    first.join(60)
    second.join(60)
    assert errors == [] and waited
    assert len(calls) == 1  # the second reused the first's build
    assert sorted(p.name for p in out.iterdir()) == [".complete", "data", "dist_ckpt", "model"]
    # Reuse verifies the build against its index: a damaged file is named, with the fix.
    (out / "dist_ckpt" / ".metadata").write_text("damaged")
    with pytest.raises(assets.AssetsError, match=r"dist_ckpt/.metadata differs from what was written\): remove"):
        assets.build(out)


def test_asset_build_follows_the_platforms_layer_spec(tmp_path, monkeypatch):
    """The checkpoint's names follow the training model's layer spec: MindSpeed-LLM's on the NPU rehearsal
    platform, TE's elsewhere (the CPU build's index as before); a build for one spec is not reused for another."""
    from verl_patches.rigs.tiny import assets

    specs = []
    monkeypatch.setattr(assets, "write_model", lambda o: (o.mkdir(parents=True), (o / "config.json").write_text("{}")))
    monkeypatch.setattr(assets, "write_weights", lambda d: (d / "w.safetensors").write_text("w"))
    monkeypatch.setattr(assets, "write_checkpoint", lambda d, o, spec: (
        specs.append(spec), o.mkdir(parents=True), (o / ".metadata").write_text(spec)))
    monkeypatch.setattr(assets, "write_data", lambda o: (o.mkdir(parents=True), (o / "train.parquet").write_text("t")))
    monkeypatch.delenv("VERL_PATCHES_PLATFORM", raising=False)
    assets.build(tmp_path / "cpu")
    assert specs == ["te"] and "spec" not in json.loads((tmp_path / "cpu" / ".complete").read_text())
    monkeypatch.setenv("VERL_PATCHES_PLATFORM", "npu-rehearsal")
    assert assets.default_spec() == "mindspeed_llm"
    with pytest.raises(assets.AssetsError, match=r"follows the 'te' layer spec; this run's model needs 'mindspeed_llm'"):
        assets.build(tmp_path / "cpu")
    assets.build(tmp_path / "npu")
    assets.build(tmp_path / "npu", "mindspeed_llm")  # reused
    assert specs == ["te", "mindspeed_llm"]
    assert json.loads((tmp_path / "npu" / ".complete").read_text())["spec"] == "mindspeed_llm"
    monkeypatch.delenv("VERL_PATCHES_PLATFORM")
    assets.build(tmp_path / "cpu", "te")  # reused
    assert assets.main([str(tmp_path / "npu"), "--spec", "te"]) == 2 and specs == ["te", "mindspeed_llm"]


def test_asset_build_into_an_unwritable_place_is_named(tmp_path, capsys):
    """Beyond the ten: the asset build under a path that cannot be created ended in a FileExistsError traceback."""
    from verl_patches.rigs.tiny import assets

    (tmp_path / "f").write_text("a file\n")
    assert assets.main([str(tmp_path / "f" / "assets")]) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'f' / 'assets'}: cannot write the assets" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_data_check_refuses_a_ground_truth_no_response_can_match(tmp_path, capsys):
    """The data check (what the launchers' dry run runs) applies the preparation's rule to rows the recipe's
    boxed-answer reward scores, so a parquet file prepared elsewhere gets the same refusal."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_patches.checks import data_check

    rows = [{"data_source": "deepscaler", "prompt": [{"role": "user", "content": "q"}],
             "reward_model": {"ground_truth": gt}, "extra_info": {"index": i}} for i, gt in enumerate(["2", "N/A"])]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "d.parquet"))
    with pytest.raises(ValueError, match=r"row 2: column reward_model.ground_truth: ground truth 'N/A' is a placeholder"):
        data_check.read_rows(tmp_path / "d.parquet")


def test_two_preparations_into_one_directory_at_once_the_second_is_refused(tmp_path, capsys):
    """Beyond the ten: two data preparations into one --out-dir at once could pair one run's train.parquet
    with the other's test.parquet; the second is refused by name and writes nothing."""
    from verl_patches.base import atomic

    with atomic.dir_lock(tmp_path / "o", wait=False):
        assert P.main(["deepscaler", "--out-dir", str(tmp_path / "o"), "--test-size", "4"]) == 2
    assert f"{tmp_path / 'o'} is being written by another run (process" in capsys.readouterr().err
    assert list((tmp_path / "o").iterdir()) == []
