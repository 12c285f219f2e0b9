"""FP8 (128x128 block) to BF16 conversion on a tiny synthetic DeepSeek-V3 FP8 checkpoint.

The reference dequantisation here is an explicit loop over blocks, independent of the tool's broadcasting.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from verl_patches.tools import fp8_to_bf16 as F

from tests.tools.synth_dsv3 import is_quantized, random_bf16, tiny_config, write_hf

FP8_MAX = 448.0


def quantize_blocks(w: torch.Tensor, block: int):
    """What DeepSeek's release did: per block, scale = amax / 448, store w / scale in FP8."""
    m, n = w.shape
    sm, sn = -(-m // block), -(-n // block)
    scale = torch.empty(sm, sn, dtype=torch.float32)
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    for i in range(sm):
        for j in range(sn):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s = blk.abs().max().clamp(min=1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def reference_dequant(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            sl = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            out[sl] = q[sl].float() * scale[i, j]
    return out.to(torch.bfloat16)


def test_dequantize_matches_reference_with_partial_edge_blocks():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g)  # 300 = 2*128 + 44, 200 = 128 + 72: partial edge blocks
    q, s = quantize_blocks(w, 128)
    got = F.dequantize(q, s)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, reference_dequant(q, s, 128))
    # And it is a faithful dequantisation (FP8 e4m3 keeps ~2 significant digits).
    assert torch.allclose(got.float(), w, rtol=0.07, atol=0.02 * float(w.abs().max()))


def test_dequantize_rejects_mismatched_scale():
    q = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(F.ConversionError, match="does not match 128x128 blocks"):
        F.dequantize(q, torch.ones(3, 2), name="x.weight")


@pytest.fixture
def fp8_checkpoint(tmp_path):
    # The tiny model's weights are smaller than one 128x128 block; partial blocks are covered above.
    cfg = tiny_config(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
                      num_nextn_predict_layers=1)
    bf16 = random_bf16(cfg, seed=3, with_mtp=True)
    tensors, ref = {}, {}
    for name, w in bf16.items():
        if is_quantized(name):
            q, s = quantize_blocks(w.float() * 50, 128)
            tensors[name], tensors[name + "_scale_inv"] = q, s
            ref[name] = reference_dequant(q, s, 128)
        else:
            tensors[name] = w
            ref[name] = w
    src = tmp_path / "fp8"
    write_hf(src, tensors, cfg, shards=3)
    # Move one scale to a different shard than its weight, as in the released checkpoint.
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    wm = idx["weight_map"]
    victim = next(k for k in wm if k.endswith("_scale_inv") and wm[k] == wm[k[: -len("_scale_inv")]])
    other = next(f for f in sorted(set(wm.values())) if f != wm[victim])
    # Clone: load_file's tensors may map the file that is rewritten just below.
    a, b = ({k: v.clone() for k, v in load_file(str(src / f)).items()} for f in (wm[victim], other))
    b[victim] = a.pop(victim)
    save_file(a, str(src / wm[victim]))
    save_file(b, str(src / other))
    wm[victim] = other
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    return src, cfg, ref


def _read_all(d):
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, f in wm.items():
        with safe_open(d / f, "pt") as h:
            out[name] = h.get_tensor(name)
    return out


def test_convert_checkpoint(fp8_checkpoint, tmp_path):
    src, cfg, ref = fp8_checkpoint
    dst = tmp_path / "bf16"
    stats = F.convert(src, dst, drop_mtp=True, progress=False)
    got = _read_all(dst)
    n_layers = cfg["num_hidden_layers"]
    want = {k: v for k, v in ref.items() if not k.startswith(f"model.layers.{n_layers}.")}
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), k
    assert stats["dropped"] > 0 and stats["dequantized"] == sum(is_quantized(k) for k in want)
    out_cfg = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in out_cfg and out_cfg["num_nextn_predict_layers"] == 0
    assert (dst / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    assert not list(dst.glob("*.partial"))


def test_resume_keeps_finished_shards(fp8_checkpoint, tmp_path):
    src, _, ref = fp8_checkpoint
    dst = tmp_path / "bf16"
    F.convert(src, dst, progress=False)
    shards = sorted(dst.glob("*.safetensors"))
    stamp = {p: p.stat().st_mtime_ns for p in shards}
    shards[0].unlink()
    (dst / (shards[1].name + ".partial")).write_bytes(b"interrupted")
    stats = F.convert(src, dst, progress=False)
    assert stats["skipped_existing"] == len(shards) - 1
    assert all(p.stat().st_mtime_ns == stamp[p] for p in shards[1:])
    got = _read_all(dst)
    assert all(torch.equal(got[k], ref[k]) for k in got)
    assert not list(dst.glob("*.partial"))


def test_missing_scale_is_named(tmp_path):
    cfg = tiny_config()
    src = tmp_path / "bad"
    write_hf(src, {"model.layers.0.self_attn.o_proj.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}, cfg, shards=1)
    assert F.main(["--input", str(src), "--output", str(tmp_path / "o"), "--no-progress"]) == 1
    with pytest.raises(F.ConversionError, match="o_proj.weight_scale_inv is not in the checkpoint"):
        F.convert(src, tmp_path / "o2", progress=False)
