"""Identity by content (verl_patches/tools/manifest.py): the converters tell two inputs apart by
every byte, never by names, sizes or sampled bytes; they reuse a file they wrote only when it
still has the content they recorded; and they refuse outputs whose config and tensors disagree,
or whose dtype label would be wrong."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.tools.synth_dsv3 import random_bf16, tiny_config, write_hf
from verl_patches.tools import check_ckpt
from verl_patches.tools import fp8_to_bf16 as F
from verl_patches.tools import hf_to_mcore as H
from verl_patches.tools import manifest
from verl_patches.tools import mcore_to_hf as M
from verl_patches.tools.mcore_layout import CheckpointLayout, SafetensorsReader

LAYOUT = CheckpointLayout(tp=2, pp=2, ep=2, num_layer_list=(1, 3), moe_tp_extend_ep=True)
ARGS = ["--tp", "2", "--pp", "2", "--ep", "2", "--num-layer-list", "1,3", "--moe-tp-extend-ep", "--no-progress"]
EDGE = 1 << 16  # what the old fingerprint read at each end of each file


def _old_sampled_fingerprint(files) -> str:
    """The identity the tools used before: name, size and 64 KiB at each end of each file."""
    h = hashlib.sha256()
    for f in sorted(Path(x) for x in files):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(EDGE))
            if size > 2 * EDGE:
                fh.seek(size - EDGE)
            h.update(fh.read(EDGE))
    return h.hexdigest()


def _flip_in_the_middle(d: Path) -> str:
    """Change one value of a tensor stored more than 64 KiB from both ends of its shard; returns its name."""
    for shard in sorted(d.glob("*.safetensors")):
        size = shard.stat().st_size
        with SafetensorsReader(shard) as f:
            base, header = f.base, dict(f.header)
        for name, info in sorted(header.items()):
            start, end = (base + o for o in info["data_offsets"])
            if start > EDGE and end < size - EDGE and name.endswith("proj.weight"):
                with open(shard, "r+b") as fh:
                    fh.seek(start)
                    b = fh.read(1)
                    fh.seek(start)
                    fh.write(bytes([b[0] ^ 1]))
                return name
    raise AssertionError("no tensor far enough from both ends of its shard")


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """A and B: same names, shapes, sizes and first and last 64 KiB of every file; one value differs."""
    root = tmp_path_factory.mktemp("twins")
    cfg = tiny_config()
    write_hf(root / "a", random_bf16(cfg, seed=3), cfg, shards=2)
    shutil.copytree(root / "a", root / "b")
    changed = _flip_in_the_middle(root / "b")
    files = lambda d: [p for p in d.iterdir() if p.is_file()]  # noqa: E731
    assert _old_sampled_fingerprint(files(root / "a")) == _old_sampled_fingerprint(files(root / "b"))
    return root / "a", root / "b", changed


def _interrupt(monkeypatch, target, name: str, after: int):
    real, calls = getattr(target, name), {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == after:
            raise KeyboardInterrupt("simulated kill")
        return real(*a, **k)

    monkeypatch.setattr(target, name, dying)
    return lambda: monkeypatch.setattr(target, name, real)


def _hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for f in set(wm.values()):
        out.update(load_file(str(d / f)))
    return out


def test_hf_to_mcore_tells_same_shaped_twins_apart(twins, tmp_path, monkeypatch, capsys):
    a, b, _ = twins
    out = tmp_path / "mc"
    restore = _interrupt(monkeypatch, H, "build", 20)
    with pytest.raises(KeyboardInterrupt):
        H.convert(a, out, LAYOUT, progress=False, verify=False)
    restore()
    before = {p.name: p.read_bytes() for p in out.glob("*.distcp")}
    # The case: B over A's partial output with --no-verify used to exit 0, "resumed".
    rc = H.main(["--hf", str(b), "--out", str(out), "--no-verify", *ARGS])
    err = capsys.readouterr().err
    assert rc == 1 and "is a different input than" in err and str(a) in err and str(b) in err
    assert "model-0000" in err  # names the shard whose content differs
    assert {p.name: p.read_bytes() for p in out.glob("*.distcp")} == before
    # A finished output of A: B is refused again and the manifest keeps naming A.
    H.convert(a, out, LAYOUT, progress=False, verify=False)
    with pytest.raises(manifest.InputMismatchError) as info:
        manifest.claim(out, "hf_to_mcore", b, H.hf_identity(b, H.load_hf_index(b)[1]),
                       manifest.read(out)["options"], False, H._mcore_owned)
    assert str(a) in str(info.value) and str(b) in str(info.value)
    assert manifest.read(out)["input"] == str(a) and manifest.is_complete(out) is True


def test_fp8_to_bf16_and_mcore_to_hf_tell_twins_apart(twins, tmp_path, capsys):
    a, b, _ = twins
    F.convert(a, tmp_path / "bf", progress=False)
    assert F.main(["--input", str(b), "--output", str(tmp_path / "bf"), "--no-progress"]) == 1
    assert "is a different input than" in capsys.readouterr().err
    H.convert(a, tmp_path / "ma", LAYOUT, progress=False, verify=False)
    H.convert(b, tmp_path / "mb", LAYOUT, progress=False, verify=False)
    M.convert(tmp_path / "ma", a / "config.json", tmp_path / "back", progress=False)
    assert M.main(["--ckpt", str(tmp_path / "mb"), "--config", str(b / "config.json"), "--out",
                   str(tmp_path / "back"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "is a different input than" in err and "ckpt/" in err


def test_a_moved_input_of_the_same_content_resumes(twins, tmp_path):
    a, _, _ = twins
    out = tmp_path / "mc"
    H.convert(a, out, LAYOUT, progress=False, verify=False)
    moved = tmp_path / "moved"
    shutil.copytree(a, moved)
    stats = H.convert(moved, out, LAYOUT, progress=False, verify=False)
    assert stats["resumed"] == stats["units"] and stats["changed_on_resume"] == []
    assert manifest.read(out)["input"] == str(moved)


def test_a_truncated_metadata_is_rebuilt_not_resumed(twins, tmp_path, monkeypatch):
    a, _, _ = twins
    out = tmp_path / "mc"
    # Partial output: killed during verification, after .metadata was written.
    restore = _interrupt(monkeypatch, H, "verify_checkpoint", 1)
    with pytest.raises(KeyboardInterrupt):
        H.convert(a, out, LAYOUT, progress=False)
    restore()
    assert manifest.is_complete(out) is False and (out / ".metadata").is_file()
    full = (out / ".metadata").read_bytes()
    (out / ".metadata").write_bytes(full[: len(full) // 2])
    stats = H.convert(a, out, LAYOUT, progress=False)
    assert stats["resumed"] == stats["units"] and stats["verified"] > 0
    assert (out / ".metadata").read_bytes() == full
    # Finished output: the same damage is found by re-hashing, and the output written again.
    (out / ".metadata").write_bytes(full[:100])
    assert check_ckpt.problems(out)[0]  # what a reader would have met
    stats = H.convert(a, out, LAYOUT, progress=False, verify=False)
    assert [c.split(" ")[0] for c in stats["changed_on_resume"]] == [".metadata"]
    assert "truncated" in stats["changed_on_resume"][0]
    assert check_ckpt.problems(out)[0] == [] and manifest.is_complete(out) is True
    M.convert(out, a / "config.json", tmp_path / "back", progress=False)
    want = _hf_tensors(a)
    got = _hf_tensors(tmp_path / "back")
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_a_resumed_layer_file_with_other_content_is_written_again(twins, tmp_path, monkeypatch):
    a, _, _ = twins
    out = tmp_path / "mc"
    restore = _interrupt(monkeypatch, H, "build", 20)
    with pytest.raises(KeyboardInterrupt):
        H.convert(a, out, LAYOUT, progress=False, verify=False)
    restore()
    first = out / "embedding.distcp"
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other content
    first.write_bytes(bytes(data))
    done = len(list((out / H.STATE_DIR).glob("*.meta")))
    stats = H.convert(a, out, LAYOUT, progress=False)  # verification would fail on the damaged layer
    assert stats["resumed"] == done - 1 and stats["verified"] > 0


def test_mcore_to_hf_refuses_a_config_that_does_not_describe_the_tensors(twins, tmp_path, capsys):
    a, _, _ = twins
    H.convert(a, tmp_path / "mc", LAYOUT, progress=False, verify=False)
    cfg = json.loads((a / "config.json").read_text())
    for change, needle in (({"hidden_size": 128}, "the config gives (1000, 128)"),
                           ({"vocab_size": 999}, "model.embed_tokens.weight is (1000, 64)"),
                           ({"num_hidden_layers": 3}, "tensor(s) the config's model lacks"),
                           ({"n_routed_experts": 8}, "cannot hold the config's 16 source tensor(s)")):
        other = tmp_path / f"cfg_{next(iter(change))}.json"
        other.write_text(json.dumps({**cfg, **change}))
        out = tmp_path / f"hf_{next(iter(change))}"
        rc = M.main(["--ckpt", str(tmp_path / "mc"), "--config", str(other), "--out", str(out), "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 1 and "does not describe the checkpoint" in err and needle in err, (change, err)
        assert not out.exists()  # refused before anything is written


def test_hf_to_mcore_refuses_a_config_that_does_not_describe_the_tensors(twins, tmp_path):
    a, _, _ = twins
    bad = tmp_path / "bad"
    shutil.copytree(a, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "kv_lora_rank": 16}))
    with pytest.raises(H.ConversionError, match=r"does not describe the tensors.*kv_a_proj_with_mqa.weight is \(40, 64\)"):
        H.convert(bad, tmp_path / "mc", LAYOUT, progress=False)
    assert not (tmp_path / "mc").exists()


def test_fp8_to_bf16_refuses_to_label_fp32_weights_bf16(tmp_path, capsys):
    cfg = tiny_config()
    tensors = {k: v.float() for k, v in random_bf16(cfg, seed=5).items()}
    write_hf(tmp_path / "fp32", tensors, cfg, shards=2)
    rc = F.main(["--input", str(tmp_path / "fp32"), "--output", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "labelled bfloat16" in err and "is F32" in err and "model.embed_tokens.weight" in err
    assert not (tmp_path / "o").exists()
    # An FP32 vector (the router's bias, as in DeepSeek's release) is no reason to refuse.
    tensors = {k: (v.float() if k.endswith("e_score_correction_bias") else v)
               for k, v in random_bf16(cfg, seed=5).items()}
    write_hf(tmp_path / "mixed", tensors, cfg, shards=2)
    assert F.convert(tmp_path / "mixed", tmp_path / "o2", progress=False)["copied"] == len(tensors)


def test_an_older_sampled_manifest_is_not_trusted(twins, tmp_path, capsys):
    a, _, _ = twins
    out = tmp_path / "bf"
    F.convert(a, out, progress=False)
    data = manifest.read(out)
    data.pop("format")
    (out / manifest.MANIFEST).write_text(json.dumps(data))
    assert F.main(["--input", str(a), "--output", str(out), "--no-progress"]) == 1
    assert "identified its input by sampled bytes only" in capsys.readouterr().err
    assert F.convert(a, out, progress=False, overwrite=True)["skipped_existing"] == 0


def test_hash_file_reads_every_byte_and_its_rate(tmp_path):
    """The cost the tools' docs state: SHA-256 of a 64 MiB file, streamed (printed, -s shows it)."""
    f = tmp_path / "blob"
    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
    f.write_bytes(data)
    t = time.perf_counter()
    got = manifest.hash_file(f)
    rate = len(data) / (time.perf_counter() - t) / 1e6
    assert got == hashlib.sha256(data).hexdigest()
    print(f"manifest.hash_file: {rate:.0f} MB/s (file in the page cache)")
    g = tmp_path / "blob2"
    g.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert manifest.identify({"x": f})["sha256"] != manifest.identify({"x": g})["sha256"]
