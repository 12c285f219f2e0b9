"""DeepSeek-V3 names between HF and Megatron-core 0.12 distributed checkpoints, and the torch_dist file format.

Shared by hf_to_mcore and mcore_to_hf; the mapping is checked against megatron-core's own sharded_state_dict in tests.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_patches.reshard import deepseek_v3_names as names
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
    TensorProperties, TensorStorageMetadata)

# Megatron's dist-checkpoint directory markers (what dist_checkpointing.save writes).
MCORE_METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}
# The layer norms' checkpoint keys: fused into the following linear in the Transformer-Engine spec (what
# verl builds); separate modules in the local spec; in MindSpeed-LLM's DeepSeek spec (what the NPU path
# builds) the q / kv norms are modules and the input and pre-MLP norms are saved under TE's fused names.
NORM_NAMES = {spec: {"q_a_layernorm": names.ATTN["q_a_layernorm"].key_for(spec),
                     "kv_a_layernorm": names.ATTN["kv_a_layernorm"].key_for(spec),
                     "dense_post_attention_layernorm": names.DENSE["post_attention_layernorm"].key_for(spec),
                     **({"input_layernorm": names.ATTN["input_layernorm"].key_for(spec),
                         "moe_post_attention_layernorm": names.MOE["post_attention_layernorm"].key_for(spec)}
                        if spec == "mindspeed_llm" else {})}
              for spec in names.SPECS}
# Tensor-parallel split axis per Megatron linear (column-parallel 0, row-parallel 1); None is replicated.
TP_AXIS = {
    "self_attention.linear_proj.weight": 1,
    "self_attention.linear_q_proj.weight": 0,
    "self_attention.linear_q_up_proj.weight": 0,
    "self_attention.linear_kv_up_proj.weight": 0,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
    "mlp.shared_experts.linear_fc1.weight": 0,
    "mlp.shared_experts.linear_fc2.weight": 1,
    # MindSpeed-LLM's fused q / kv down projection (self_attention.linear_qkv.weight) is a plain Linear,
    # replicated over TP: absent here, stored whole.
}
# Linear modules that carry a (Transformer-Engine) _extra_state object in the checkpoint.
EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_q_proj", "self_attention.linear_q_down_proj",
                       "self_attention.linear_q_up_proj", "self_attention.linear_kv_down_proj",
                       "self_attention.linear_kv_up_proj", "mlp.linear_fc1", "mlp.linear_fc2",
                       "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")


class LayoutError(ValueError):
    """The model or the requested training layout is inconsistent; the message says which number."""


@dataclass(frozen=True)
class CheckpointLayout:
    """The training layout the checkpoint's storage chunks follow (loading works with any layout)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    num_layer_list: tuple[int, ...] | None = None
    moe_tp_extend_ep: bool = False

    def validate(self, cfg: dict) -> None:
        layers, experts = cfg["num_hidden_layers"], cfg["n_routed_experts"]
        lst = self.num_layer_list or self.even_layers(layers)
        if len(lst) != self.pp:
            raise LayoutError(f"num_layer_list has {len(lst)} stages, PP is {self.pp}")
        if sum(lst) != layers:
            raise LayoutError(f"num_layer_list {list(lst)} sums to {sum(lst)}, the model has {layers} layers")
        if experts % self.expert_ranks:
            raise LayoutError(f"{experts} experts do not divide over {self.expert_ranks} expert ranks")
        heads = cfg["num_attention_heads"]
        if heads % self.tp:
            raise LayoutError(f"{heads} attention heads do not divide over TP{self.tp}")

    def even_layers(self, layers: int) -> tuple[int, ...]:
        if layers % self.pp:
            raise LayoutError(f"{layers} layers do not split evenly over PP{self.pp}: give num_layer_list")
        return (layers // self.pp,) * self.pp

    @property
    def expert_ranks(self) -> int:
        # moe_tp_extend_ep: experts split over the TP x EP group, no expert tensor parallelism.
        return self.tp * self.ep if self.moe_tp_extend_ep else self.ep

    def stage_of(self, layer: int, n_layers: int) -> int:
        lst = self.num_layer_list or self.even_layers(n_layers)
        acc = 0
        for stage, n in enumerate(lst):
            acc += n
            if layer < acc:
                return stage
        raise LayoutError(f"layer {layer} beyond {acc} layers")


def is_dense(cfg: dict, layer: int) -> bool:
    return layer < cfg["first_k_dense_replace"]


def layer_plan(cfg: dict, layer: int, spec: str = "te") -> list[tuple[str, tuple[str, ...], str]]:
    """(mcore checkpoint key, HF source names, how) for one decoder layer; how: copy | cat (GLU gate;up,
    two equal halves) | cat_rows (MindSpeed-LLM's fused q / kv down projection: the sources' rows in order,
    sizes from the config, see row_sizes) | experts_fc1 | experts_fc2."""
    h, m = names.HF_LAYER.format(layer), names.MCORE_LAYER.format(layer)
    A, D, M = names.ATTN, names.DENSE, names.MOE

    def copy(n: names.Name) -> tuple[str, tuple[str, ...], str]:
        return m + n.key_for(spec), (h + n.hf,), "copy"

    q = ("q_a_proj", "q_b_proj", "q_a_layernorm") if cfg.get("q_lora_rank") else ("q_proj",)
    if spec == "mindspeed_llm":
        plan = [copy(A[k]) for k in ("input_layernorm", "o_proj", "kv_b_proj", "kv_a_layernorm")]
        down = A[q[0]]  # q_a_proj, or q_proj without a query LoRA rank
        plan.append((m + names.MINDSPEED_LLM_QKV, (h + down.hf, h + A["kv_a_proj"].hf), "cat_rows"))
        plan += [copy(A[k]) for k in q[1:]]
    else:
        plan = [copy(A[k]) for k in ("input_layernorm", "o_proj", "kv_a_proj", "kv_b_proj", "kv_a_layernorm")]
        plan += [copy(A[k]) for k in q]
    if is_dense(cfg, layer):
        plan += [
            copy(D["post_attention_layernorm"]),
            (m + D["gate_proj"].mcore, (h + D["gate_proj"].hf, h + D["up_proj"].hf), "cat"),
            copy(D["down_proj"]),
        ]
    else:
        e = cfg["n_routed_experts"]
        plan += [copy(M[k]) for k in ("post_attention_layernorm", "router", "expert_bias")]
        plan += [
            (m + "mlp.experts.experts.linear_fc1.weight",
             tuple(f"{h}mlp.experts.{x}.{p}_proj.weight" for x in range(e) for p in ("gate", "up")), "experts_fc1"),
            (m + "mlp.experts.experts.linear_fc2.weight",
             tuple(f"{h}mlp.experts.{x}.down_proj.weight" for x in range(e)), "experts_fc2"),
        ]
        if cfg.get("n_shared_experts"):
            plan += [
                (m + M["shared_gate_proj"].mcore, (h + M["shared_gate_proj"].hf, h + M["shared_up_proj"].hf), "cat"),
                copy(M["shared_down_proj"]),
            ]
    return plan


def edge_plan(cfg: dict, which: str) -> list[tuple[str, tuple[str, ...], str]]:
    E = names.EDGES
    if which == "embedding":
        return [(E["embedding"].mcore, (E["embedding"].hf,), "copy")]
    plan = [(E["final_norm"].mcore, (E["final_norm"].hf,), "copy")]
    if not cfg.get("tie_word_embeddings", False):
        plan.append((E["output"].mcore, (E["output"].hf,), "copy"))
    return plan


def row_sizes(cfg: dict, sources: tuple[str, ...]) -> list[int]:
    """The row counts of a cat_rows tensor's HF sources (q_a_proj or q_proj, then kv_a_proj_with_mqa), from the config."""
    heads, qk = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    rows = {names.ATTN["q_a_proj"].hf: cfg.get("q_lora_rank") or 0, names.ATTN["q_proj"].hf: heads * qk,
            names.ATTN["kv_a_proj"].hf: cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]}
    return [rows[s.split(".", 3)[-1]] for s in sources]


def extra_state_keys(cfg: dict, layer: int, spec: str = "te") -> list[str]:
    """ShardedObject names of the layer's linear modules' _extra_state (shard_<offset>_<shape>).
    MindSpeed-LLM's fused down projection is a plain torch Linear: it has none."""
    m = f"decoder.layers.{layer}."
    out = []
    mods = [x for x in EXTRA_STATE_MODULES if not x.startswith("mlp.")]
    mods.remove("self_attention.linear_q_proj" if cfg.get("q_lora_rank") else "self_attention.linear_q_down_proj")
    if not cfg.get("q_lora_rank"):
        mods.remove("self_attention.linear_q_up_proj")
    if spec == "mindspeed_llm":
        mods = [x for x in mods if x not in ("self_attention.linear_q_proj", "self_attention.linear_q_down_proj",
                                             "self_attention.linear_kv_down_proj")]
    if is_dense(cfg, layer):
        mods += ["mlp.linear_fc1", "mlp.linear_fc2"]
    else:
        if cfg.get("n_shared_experts"):
            mods += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
        e = cfg["n_routed_experts"]
        out += [f"{m}mlp.experts.experts.linear_fc{i}._extra_state/shard_{x}_{e}" for x in range(e) for i in (1, 2)]
    return [f"{m}{x}._extra_state/shard_0_1" for x in mods] + out


def chunk_ranges(name: str, shape: tuple[int, ...], layout: CheckpointLayout, cfg: dict) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the storage chunks: one per training owner, so each rank reads one contiguous piece."""
    if ".experts.experts." in name:
        per = shape[0] // layout.expert_ranks
        return [((r * per,) + (0,) * (len(shape) - 1), (per,) + tuple(shape[1:])) for r in range(layout.expert_ranks)]
    suffix = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    axis = TP_AXIS.get(suffix)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        axis = 0
    if axis is None or layout.tp == 1 or shape[axis] % layout.tp:
        return [((0,) * len(shape), tuple(shape))]
    glu = suffix.endswith("linear_fc1.weight")
    # GLU fc1 is stored as [gate; up]: each TP rank owns a slice of both halves.
    parts = 2 * layout.tp if glu else layout.tp
    step = shape[axis] // parts
    out = []
    for p in range(parts):
        off = [0] * len(shape)
        size = list(shape)
        off[axis], size[axis] = p * step, step
        out.append((tuple(off), tuple(size)))
    return out


# ---------- torch_dist (PyTorch DCP) file format ----------

def dcp_classes():
    return dict(StorageInfo=_StorageInfo, Bytes=BytesStorageMetadata, Chunk=ChunkStorageMetadata, Metadata=Metadata,
                Index=MetadataIndex, Props=TensorProperties, TensorMeta=TensorStorageMetadata)


class UnitWriter:
    """Writes one unit's tensors (a layer, the embedding, the head) to one data file, DCP layout, and keeps its metadata."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.f = open(self.tmp, "wb")
        self.state_meta: dict = {}
        self.storage: dict = {}
        self.C = dcp_classes()

    def _blob(self, obj) -> tuple[int, int]:
        # Straight into the file, as DCP's own writer does: no second in-memory copy.
        start = self.f.tell()
        torch.save(obj, self.f)
        return start, self.f.tell() - start

    def tensor(self, name: str, t: torch.Tensor, chunks) -> None:
        C = self.C
        metas = []
        for off, size in chunks:
            piece = t[tuple(slice(o, o + s) for o, s in zip(off, size))]
            if tuple(size) != tuple(t.shape) or not t.is_contiguous():
                # torch.save of a view would store the whole underlying tensor.
                piece = piece.clone()
            start, length = self._blob(piece)
            self.storage[C["Index"](name, torch.Size(off))] = C["StorageInfo"](self.path.name, start, length)
            metas.append(C["Chunk"](offsets=torch.Size(off), sizes=torch.Size(size)))
        self.state_meta[name] = C["TensorMeta"](properties=C["Props"](dtype=t.dtype), size=torch.Size(t.shape),
                                                chunks=metas)

    def obj(self, name: str, value) -> None:
        start, length = self._blob(value)
        self.storage[self.C["Index"](name)] = self.C["StorageInfo"](self.path.name, start, length)
        self.state_meta[name] = self.C["Bytes"]()

    def close(self) -> dict:
        self.f.flush()
        self.f.close()
        self.tmp.replace(self.path)
        return {"state": self.state_meta, "storage": self.storage}


def write_metadata(ckpt: Path, units: list[dict]) -> None:
    C = dcp_classes()
    state, storage = {}, {}
    for u in units:
        state.update(u["state"])
        storage.update(u["storage"])
    md = C["Metadata"](state_dict_metadata=state, planner_data=None, storage_data=storage)
    with open(ckpt / ".metadata.partial", "wb") as f:
        pickle.dump(md, f)
    torch.save({}, ckpt / "common.pt")
    (ckpt / "metadata.json").write_text(json.dumps(MCORE_METADATA_JSON))
    # Written last and by rename: a checkpoint with .metadata is complete.
    (ckpt / ".metadata.partial").replace(ckpt / ".metadata")


class DistCheckpointReader:
    """Global tensors out of any torch_dist checkpoint (ours or one Megatron saved), assembled from its chunks."""

    def __init__(self, ckpt: Path):
        self.ckpt = Path(ckpt)
        meta = self.ckpt / ".metadata"
        if not meta.is_file():
            raise FileNotFoundError(f"{self.ckpt} is not a complete torch_dist checkpoint (no .metadata)")
        try:
            info = json.loads((self.ckpt / "metadata.json").read_text()) if (self.ckpt / "metadata.json").is_file() else {}
        except ValueError as e:
            raise ValueError(f"{self.ckpt / 'metadata.json'}: not readable JSON ({e})") from None
        if not isinstance(info, dict):
            raise ValueError(f"{self.ckpt / 'metadata.json'}: expected a JSON object")
        if info.get("sharded_backend", "torch_dist") != "torch_dist":
            raise ValueError(f"{self.ckpt}: sharded_backend {info.get('sharded_backend')!r}, only torch_dist is supported")
        try:
            with open(meta, "rb") as f:
                self.md = pickle.load(f)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - unpickling damaged bytes fails in many ways
            raise ValueError(f"{meta} is not a readable torch_dist metadata file ({type(e).__name__}: {e})") from None
        if not (isinstance(getattr(self.md, "state_dict_metadata", None), dict)
                and isinstance(getattr(self.md, "storage_data", None), dict)):
            raise ValueError(f"{meta} is not a readable torch_dist metadata file (no state_dict_metadata / storage_data)")

    def names(self) -> list[str]:
        C = dcp_classes()
        return [k for k, v in self.md.state_dict_metadata.items() if isinstance(v, C["TensorMeta"])]

    def _read(self, index):
        si = self.md.storage_data[index]
        path = self.ckpt / si.relative_path
        try:
            with open(path, "rb") as f:
                f.seek(si.offset)
                blob = f.read(si.length)
            if len(blob) != si.length:
                raise EOFError(f"{len(blob)} of {si.length} bytes")
            return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
        except (EOFError, RuntimeError, pickle.UnpicklingError) as e:
            raise ValueError(f"{path}: {index.fqn} cannot be read (truncated or damaged data file: {e})") from None

    def tensor(self, name: str) -> torch.Tensor:
        C = dcp_classes()
        meta = self.md.state_dict_metadata.get(name)
        if meta is None:
            raise KeyError(f"tensor {name!r} is not in {self.ckpt}")
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        covered = 0
        for ch in meta.chunks:
            piece = self._read(C["Index"](name, ch.offsets))
            out[tuple(slice(o, o + s) for o, s in zip(ch.offsets, ch.sizes))] = piece.reshape(tuple(ch.sizes))
            covered += piece.numel()
        if covered != out.numel():
            raise ValueError(f"{name}: chunks cover {covered} of {out.numel()} elements")
        return out


# ---------- safetensors without mmap ----------

_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _check_entry(path: Path, name: str, info: Any, data_bytes: int) -> None:
    """A header entry that names a known dtype, a shape of whole numbers and data inside the file
    of exactly the shape's size (ValueError naming the file and tensor otherwise)."""
    ok = (isinstance(info, dict) and info.get("dtype") in _ST_DTYPES and isinstance(info.get("shape"), list)
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in info["shape"])
          and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
          and all(isinstance(o, int) and not isinstance(o, bool) for o in info["data_offsets"]))
    if not ok:
        raise ValueError(f"{path}: header entry {name!r} is not a tensor description (dtype, shape, data_offsets)")
    start, end = info["data_offsets"]
    itemsize = torch.empty((), dtype=_ST_DTYPES[info["dtype"]]).element_size()
    if not 0 <= start <= end <= data_bytes or end - start != math.prod(info["shape"]) * itemsize:
        raise ValueError(f"{path}: {name} claims bytes {start}..{end} for shape {info['shape']} {info['dtype']}, "
                         f"which the file ({data_bytes} data bytes) does not hold")


class SafetensorsReader:
    """Reads single tensors from a .safetensors file with plain reads.

    safetensors' own reader maps the file; mapped pages count as the process's memory while the
    mapping lives and made the converter's peak depend on the page cache. Plain reads keep it to
    exactly the tensors held.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.f = open(self.path, "rb")
        try:
            size = os.fstat(self.f.fileno()).st_size
            n = int.from_bytes(self.f.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError(f"{self.path}: header length {n} exceeds the file ({size} bytes)")
            self.header = json.loads(self.f.read(n))
            if not isinstance(self.header, dict):
                raise ValueError(f"{self.path}: the header is not a JSON object")
            self.header.pop("__metadata__", None)
            self.base = 8 + n
            for name, info in self.header.items():
                _check_entry(self.path, name, info, size - self.base)
        except BaseException:
            self.f.close()
            raise

    def keys(self):
        return list(self.header)

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self.header[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        self.f.seek(self.base + start)
        buf = bytearray(end - start)
        if self.f.readinto(buf) != len(buf):
            raise ValueError(f"{self.path}: {name} is truncated")
        if not buf:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
