"""Whether a directory is a complete Megatron torch_dist checkpoint that the real-weight run can load.

``python -m verl_patches.tools.check_ckpt DIR``: exit 0 when complete, 1 with every problem named.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

from verl_patches.tools import manifest
from verl_patches.reporting.findings import finish
from verl_patches.base.schema import PathArg

# What megatron-core's dist_checkpointing.load reads besides the data files.
REQUIRED = (".metadata", "metadata.json", "common.pt")


def problems(ckpt: Path) -> tuple[list[str], str]:
    """(problems, summary): a complete checkpoint has no problems."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return [f"{ckpt} is not a directory"], ""
    done = manifest.is_complete(ckpt)
    if done is False:
        return [f"{ckpt}: the conversion into it did not finish (its {manifest.MANIFEST} says incomplete); run the "
                "same hf_to_mcore command again to resume it"], ""
    missing = [n for n in REQUIRED if not (ckpt / n).is_file()]
    if missing:
        return [f"{ckpt}: no {', '.join(missing)}: not a complete torch_dist checkpoint (conversion not run, or "
                "not finished)"], ""
    try:
        info = json.loads((ckpt / "metadata.json").read_text())
    except (OSError, ValueError) as e:
        return [f"{ckpt / 'metadata.json'}: not readable JSON ({e})"], ""
    if not isinstance(info, dict) or info.get("sharded_backend", "torch_dist") != "torch_dist":
        return [f"{ckpt / 'metadata.json'}: sharded_backend must be torch_dist"], ""
    try:
        with open(ckpt / ".metadata", "rb") as f:
            md = pickle.load(f)
        storage = md.storage_data
        tensors = len(md.state_dict_metadata)
    except Exception as e:  # noqa: BLE001 - any failure to read the index means an unusable checkpoint
        return [f"{ckpt / '.metadata'}: not a readable torch_dist metadata file ({type(e).__name__}: {e})"], ""
    if not tensors:
        return [f"{ckpt}: the checkpoint holds no tensors"], ""
    need: dict[str, int] = {}
    for si in storage.values():
        need[si.relative_path] = max(need.get(si.relative_path, 0), si.offset + si.length)
    out = []
    for name, size in sorted(need.items()):
        f = ckpt / name
        if not f.is_file():
            out.append(f"{ckpt}: data file {name} is missing")
        elif f.stat().st_size < size:
            out.append(f"{ckpt}: data file {name} is truncated ({f.stat().st_size} of at least {size} bytes)")
    total = sum((ckpt / n).stat().st_size for n in need if (ckpt / n).is_file())
    return out, f"{tensors} entries in {len(need)} data file(s), {total / 1e9:.2f} GB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.tools.check_ckpt", description=__doc__)
    p.add_argument("ckpt", type=PathArg("checkpoint directory"), help="checkpoint directory (DIST_CKPT_PATH)")
    args = p.parse_args(argv)
    found, summary = problems(args.ckpt)
    return finish(found, f"{args.ckpt}: complete torch_dist checkpoint ({summary})")


if __name__ == "__main__":
    sys.exit(main())
