"""Convert a BF16 DeepSeek-V3 HF checkpoint to a Megatron-core torch_dist checkpoint, one layer at a time.

The run configs' training layouts (actor_rollout_ref.actor.megatron and recipe.megatron.num_layer_list;
tests/tools/test_hf_mcore.py checks these lines against the composed configs):

  256 dies (configs/deepseekv3_256die_true_weight.yaml: TP4, PP8, EP32, whole experts per rank):
    python -m verl_patches.tools.hf_to_mcore --hf DIR --out DIR --tp 4 --pp 8 --ep 32 --num-layer-list 7,7,8,8,8,8,8,7
  128 GPUs (configs/deepseekv3_128gpu_true_weight.yaml: TP8, PP8, EP16):
    python -m verl_patches.tools.hf_to_mcore --hf DIR --out DIR --tp 8 --pp 8 --ep 16 --num-layer-list 7,7,8,8,8,8,8,7

Resumes and reuse are decided by content (verl_patches/tools/manifest.py): the input's every byte
is hashed (SHA-256, about 1.2 GB/s per core measured on the development machine) and compared with
the output directory's manifest, and each reused layer file must hash to what was recorded when it
was written. An HF config that does not describe its shards' shapes is refused.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

import torch

from verl_patches.base import atomic
from verl_patches.reshard.deepseek_v3_names import SPECS
from verl_patches.tools import manifest
from verl_patches.tools.mcore_layout import (DistCheckpointReader, LayoutError, SafetensorsReader, CheckpointLayout, UnitWriter,
                                             chunk_ranges, edge_plan, extra_state_keys, layer_plan, write_metadata)
from verl_patches.base.schema import IntList, Integer, PathArg

STATE_DIR = ".convert_state"


class ConversionError(RuntimeError):
    """The input cannot be converted as asked; the message names the file, tensor or setting."""


MODEL_KEYS = ("num_hidden_layers", "n_routed_experts", "first_k_dense_replace", "num_attention_heads")
# Upper bounds of the config values the tools compute with: far above DeepSeek-V3 (61 layers, 256
# experts, 128 heads, 7168 hidden), low enough that a mistyped value is an error, not hours of work.
CONFIG_BOUNDS = {"num_hidden_layers": 1024, "n_routed_experts": 1 << 14, "first_k_dense_replace": 1024,
                 "num_attention_heads": 1 << 12, "hidden_size": 1 << 17, "vocab_size": 1 << 24,
                 "q_lora_rank": 1 << 14, "kv_lora_rank": 1 << 14, "qk_nope_head_dim": 1 << 12,
                 "qk_rope_head_dim": 1 << 12, "v_head_dim": 1 << 12, "intermediate_size": 1 << 18,
                 "moe_intermediate_size": 1 << 18, "n_shared_experts": 1 << 10, "num_nextn_predict_layers": 1024}


def check_model_config(cfg: dict, path: Path) -> None:
    """The values the tools compute with: MODEL_KEYS present, every value in CONFIG_BOUNDS that is
    given (and not null) a whole number in [0, bound]; ConversionError naming the file and keys."""
    bad = [k for k in MODEL_KEYS if k not in cfg]
    bad += [f"{k}={cfg[k]!r}" for k, hi in CONFIG_BOUNDS.items() if cfg.get(k) is not None and (
        not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or not 0 <= cfg[k] <= hi)]
    if bad:
        named = {b.split("=")[0] for b in bad}
        bounds = ", ".join(f"{k} <= {hi}" for k, hi in CONFIG_BOUNDS.items() if k in named)
        raise ConversionError(f"{path}: {bad} missing or not whole numbers in range ({bounds or 'required'}; "
                              "a DeepSeek-V3 config.json is expected)")


def read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: {what} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: {what} must be a JSON object, got {type(data).__name__}")
    return data


def load_hf_index(hf: Path) -> tuple[dict, dict[str, str]]:
    hf = Path(hf)
    if not hf.is_dir():
        raise ConversionError(f"{hf}: not a directory (the HF checkpoint: config.json and safetensors shards)")
    if not (hf / "config.json").is_file():
        raise ConversionError(f"{hf}: no config.json")
    cfg = read_json(hf / "config.json", "config.json")
    if cfg.get("quantization_config"):
        raise ConversionError(f"{hf}: config has quantization_config (FP8): run python -m verl_patches.tools.fp8_to_bf16 first")
    check_model_config(cfg, hf / "config.json")
    idx = hf / "model.safetensors.index.json"
    if idx.is_file():
        weight_map = read_json(idx, "the safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{idx}: no weight_map object")
        absent = sorted({f for f in weight_map.values() if not (hf / str(f)).is_file()})
        if absent:
            raise ConversionError(f"{idx} names shard(s) that are not in {hf}: {absent[:3]}")
    else:
        files = sorted(hf.glob("*.safetensors"))
        if len(files) != 1:
            raise ConversionError(f"{hf}: no model.safetensors.index.json and {len(files)} safetensors files")
        try:
            with SafetensorsReader(files[0]) as f:
                weight_map = {k: files[0].name for k in f.keys()}
        except (ValueError, UnicodeDecodeError) as e:
            raise ConversionError(f"{files[0]}: not a safetensors file ({e})") from None
    return cfg, weight_map


def hf_identity(hf: Path, weight_map: dict[str, str]) -> dict:
    """The input's identity by content: its config, index and every shard the index names, all bytes hashed."""
    hf = Path(hf)
    names = ["config.json", *[n for n in ("model.safetensors.index.json",) if (hf / n).is_file()],
             *sorted(set(weight_map.values()))]
    return manifest.identify({n: hf / n for n in names})


def _dims(cfg: dict) -> dict[str, int]:
    return {k: cfg.get(k) or 0 for k in ("hidden_size", "vocab_size", "num_attention_heads", "q_lora_rank",
                                          "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                          "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                                          "n_shared_experts")}


def hf_shape(cfg: dict, name: str) -> tuple[int, ...] | None:
    """The shape ``cfg`` gives the HF tensor ``name`` (None for a name it does not decide)."""
    d = _dims(cfg)
    h, heads = d["hidden_size"], d["num_attention_heads"]
    qk = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    edges = {"model.embed_tokens.weight": (d["vocab_size"], h), "lm_head.weight": (d["vocab_size"], h),
             "model.norm.weight": (h,)}
    if name in edges:
        return edges[name]
    parts = name.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"]:
        return None
    suffix = ".".join(parts[3:])
    i, mi = d["intermediate_size"], d["moe_intermediate_size"]
    si = mi * d["n_shared_experts"]
    table = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (heads * qk, h),
        "self_attn.q_a_proj.weight": (d["q_lora_rank"], h), "self_attn.q_a_layernorm.weight": (d["q_lora_rank"],),
        "self_attn.q_b_proj.weight": (heads * qk, d["q_lora_rank"]),
        "self_attn.kv_a_proj_with_mqa.weight": (d["kv_lora_rank"] + d["qk_rope_head_dim"], h),
        "self_attn.kv_a_layernorm.weight": (d["kv_lora_rank"],),
        "self_attn.kv_b_proj.weight": (heads * (d["qk_nope_head_dim"] + d["v_head_dim"]), d["kv_lora_rank"]),
        "self_attn.o_proj.weight": (h, heads * d["v_head_dim"]),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
        "mlp.gate.weight": (d["n_routed_experts"], h), "mlp.gate.e_score_correction_bias": (d["n_routed_experts"],),
        "mlp.shared_experts.gate_proj.weight": (si, h), "mlp.shared_experts.up_proj.weight": (si, h),
        "mlp.shared_experts.down_proj.weight": (h, si),
    }
    if suffix in table:
        return table[suffix]
    if suffix.startswith("mlp.experts.") and suffix.endswith(("gate_proj.weight", "up_proj.weight")):
        return (mi, h)
    if suffix.startswith("mlp.experts.") and suffix.endswith("down_proj.weight"):
        return (h, mi)
    return None


def shape_mismatches(cfg: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """One line per tensor whose shape is not the one ``cfg`` gives it."""
    out = []
    for name, shape in shapes.items():
        want = hf_shape(cfg, name)
        if want is not None and tuple(shape) != want:
            out.append(f"{name} is {tuple(shape)}, the config gives {want}")
    return out


def hf_header_shapes(hf: Path, weight_map: dict[str, str], names) -> dict[str, tuple[int, ...]]:
    """Shapes of ``names`` from the safetensors headers (no tensor data read)."""
    by_shard: dict[str, list[str]] = {}
    for n in names:
        by_shard.setdefault(weight_map[n], []).append(n)
    out = {}
    for shard, ns in sorted(by_shard.items()):
        try:
            with SafetensorsReader(Path(hf) / shard) as f:
                for n in ns:
                    info = f.header.get(n)
                    if not isinstance(info, dict) or not isinstance(info.get("shape"), list):
                        raise ConversionError(f"{Path(hf) / shard}: the index maps {n} to it but its header lacks it")
                    out[n] = tuple(info["shape"])
        except (ValueError, UnicodeDecodeError) as e:
            raise ConversionError(f"{Path(hf) / shard}: not a safetensors file ({e})") from None
    return out


def _mcore_owned(entry: Path) -> bool:
    """The files hf_to_mcore writes into its output directory (what --overwrite may delete)."""
    return (entry.name.endswith((".distcp", ".distcp.partial", ".partial"))
            or entry.name in (STATE_DIR, ".metadata", "common.pt", "metadata.json", "recipe_layout.json"))


def units(cfg: dict) -> list[str]:
    return ["embedding", *(f"layer_{i:03d}" for i in range(cfg["num_hidden_layers"])), "head"]


def unit_plan(cfg: dict, unit: str, spec: str):
    if unit.startswith("layer_"):
        return layer_plan(cfg, int(unit.split("_")[1]), spec)
    return edge_plan(cfg, unit)


class HFSource:
    """Opens only the shards one unit needs and closes them after it."""

    def __init__(self, hf: Path, weight_map: dict[str, str]):
        self.hf, self.weight_map = Path(hf), weight_map

    def open(self, names, stack: ExitStack):
        handles = {}
        for shard in sorted({self.weight_map[n] for n in names}):
            handles[shard] = stack.enter_context(SafetensorsReader(self.hf / shard))
        return lambda n: handles[self.weight_map[n]].get_tensor(n)


def build(how: str, sources: tuple[str, ...], get) -> torch.Tensor:
    """One Megatron tensor from its HF sources; experts are filled in place so only one expert is extra."""
    if how == "copy":
        return get(sources[0])
    if how in ("cat", "cat_rows"):
        return torch.cat([get(sources[0]), get(sources[1])], dim=0)
    if how == "experts_fc1":
        first = get(sources[0])
        n = len(sources) // 2
        out = torch.empty((n, 2 * first.shape[0], first.shape[1]), dtype=first.dtype)
        for x in range(n):
            out[x, : first.shape[0]] = first if x == 0 else get(sources[2 * x])
            out[x, first.shape[0]:] = get(sources[2 * x + 1])
        return out
    if how == "experts_fc2":
        first = get(sources[0])
        out = torch.empty((len(sources), *first.shape), dtype=first.dtype)
        out[0] = first
        for x in range(1, len(sources)):
            out[x] = get(sources[x])
        return out
    raise ValueError(how)


def convert(hf: Path, out: Path, layout: CheckpointLayout, spec: str = "te", extra_state: bool = True,
            progress: bool = True, verify: bool = True, overwrite: bool = False) -> dict:
    """Convert ``hf`` into ``out``; resumes a partial output of the same input and options, refuses
    (unless ``overwrite``) a directory holding anything else."""
    # Lazy: tqdm (optional) for the progress bar only.
    from tqdm import tqdm

    hf, out = Path(hf), Path(out)
    cfg, weight_map = load_hf_index(hf)
    try:
        layout.validate(cfg)
    except LayoutError as e:
        raise ConversionError(str(e)) from e
    all_units = units(cfg)
    try:
        needed = [s for u in all_units for _, srcs, _ in unit_plan(cfg, u, spec) for s in srcs]
    except KeyError as e:
        raise ConversionError(f"{hf / 'config.json'}: lacks {e.args[0]!r}") from None
    missing = [n for n in needed if n not in weight_map]
    if missing:
        raise ConversionError(f"{hf}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    if out.resolve() == hf.resolve():
        raise ConversionError("--out must differ from --hf")
    wrong = shape_mismatches(cfg, hf_header_shapes(hf, weight_map, needed))
    if wrong:
        raise ConversionError(f"{hf / 'config.json'} does not describe the tensors of {hf}: "
                              + "; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else ""))
    options = {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep,
               "num_layer_list": list(layout.num_layer_list) if layout.num_layer_list else None,
               "moe_tp_extend_ep": layout.moe_tp_extend_ep, "spec": spec, "extra_state": extra_state}
    try:
        resuming = manifest.claim(out, "hf_to_mcore", hf, hf_identity(hf, weight_map), options, overwrite,
                                  _mcore_owned)
    except manifest.OutputDirError as e:
        raise ConversionError(str(e)) from None
    src = HFSource(hf, weight_map)
    state = out / STATE_DIR
    state.mkdir(exist_ok=True)
    stats = {"units": len(all_units), "resumed": 0, "tensors": 0, "bytes": 0, "verified": 0}
    stats["changed_on_resume"] = (manifest.read(out) or {}).get("changed_on_resume", [])
    done = []
    finals = (".metadata", "common.pt", "metadata.json", "recipe_layout.json")
    if resuming and manifest.is_complete(out):
        # claim() re-hashed every file this output recorded: all are as written.
        stats["resumed"] = len(all_units)
    else:
        for unit in tqdm(all_units, desc="hf->mcore", unit="layer", disable=not progress):
            meta_file = state / f"{unit}.meta"
            files = (f"{unit}.distcp", f"{STATE_DIR}/{unit}.meta")
            recorded = manifest.read(out)
            if resuming and all(manifest.reusable(out, f, recorded) for f in files):
                with open(meta_file, "rb") as f:
                    done.append(pickle.load(f))
                stats["resumed"] += 1
                continue
            manifest.forget(out, *files)
            writer = UnitWriter(out / f"{unit}.distcp")
            with ExitStack() as stack:
                plan = unit_plan(cfg, unit, spec)
                get = src.open([s for _, srcs, _ in plan for s in srcs], stack)
                for name, srcs, how in plan:
                    t = build(how, srcs, get)
                    writer.tensor(name, t, chunk_ranges(name, tuple(t.shape), layout, cfg))
                    stats["tensors"] += 1
                    stats["bytes"] += t.numel() * t.element_size()
                    del t
            if extra_state and unit.startswith("layer_"):
                for key in extra_state_keys(cfg, int(unit.split("_")[1]), spec):
                    writer.obj(key, [None])
            if extra_state and unit == "head" and "output_layer.weight" in [n for n, _, _ in unit_plan(cfg, unit, spec)]:
                writer.obj("output_layer._extra_state/shard_0_1", [None])
            meta = writer.close()
            with open(meta_file.with_suffix(".partial"), "wb") as f:
                pickle.dump(meta, f)
            meta_file.with_suffix(".partial").replace(meta_file)
            manifest.record(out, *files)
            done.append(meta)
        recorded = manifest.read(out)
        if not (resuming and stats["resumed"] == len(all_units)
                and all(manifest.reusable(out, f, recorded) for f in finals)):
            manifest.forget(out, *finals)
            write_metadata(out, done)
            atomic.write_text(out / "recipe_layout.json", json.dumps({
                "source": str(hf), "spec": spec, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep,
                "num_layer_list": list(layout.num_layer_list or layout.even_layers(cfg["num_hidden_layers"])),
                "moe_tp_extend_ep": layout.moe_tp_extend_ep, "expert_ranks": layout.expert_ranks,
                "note": "storage chunks follow this layout; megatron's torch_dist loader reshards to any layout"},
                indent=2))
            manifest.record(out, *finals)
    if verify:
        stats["verified"] = verify_checkpoint(hf, out, spec, progress)
    shutil.rmtree(state, ignore_errors=True)
    manifest.forget(out, *[r for r in (manifest.read(out) or {}).get("outputs", {}) if r.startswith(STATE_DIR + "/")])
    manifest.complete(out)
    return stats


def verify_checkpoint(hf: Path, out: Path, spec: str, progress: bool = True) -> int:
    """Re-read every tensor from the written checkpoint and compare it bit for bit with the HF source, layer by layer."""
    # Lazy: tqdm (optional) for the progress bar only.
    from tqdm import tqdm

    cfg, weight_map = load_hf_index(hf)
    reader = DistCheckpointReader(out)
    src = HFSource(hf, weight_map)
    n = 0
    for unit in tqdm(units(cfg), desc="verify", unit="layer", disable=not progress):
        with ExitStack() as stack:
            plan = unit_plan(cfg, unit, spec)
            get = src.open([s for _, srcs, _ in plan for s in srcs], stack)
            for name, srcs, how in plan:
                want = build(how, srcs, get)
                got = reader.tensor(name)
                if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                    raise ConversionError(f"verification failed for {name} ({unit}): written tensor differs from the HF source")
                n += 1
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verl_patches.tools.hf_to_mcore", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", type=PathArg("input directory"), required=True, help="BF16 HF checkpoint directory")
    p.add_argument("--out", type=PathArg("output directory"), required=True, help="output torch_dist checkpoint directory (DIST_CKPT_PATH)")
    # Defaults: the 256-die run's layout.
    p.add_argument("--tp", type=Integer(low=1, high=1 << 16), default=4, help="tensor parallel size (default 4)")
    p.add_argument("--pp", type=Integer(low=1, high=1 << 16), default=8, help="pipeline parallel size (default 8)")
    p.add_argument("--ep", type=Integer(low=1, high=1 << 16), default=32, help="expert parallel size (default 32)")
    p.add_argument("--num-layer-list", type=IntList(low=1, high=1 << 16), default=None,
                   help="layers per PP stage, e.g. 7,7,8,8,8,8,8,7 (default: an even split)")
    p.add_argument("--moe-tp-extend-ep", action="store_true",
                   help="experts over the TP x EP group (MindSpeed's option; the run configs leave it off and "
                        "give the expert group as --ep)")
    p.add_argument("--spec", choices=SPECS, default="te",
                   help="Megatron layer spec the names follow: te (Transformer-Engine spec, what verl builds), local "
                        "(megatron-core's local spec) or mindspeed_llm (MindSpeed-LLM's DeepSeek spec, what the NPU "
                        "path builds: q and kv down projections fused into one linear_qkv)"),
    p.add_argument("--no-extra-state", action="store_true", help="do not write the linears' empty _extra_state objects")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an output directory this tool wrote for another input or other options")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("tp", "pp", "ep"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.num_layer_list is not None and any(n < 1 for n in args.num_layer_list):
        p.error(f"--num-layer-list entries must be >= 1, got {list(args.num_layer_list)}")
    layout = CheckpointLayout(args.tp, args.pp, args.ep, args.num_layer_list, args.moe_tp_extend_ep)
    try:
        stats = convert(args.hf, args.out, layout, args.spec, not args.no_extra_state, not args.no_progress,
                        not args.no_verify, args.overwrite)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
