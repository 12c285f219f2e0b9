"""The converters never mix two inputs in one output directory (finding 3): a partial or finished
output of another input, or of other options, is refused unless --overwrite; a resume continues
only its own input's output; a directory the tools did not write is never touched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.tools.synth_dsv3 import random_bf16, tiny_config, write_hf
from verl_patches.tools import fp8_to_bf16 as F
from verl_patches.tools import hf_to_mcore as H
from verl_patches.tools import manifest
from verl_patches.tools import mcore_to_hf as M
from verl_patches.tools.mcore_layout import CheckpointLayout

LAYOUT = CheckpointLayout(tp=2, pp=2, ep=2, num_layer_list=(1, 3), moe_tp_extend_ep=True)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two checkpoints of identical names, shapes and file sizes, different values."""
    root = tmp_path_factory.mktemp("models")
    cfg = tiny_config()
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        tensors = random_bf16(cfg, seed=seed)
        write_hf(root / name, tensors, cfg, shards=3)
        out[name] = (root / name, tensors)
    return out


def _read_hf(d: Path) -> dict[str, torch.Tensor]:
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    got: dict[str, torch.Tensor] = {}
    for f in set(wm.values()):
        got.update(load_file(str(d / f)))
    return got


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


def _interrupted_hf_to_mcore(hf: Path, out: Path, monkeypatch, after: int = 20) -> None:
    real, calls = H.build, {"n": 0}

    def dying_build(*a):
        calls["n"] += 1
        if calls["n"] == after:
            raise KeyboardInterrupt("simulated kill")
        return real(*a)

    monkeypatch.setattr(H, "build", dying_build)
    with pytest.raises(KeyboardInterrupt):
        H.convert(hf, out, LAYOUT, progress=False, verify=False)
    monkeypatch.setattr(H, "build", real)


def test_hf_to_mcore_refuses_another_inputs_partial_output(two_models, tmp_path, monkeypatch, capsys):
    (a, _), (b, tb) = two_models["a"], two_models["b"]
    out = tmp_path / "mc"
    _interrupted_hf_to_mcore(a, out, monkeypatch)
    before = {p.name: p.read_bytes() for p in out.glob("*.distcp")}
    assert before
    rc = H.main(["--hf", str(b), "--out", str(out), "--no-verify", "--no-progress", "--tp", "2", "--pp", "2", "--ep", "2",
                 "--num-layer-list", "1,3", "--moe-tp-extend-ep"])
    err = capsys.readouterr().err
    assert rc == 1 and "a different input" in err and str(a) in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.glob("*.distcp")} == before  # nothing touched
    # Other options over the same input's partial output: refused as well, naming the option.
    with pytest.raises(H.ConversionError, match=r"other options: spec='te' \(now 'local'\)"):
        H.convert(a, out, LAYOUT, spec="local", progress=False, verify=False)
    # Asked to overwrite: every tensor is b's, none of a's survives.
    H.convert(b, out, LAYOUT, progress=False, verify=False, overwrite=True)
    assert manifest.is_complete(out) is True
    M.convert(out, b / "config.json", tmp_path / "back", progress=False)
    assert _same(_read_hf(tmp_path / "back"), tb)


def test_hf_to_mcore_resumes_its_own_input(two_models, tmp_path, monkeypatch):
    a, ta = two_models["a"]
    out = tmp_path / "mc"
    _interrupted_hf_to_mcore(a, out, monkeypatch)
    assert manifest.is_complete(out) is False
    stats = H.convert(a, out, LAYOUT, progress=False)
    assert stats["resumed"] > 0 and stats["verified"] > 0
    assert manifest.is_complete(out) is True
    M.convert(out, a / "config.json", tmp_path / "back", progress=False)
    assert _same(_read_hf(tmp_path / "back"), ta)


def test_mcore_to_hf_never_keeps_another_checkpoints_shards(two_models, tmp_path, capsys):
    (a, _), (b, tb) = two_models["a"], two_models["b"]
    for name, src in (("ma", a), ("mb", b)):
        H.convert(src, tmp_path / name, LAYOUT, progress=False, verify=False)
    back = tmp_path / "back"
    M.convert(tmp_path / "ma", a / "config.json", back, progress=False)
    first = sorted(back.glob("model-*.safetensors"))[0]
    first.unlink()  # an interrupted run: one shard still to write
    rc = M.main(["--ckpt", str(tmp_path / "mb"), "--config", str(b / "config.json"), "--out", str(back), "--no-progress"])
    assert rc == 1 and "a different input" in capsys.readouterr().err
    assert not first.exists()
    stats = M.convert(tmp_path / "mb", b / "config.json", back, progress=False, overwrite=True)
    assert stats["resumed"] == 0 and _same(_read_hf(back), tb)


def test_fp8_to_bf16_never_pairs_one_inputs_weights_with_anothers_config(two_models, tmp_path, capsys):
    (a, ta), (b0, _) = two_models["a"], two_models["b"]
    # b with a different config: what the bug paired with a's weights.
    b = tmp_path / "b"
    shutil.copytree(b0, b)
    cfg = json.loads((b / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (b / "config.json").write_text(json.dumps(cfg))
    dst = tmp_path / "bf16"
    F.convert(a, dst, progress=False)
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    rc = F.main(["--input", str(b), "--output", str(dst), "--no-progress"])
    assert rc == 1 and "a different input" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    assert F.convert(a, dst, progress=False)["skipped_existing"] == 3  # its own input: resumed
    assert _same(_read_hf(dst), ta)


@pytest.mark.parametrize("tool", ["hf_to_mcore", "mcore_to_hf", "fp8_to_bf16"])
def test_a_directory_the_tools_did_not_write_is_never_touched(two_models, tmp_path, tool, capsys):
    a, _ = two_models["a"]
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "model-00001-of-00006.safetensors").write_text("not a shard")
    if tool == "hf_to_mcore":
        H.convert(a, tmp_path / "mc", LAYOUT, progress=False, verify=False)
        argv = ["--hf", str(a), "--out", str(out), "--no-progress", "--overwrite", "--tp", "2", "--pp", "2",
                "--ep", "2", "--num-layer-list", "1,3", "--moe-tp-extend-ep"]
        main = H.main
    elif tool == "mcore_to_hf":
        H.convert(a, tmp_path / "mc", LAYOUT, progress=False, verify=False)
        argv = ["--ckpt", str(tmp_path / "mc"), "--config", str(a / "config.json"), "--out", str(out), "--no-progress",
                "--overwrite"]
        main = M.main
    else:
        argv = ["--input", str(a), "--output", str(out), "--no-progress", "--overwrite"]
        main = F.main
    assert main(argv) == 1
    assert "was not written by this tool" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00006.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me"
