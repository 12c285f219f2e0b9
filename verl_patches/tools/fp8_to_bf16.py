"""Dequantise DeepSeek-V3's released FP8 checkpoint (128x128 block scales, ``weight_scale_inv``) to BF16.

``python -m verl_patches.tools.fp8_to_bf16 --input HF_FP8_DIR --output HF_BF16_DIR [--drop-mtp]``; one shard in memory at a time.

The output is labelled bfloat16: weights that are neither FP8 nor BF16 (FP32, say) are refused by
name rather than copied under that label. Reuse is decided by content, as in
verl_patches/tools/manifest.py (SHA-256 of every input byte, about 1.2 GB/s per core measured).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch

from verl_patches.base import atomic
from verl_patches.tools import manifest
from verl_patches.base.schema import PathArg
from verl_patches.tools.mcore_layout import SafetensorsReader

SCALE_SUFFIX = "_scale_inv"
INDEX_NAME = "model.safetensors.index.json"
BLOCK = 128


class ConversionError(RuntimeError):
    """The input checkpoint is not what the conversion expects; the message names the tensor or file."""


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK, name: str = "weight") -> torch.Tensor:
    """BF16 of ``weight`` (float8_e4m3fn, [M, N]) times its per-block scale ([ceil(M/b), ceil(N/b)])."""
    if weight.dim() != 2:
        raise ConversionError(f"{name}: FP8 weight must be 2-D, got shape {tuple(weight.shape)}")
    m, n = weight.shape
    want = (math.ceil(m / block), math.ceil(n / block))
    if tuple(scale_inv.shape) != want:
        raise ConversionError(f"{name}: scale {tuple(scale_inv.shape)} does not match {block}x{block} blocks of "
                              f"{tuple(weight.shape)} (expected {want})")
    # Edge blocks are partial: expand the scale to whole blocks, then crop to the weight.
    scale = scale_inv.float().repeat_interleave(block, 0)[:m].repeat_interleave(block, 1)[:, :n]
    return (weight.float() * scale).to(torch.bfloat16)


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def _load_index(src: Path) -> dict[str, str]:
    idx = src / INDEX_NAME
    if idx.is_file():
        try:
            weight_map = json.loads(idx.read_text()).get("weight_map")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise ConversionError(f"{idx}: not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{idx}: no weight_map object")
    else:
        files = sorted(src.glob("*.safetensors"))
        if len(files) != 1:
            raise ConversionError(f"{src}: no {INDEX_NAME} and {len(files)} safetensors files (need the index or exactly one)")
        # Lazy: safetensors and tqdm when a checkpoint is converted (--help and argument errors run without them).
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(files[0], "pt") as f:
                weight_map = {k: files[0].name for k in f.keys()}
        except SafetensorError as e:
            raise ConversionError(f"{files[0]}: not a safetensors file ({e})") from None
    missing = sorted({f for f in weight_map.values() if not (src / f).is_file()})
    if missing:
        raise ConversionError(f"{src}: index names shard(s) that are not there: {missing[:5]}")
    return weight_map


def convert(src: Path, dst: Path, drop_mtp: bool = False, progress: bool = True, overwrite: bool = False) -> dict:
    """Write the BF16 checkpoint to ``dst``; finished shards of a previous run on the same input are
    kept (resumable), a directory holding anything else is refused unless ``overwrite``."""
    # Lazy: safetensors and tqdm when a checkpoint is converted (--help and argument errors run without them).
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise ConversionError(f"--input {src} is not a directory (the FP8 HF checkpoint)")
    if src.resolve() == dst.resolve():
        raise ConversionError("output directory must differ from the input")
    config = None
    if (src / "config.json").is_file():
        try:
            config = json.loads((src / "config.json").read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"{src / 'config.json'}: not readable JSON ({e})") from None
        if not isinstance(config, dict):
            raise ConversionError(f"{src / 'config.json'}: expected a JSON object")
    weight_map = _load_index(src)
    n_layers = config.get("num_hidden_layers") if config else None
    if drop_mtp and not (isinstance(n_layers, int) and not isinstance(n_layers, bool)):
        raise ConversionError("--drop-mtp needs config.json with an integer num_hidden_layers")

    def keep(name: str) -> bool:
        layer = _layer_of(name)
        return not (drop_mtp and layer is not None and layer >= n_layers)

    shards = sorted(set(weight_map.values()))
    wrong = not_bf16_weights(src, weight_map, keep)
    if wrong:
        raise ConversionError(f"{src}: the output is labelled bfloat16, but weight(s) that are not FP8 would be copied "
                              f"with another dtype: {'; '.join(wrong[:3])}"
                              + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else "")
                              + " (this tool dequantises FP8 checkpoints whose other weights are bfloat16)")
    inputs = {s: src / s for s in shards}
    inputs.update({p.name: p for p in (src / "config.json", src / INDEX_NAME) if p.is_file()})
    try:
        resuming = manifest.claim(dst, "fp8_to_bf16", src, manifest.identify(inputs), {"drop_mtp": drop_mtp},
                                  overwrite, _bf16_owned)
    except manifest.OutputDirError as e:
        raise ConversionError(str(e)) from None
    new_map: dict[str, str] = {}
    stats = {"shards": len(shards), "skipped_existing": 0, "dequantized": 0, "copied": 0, "dropped": 0}
    stats["changed_on_resume"] = (manifest.read(dst) or {}).get("changed_on_resume", [])
    for shard in tqdm(shards, desc="fp8->bf16", unit="shard", disable=not progress):
        names = [k for k, v in weight_map.items() if v == shard and not k.endswith(SCALE_SUFFIX)]
        kept = [k for k in names if keep(k)]
        stats["dropped"] += len(names) - len(kept)
        for k in kept:
            new_map[k] = shard
        out = dst / shard
        if resuming and manifest.reusable(dst, shard):
            # Recorded after a complete save for this same input content, and unchanged since.
            stats["skipped_existing"] += 1
            continue
        manifest.forget(dst, shard)
        tensors: dict[str, torch.Tensor] = {}
        try:
            with safe_open(src / shard, "pt") as f:
                for k in kept:
                    t = f.get_tensor(k)
                    if t.dtype == torch.float8_e4m3fn:
                        tensors[k] = dequantize(t, _scale_for(src, weight_map, k), name=k)
                        stats["dequantized"] += 1
                    else:
                        tensors[k] = t
                        stats["copied"] += 1
        except SafetensorError as e:
            raise ConversionError(f"{src / shard}: cannot be read as safetensors ({e})") from None
        with atomic.atomic_path(out) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        manifest.record(dst, shard)
        del tensors
    for stale in dst.glob("*.partial"):
        stale.unlink()  # left by an interrupted run whose shard has been written since
    total = sum((dst / s).stat().st_size for s in set(new_map.values()))
    atomic.write_text(dst / INDEX_NAME, json.dumps({"metadata": {"total_size": total},
                                                    "weight_map": dict(sorted(new_map.items()))}, indent=2))
    if config is not None:
        config.pop("quantization_config", None)
        config["torch_dtype"] = "bfloat16"
        if drop_mtp:
            config["num_nextn_predict_layers"] = 0
        atomic.write_text(dst / "config.json", json.dumps(config, indent=2))
    manifest.record(dst, INDEX_NAME, *(["config.json"] if config is not None else []))
    # Tokenizer, generation config, modelling code: everything that is not a weight.
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name not in (INDEX_NAME, "config.json", manifest.MANIFEST) \
                and not p.name.endswith(".partial"):
            with atomic.atomic_path(dst / p.name) as tmp:
                shutil.copy2(p, tmp)
    manifest.complete(dst)
    return stats


# Dtypes a weight may keep when copied: the output is BF16 apart from FP32 vectors (the router's
# e_score_correction_bias is FP32 in DeepSeek's release) and integer buffers.
_COPY_OK = {"BF16", "F8_E4M3"}


def not_bf16_weights(src: Path, weight_map: dict[str, str], keep) -> list[str]:
    """Weights (2-D or more, kept, not FP8) that are not bfloat16, read from the shards' headers:
    the output's config says bfloat16 and must not be wrong about them."""
    by_shard: dict[str, list[str]] = {}
    for k, v in weight_map.items():
        if not k.endswith(SCALE_SUFFIX) and keep(k):
            by_shard.setdefault(v, []).append(k)
    out = []
    for shard, names in sorted(by_shard.items()):
        try:
            with SafetensorsReader(src / shard) as f:
                header = f.header
        except (ValueError, UnicodeDecodeError) as e:
            raise ConversionError(f"{src / shard}: cannot be read as safetensors ({e})") from None
        for k in names:
            info = header.get(k)
            if not isinstance(info, dict):
                raise ConversionError(f"{src / shard}: the index maps {k} to it but its header lacks it")
            dtype, shape = info.get("dtype"), info.get("shape") or []
            if len(shape) >= 2 and str(dtype).startswith(("F", "BF")) and dtype not in _COPY_OK:
                out.append(f"{k} is {dtype}")
    return out


def _bf16_owned(entry: Path) -> bool:
    """What --overwrite may delete: the weights, index and config this tool writes (the copied
    tokenizer files are replaced by the next run anyway)."""
    return entry.name.endswith((".safetensors", ".partial")) or entry.name in (INDEX_NAME, "config.json")


def _scale_for(src: Path, weight_map: dict[str, str], name: str) -> torch.Tensor:
    # Lazy: safetensors and tqdm when a checkpoint is converted (--help and argument errors run without them).
    from safetensors import safe_open

    key = name + SCALE_SUFFIX
    if key not in weight_map:
        raise ConversionError(f"{name} is float8_e4m3fn but {key} is not in the checkpoint")
    # The scale may sit in another shard: read just that tensor, not the shard.
    with safe_open(src / weight_map[key], "pt") as f:
        return f.get_tensor(key)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.tools.fp8_to_bf16", description=__doc__)
    p.add_argument("--input", type=PathArg("input directory"), required=True, help="HF checkpoint with FP8 weights")
    p.add_argument("--output", type=PathArg("output directory"), required=True)
    p.add_argument("--drop-mtp", action="store_true", help="drop the MTP layers and set num_nextn_predict_layers=0")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an output directory this tool wrote for another input or options")
    args = p.parse_args(argv)
    try:
        stats = convert(args.input, args.output, args.drop_mtp, progress=not args.no_progress, overwrite=args.overwrite)
    except (ConversionError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename}: {e.strerror or e}" if e.filename else f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
