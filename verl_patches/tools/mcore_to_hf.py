"""Convert a Megatron-core torch_dist DeepSeek-V3 checkpoint back to HF safetensors, one layer per shard (for checking).

``python -m verl_patches.tools.mcore_to_hf --ckpt DIR --config HF_CONFIG.json --out DIR``; reads any chunking, ours or Megatron's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from verl_patches.tools.mcore_layout import DistCheckpointReader
from verl_patches.tools.hf_to_mcore import ConversionError, unit_plan, units


def split(how: str, t: torch.Tensor, sources: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Inverse of hf_to_mcore.build: HF tensors (contiguous copies) from one Megatron tensor."""
    if how == "copy":
        return {sources[0]: t}
    if how == "cat":
        gate, up = t.chunk(2, dim=0)
        return {sources[0]: gate.clone(), sources[1]: up.clone()}
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
    return "te" if any(n.endswith("linear_kv_up_proj.layer_norm_weight") for n in names) else "local"


def convert(ckpt: Path, config: Path, out: Path, progress: bool = True) -> dict:
    from safetensors.torch import save_file
    from tqdm import tqdm

    ckpt, out = Path(ckpt), Path(out)
    cfg = json.loads(Path(config).read_text())
    reader = DistCheckpointReader(ckpt)
    spec = detect_spec(reader)
    all_units = units(cfg)
    out.mkdir(parents=True, exist_ok=True)
    weight_map, skipped = {}, 0
    for i, unit in enumerate(tqdm(all_units, desc="mcore->hf", unit="layer", disable=not progress)):
        shard = f"model-{i + 1:05d}-of-{len(all_units):05d}.safetensors"
        plan = unit_plan(cfg, unit, spec)
        for _, srcs, _ in plan:
            weight_map.update({s: shard for s in srcs})
        if (out / shard).is_file():
            skipped += 1
            continue
        tensors = {}
        for name, srcs, how in plan:
            try:
                tensors.update(split(how, reader.tensor(name), srcs))
            except KeyError as e:
                raise ConversionError(f"{ckpt}: {e.args[0]} (spec {spec}, {unit})") from e
        tmp = out / (shard + ".partial")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / shard)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    shutil.copy2(config, out / "config.json")
    return {"shards": len(all_units), "resumed": skipped, "tensors": len(weight_map), "spec": spec}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.tools.mcore_to_hf", description=__doc__)
    p.add_argument("--ckpt", type=Path, required=True, help="torch_dist checkpoint directory")
    p.add_argument("--config", type=Path, required=True, help="the HF config.json of the model")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        stats = convert(args.ckpt, args.config, args.out, not args.no_progress)
    except (ConversionError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
