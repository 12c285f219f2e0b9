"""Convert a Megatron-core torch_dist DeepSeek-V3 checkpoint back to HF safetensors, one layer per shard (for checking).

``python -m verl_patches.tools.mcore_to_hf --ckpt DIR --config HF_CONFIG.json --out DIR``; reads any chunking, ours or Megatron's.

The config must describe the checkpoint's tensors (shapes, expert count, depth); outputs whose
config.json would not match their tensors are refused. Reuse is decided by content, as in
verl_patches/tools/manifest.py (SHA-256 of every input byte, about 1.2 GB/s per core measured).
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import sys
from pathlib import Path

import torch

from verl_patches.base import atomic
from verl_patches.tools import manifest
from verl_patches.tools.hf_to_mcore import (ConversionError, check_model_config, read_json, shape_mismatches, unit_plan,
                                            units)
from verl_patches.tools.mcore_layout import DistCheckpointReader, row_sizes
from verl_patches.base.schema import PathArg


def split(how: str, t: torch.Tensor, sources: tuple[str, ...], cfg: dict | None = None) -> dict[str, torch.Tensor]:
    """Inverse of hf_to_mcore.build: HF tensors (contiguous copies) from one Megatron tensor (``cfg``, the
    model config, gives cat_rows' row counts)."""
    if how == "copy":
        return {sources[0]: t}
    if how == "cat":
        gate, up = t.chunk(2, dim=0)
        return {sources[0]: gate.clone(), sources[1]: up.clone()}
    if how == "cat_rows":
        return {s: part.clone() for s, part in zip(sources, t.split(row_sizes(cfg, sources), dim=0))}
    if how == "experts_fc1":
        out = {}
        for x in range(t.shape[0]):
            gate, up = t[x].chunk(2, dim=0)
            out[sources[2 * x]], out[sources[2 * x + 1]] = gate.clone(), up.clone()
        return out
    if how == "experts_fc2":
        return {sources[x]: t[x].clone() for x in range(t.shape[0])}
    raise ValueError(how)


def detect_spec(reader: DistCheckpointReader) -> str:
    names = set(reader.names())
    if any(n.endswith("self_attention.linear_qkv.weight") for n in names):
        return "mindspeed_llm"
    return "te" if any(n.endswith("linear_kv_up_proj.layer_norm_weight") for n in names) else "local"


def input_identity(ckpt: Path, config: Path) -> dict:
    """The identity by content of what the output is made from: the config and the checkpoint's
    metadata and every data file, all bytes hashed."""
    ckpt = Path(ckpt)
    files = {"config": Path(config), "ckpt/.metadata": ckpt / ".metadata"}
    files.update({f"ckpt/{p.name}": p for p in sorted(ckpt.glob("*.distcp"))})
    return manifest.identify(files)


def hf_shapes(how: str, shape: tuple[int, ...], sources: tuple[str, ...], cfg: dict | None = None) -> dict[str, tuple[int, ...]]:
    """The HF shapes ``split`` makes of a Megatron tensor of ``shape`` (from metadata, no data read)."""
    if how == "copy":
        return {sources[0]: shape}
    if how == "cat":
        return {s: (shape[0] // 2, *shape[1:]) for s in sources}
    if how == "cat_rows":
        return {s: (rows, *shape[1:]) for s, rows in zip(sources, row_sizes(cfg, sources))}
    if how == "experts_fc1":
        return {s: (shape[1] // 2, *shape[2:]) for s in sources}
    if how == "experts_fc2":
        return {s: tuple(shape[1:]) for s in sources}
    raise ValueError(how)


def _splittable(how: str, size: tuple[int, ...], sources: tuple[str, ...], cfg: dict) -> bool:
    n_sources = len(sources)
    if how == "cat":
        return len(size) >= 1 and size[0] % 2 == 0
    if how == "cat_rows":
        return len(size) >= 1 and size[0] == sum(row_sizes(cfg, sources))
    if how == "experts_fc1":
        return len(size) == 3 and 2 * size[0] == n_sources and size[1] % 2 == 0
    if how == "experts_fc2":
        return len(size) == 3 and size[0] == n_sources
    return True


def config_mismatches(reader: DistCheckpointReader, cfg: dict, spec: str) -> list[str]:
    """Where ``cfg`` and the checkpoint's tensors disagree: a shape the config gives otherwise, a
    tensor the config's model has and the checkpoint lacks, or a tensor the config's model lacks."""
    meta = reader.md.state_dict_metadata
    shapes, used, problems = {}, set(), []
    for unit in units(cfg):
        for name, srcs, how in unit_plan(cfg, unit, spec):
            used.add(name)
            if name not in meta:
                problems.append(f"the config's model has {name}, the checkpoint does not")
                continue
            size = tuple(meta[name].size)
            if not _splittable(how, size, srcs, cfg):
                rows = f" (the config gives {' + '.join(map(str, row_sizes(cfg, srcs)))} rows)" if how == "cat_rows" else ""
                problems.append(f"{name} is {size}, which cannot hold the config's {len(srcs)} source tensor(s){rows}")
                continue
            shapes.update(hf_shapes(how, size, srcs, cfg))
    problems += shape_mismatches(cfg, shapes)
    extra = sorted(set(reader.names()) - used)
    if extra:
        problems.append(f"the checkpoint has {len(extra)} tensor(s) the config's model lacks, e.g. {extra[:2]}")
    return problems


def _hf_owned(entry: Path) -> bool:
    """The files mcore_to_hf writes into its output directory (what --overwrite may delete)."""
    return (entry.name.endswith((".safetensors", ".partial"))
            or entry.name in ("model.safetensors.index.json", "config.json"))


def convert(ckpt: Path, config: Path, out: Path, progress: bool = True, overwrite: bool = False) -> dict:
    """Write HF shards for ``ckpt`` into ``out``; resumes only its own partial output of the same
    checkpoint and config, refuses (unless ``overwrite``) a directory holding anything else."""
    # Lazy: safetensors and tqdm when a checkpoint is written.
    from safetensors.torch import save_file
    from tqdm import tqdm

    ckpt, out = Path(ckpt), Path(out)
    cfg = read_json(config, "the model config")
    check_model_config(cfg, config)
    try:
        reader = DistCheckpointReader(ckpt)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise ConversionError(f"{ckpt}/.metadata is not a readable torch_dist metadata file ({e})") from None
    except ValueError as e:
        raise ConversionError(str(e)) from None
    spec = detect_spec(reader)
    all_units = units(cfg)
    try:
        wrong = config_mismatches(reader, cfg, spec)
    except KeyError as e:
        raise ConversionError(f"{config}: lacks {e.args[0]!r}") from None
    if wrong:
        # The output's config.json would not describe its tensors: refused before anything is written.
        raise ConversionError(f"{config} does not describe the checkpoint {ckpt}: " + "; ".join(wrong[:3])
                              + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else ""))
    try:
        resuming = manifest.claim(out, "mcore_to_hf", ckpt, input_identity(ckpt, config),
                                  {"spec": spec}, overwrite, _hf_owned)
    except manifest.OutputDirError as e:
        raise ConversionError(str(e)) from None
    weight_map, skipped = {}, 0
    changed = (manifest.read(out) or {}).get("changed_on_resume", [])
    for i, unit in enumerate(tqdm(all_units, desc="mcore->hf", unit="layer", disable=not progress)):
        shard = f"model-{i + 1:05d}-of-{len(all_units):05d}.safetensors"
        try:
            plan = unit_plan(cfg, unit, spec)
        except KeyError as e:
            raise ConversionError(f"{config}: lacks {e.args[0]!r}") from None
        for _, srcs, _ in plan:
            weight_map.update({s: shard for s in srcs})
        if resuming and manifest.reusable(out, shard):
            skipped += 1
            continue
        manifest.forget(out, shard)
        tensors = {}
        for name, srcs, how in plan:
            try:
                tensors.update(split(how, reader.tensor(name), srcs, cfg))
            except KeyError as e:
                raise ConversionError(f"{ckpt}: {e.args[0]} (spec {spec}, {unit})") from e
        with atomic.atomic_path(out / shard) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
        manifest.record(out, shard)
    atomic.write_text(out / "model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    with atomic.atomic_path(out / "config.json") as tmp:
        shutil.copyfile(config, tmp)
    manifest.record(out, "model.safetensors.index.json", "config.json")
    manifest.complete(out)
    return {"shards": len(all_units), "resumed": skipped, "tensors": len(weight_map), "spec": spec,
            "changed_on_resume": changed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.tools.mcore_to_hf", description=__doc__)
    p.add_argument("--ckpt", type=PathArg("checkpoint directory"), required=True, help="torch_dist checkpoint directory")
    p.add_argument("--config", type=PathArg("model config.json"), required=True, help="the HF config.json of the model")
    p.add_argument("--out", type=PathArg("output directory"), required=True)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an output directory this tool wrote for another checkpoint or config")
    args = p.parse_args(argv)
    try:
        stats = convert(args.ckpt, args.config, args.out, not args.no_progress, args.overwrite)
    except (ConversionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror or e}" if e.filename else f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
