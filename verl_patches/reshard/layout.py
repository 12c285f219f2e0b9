"""DeepSeek-V3 logical tensors and where every part of each lives in the Megatron training
layout and in the vLLM rollout layout (metadata only: no tensors, no process groups).

A *logical tensor* is one HF-oriented tensor (expert weights stacked over experts). Each side
places it as *parts*: a box of the logical tensor, the ranks holding it (training replicas, or
rollout ranks needing it) and a *slot*: the storage parameter and the view of it that holds
the box (this is where fused gate/up, transposed grouped-GEMM weights and vocab padding live).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from verl_patches.reshard.box import Box, box_numel, full_box


class LayoutError(ValueError):
    """A layout that cannot be built or routed; the message names the parameter and sizes."""


# --------------------------------------------------------------------------------------
# Model and layouts
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a HF DeepSeek-V3 config.json that decide tensor shapes."""

    hidden_size: int
    num_layers: int
    first_k_dense: int
    moe_layer_freq: int
    n_routed_experts: int
    n_shared_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    expert_bias: bool  # topk_method == noaux_tc: the router has e_score_correction_bias

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        need = ["hidden_size", "num_hidden_layers", "first_k_dense_replace", "n_routed_experts",
                "moe_intermediate_size", "intermediate_size", "num_attention_heads", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size"]
        missing = [k for k in need if k not in cfg]
        if missing:
            raise LayoutError(f"model config lacks {missing} (a HF DeepSeek-V3 config.json is expected)")
        if cfg.get("quantization_config"):
            raise LayoutError("model config has quantization_config: the reshard moves bf16/fp32 "
                              "weights; convert the FP8 checkpoint and drop quantization_config")
        if int(cfg.get("num_nextn_predict_layers", 0) or 0) != 0:
            raise LayoutError("model config has num_nextn_predict_layers != 0: MTP layers are "
                              "not part of the rollout model; set it to 0")
        if cfg.get("tie_word_embeddings", False):
            raise LayoutError("tie_word_embeddings=True is not supported (DeepSeek-V3 unties them)")
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            first_k_dense=int(cfg["first_k_dense_replace"]),
            moe_layer_freq=int(cfg.get("moe_layer_freq", 1)),
            n_routed_experts=int(cfg["n_routed_experts"]),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=int(cfg["num_attention_heads"]),
            q_lora_rank=None if cfg.get("q_lora_rank") is None else int(cfg["q_lora_rank"]),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            vocab_size=int(cfg["vocab_size"]),
            expert_bias=cfg.get("topk_method") == "noaux_tc",
        )

    @classmethod
    def load(cls, path: str) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hf(json.load(f))

    def is_moe(self, layer: int) -> bool:
        # Same rule as vLLM's DeepseekV2DecoderLayer.
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense
                and layer % self.moe_layer_freq == 0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _parse_kv(text: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    key = None
    for tok in text.split(","):
        tok = tok.strip()
        if "=" in tok:
            key, _, val = tok.partition("=")
            key = key.strip()
            out[key] = val.strip()
        elif key is not None and tok:
            out[key] += "," + tok  # continuation of a list value (layers=7,7,8)
        else:
            raise LayoutError(f"{what} layout {text!r}: expected key=value pairs")
    return out


EXPERT_STORAGES = ("grouped", "te_grouped", "sequential")


@dataclass(frozen=True)
class TrainLayout:
    """Megatron: TP t, PP p with an explicit layer list, EP e with moe_tp_extend_ep (experts
    split over the t*e expert group, no expert TP), data parallel from the world size."""

    tp: int
    pp: int
    ep: int
    layers: tuple[int, ...]
    # Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * tp.
    vocab_divisible_by: int = 128
    # megatron-core 0.12.1's MLA spec builds the q/kv down-projections as column-parallel
    # (output split over TP, gathered in forward); MindSpeed's spec keeps them replicated.
    mla_down_split: bool = True
    # How a rank stores its routed experts (EXPERT_STORAGES): "grouped" is GroupedMLP
    # (weight1 / weight2, MindSpeed's and megatron's legacy grouped GEMM), "te_grouped" is
    # TEGroupedMLP (linear_fc1.weight<j> per local expert, verl's GPU spec), "sequential" is
    # SequentialMLP (local_experts.<j>.linear_fc1.weight).
    expert_storage: str = "grouped"

    @classmethod
    def parse(cls, text: str) -> "TrainLayout":
        kv = _parse_kv(text, "train")
        unknown = set(kv) - {"tp", "pp", "ep", "layers", "vocab_div", "mla_down", "experts"}
        if unknown:
            raise LayoutError(f"train layout: unknown keys {sorted(unknown)}")
        try:
            tp, pp, ep = int(kv.get("tp", 1)), int(kv.get("pp", 1)), int(kv.get("ep", 1))
            layers = tuple(int(x) for x in kv["layers"].split(",")) if "layers" in kv else ()
            div = int(kv.get("vocab_div", 128))
        except ValueError as exc:
            raise LayoutError(f"train layout {text!r}: {exc}") from None
        mla = kv.get("mla_down", "split")
        if mla not in ("split", "replicated"):
            raise LayoutError(f"train layout: mla_down must be split or replicated, not {mla!r}")
        experts = kv.get("experts", "grouped")
        if experts not in EXPERT_STORAGES:
            raise LayoutError(f"train layout: experts must be one of {EXPERT_STORAGES}, not {experts!r}")
        return cls(tp, pp, ep, layers, div, mla == "split", experts)


@dataclass(frozen=True)
class RolloutLayout:
    """vLLM: K instances of DP d_r x TP t_r; MoE layers use EP = d_r * t_r per instance."""

    tp: int
    dp: int
    instances: int = 1
    # vLLM-Ascend replicates the shared experts over TP (no split) when multistream MoE or its
    # prefill optimizations are on (CustomDeepseekV2MLP(force_replicate=True)); vLLM splits them.
    shared_replicated: bool = False

    @property
    def world(self) -> int:
        return self.instances * self.dp * self.tp

    @classmethod
    def parse(cls, text: str) -> "RolloutLayout":
        kv = _parse_kv(text, "rollout")
        unknown = set(kv) - {"tp", "dp", "instances", "shared"}
        if unknown:
            raise LayoutError(f"rollout layout: unknown keys {sorted(unknown)}")
        shared = kv.get("shared", "split")
        if shared not in ("split", "replicated"):
            raise LayoutError(f"rollout layout: shared must be split or replicated, not {shared!r}")
        try:
            return cls(int(kv.get("tp", 1)), int(kv.get("dp", 1)), int(kv.get("instances", 1)),
                       shared == "replicated")
        except ValueError as exc:
            raise LayoutError(f"rollout layout {text!r}: {exc}") from None


# --------------------------------------------------------------------------------------
# Rank coordinates
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainCoords:
    tp_groups: list[list[int]]
    pp_groups: list[list[int]]
    dp_groups: list[list[int]]
    expert_groups: list[list[int]]
    tp_rank: list[int]
    pp_rank: list[int]
    expert_rank: list[int]


def _index_in(groups: list[list[int]], world: int) -> list[int]:
    idx = [-1] * world
    for g in groups:
        for i, r in enumerate(g):
            idx[r] = i
    return idx


def train_coords(t: int, p: int, e: int, world: int) -> TrainCoords:
    """Rank coordinates from megatron-core's own RankGenerator, configured as
    parallel_state.initialize_model_parallel configures it (order tp-cp-ep-dp-pp).

    moe_tp_extend_ep is expressed in megatron-core 0.12.1 terms as expert_tensor_parallel=1,
    expert_model_parallel=t*e: the expert group is then TP x EP (tests check this against
    initialize_model_parallel on gloo)."""
    try:
        from megatron.core.parallel_state import RankGenerator
    except ImportError as exc:  # pragma: no cover - megatron-core is a runtime requirement
        raise LayoutError("megatron-core (0.12.1) is needed for Megatron rank coordinates") from exc
    d = world // (t * p)
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=t, ep=1, dp=d, pp=p, cp=1, order=order, rank_offset=0)
    expert = RankGenerator(tp=1, ep=t * e, dp=world // (t * e * p), pp=p, cp=1, order=order,
                           rank_offset=0)
    tp_g, pp_g, dp_g = dense.get_ranks("tp"), dense.get_ranks("pp"), dense.get_ranks("dp")
    ep_g = expert.get_ranks("ep")
    return TrainCoords(tp_g, pp_g, dp_g, ep_g, _index_in(tp_g, world), _index_in(pp_g, world),
                       _index_in(ep_g, world))


@dataclass(frozen=True)
class RolloutCoords:
    tp_groups: list[list[int]]
    dp_groups: list[list[int]]
    ep_groups: list[list[int]]
    tp_rank: list[int]
    ep_rank: list[int]


def rollout_coords(r: RolloutLayout) -> RolloutCoords:
    """vLLM 0.9.1 parallel_state.initialize_model_parallel: ranks laid out as
    arange(world).reshape(ExternalDP, DP, PP, TP); the EP group of an instance is its DP x TP
    ranks, EP rank = dp_rank * tp + tp_rank (FusedMoEParallelConfig.make). Tests compare
    these groups with the ones vLLM builds on gloo."""
    import torch

    all_ranks = torch.arange(r.world).reshape(r.instances, r.dp, 1, r.tp)
    tp_g = [x.tolist() for x in all_ranks.view(-1, r.tp).unbind(0)]
    dp_g = [x.tolist() for x in all_ranks.transpose(1, 3).reshape(-1, r.dp).unbind(0)]
    ep_g = [x.tolist() for x in all_ranks.transpose(1, 2).reshape(-1, r.dp * r.tp).unbind(0)]
    return RolloutCoords(tp_g, dp_g, ep_g, _index_in(tp_g, r.world), _index_in(ep_g, r.world))


def vllm_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """Global experts [a, b) hosted by EP rank (vLLM 0.9.1 determine_expert_map: E // EP
    each, the last rank takes the remainder)."""
    if ep_size == 1:
        return 0, num_experts
    per = num_experts // ep_size
    if ep_rank < ep_size - 1:
        return ep_rank * per, (ep_rank + 1) * per
    return ep_rank * per, num_experts


def pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# --------------------------------------------------------------------------------------
# Slots, parts, placements
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """Where a part lives in a storage parameter: storage.view(reshape) -> narrow(...) ->
    permute(...) gives a tensor whose shape is the part's box, in logical orientation."""

    name: str
    reshape: tuple[int, ...] | None = None
    narrows: tuple[tuple[int, int, int], ...] = ()
    permute: tuple[int, ...] | None = None

    def view(self, storage: Any) -> Any:
        t = storage
        if self.reshape is not None:
            t = t.view(self.reshape)
        for dim, start, length in self.narrows:
            t = t.narrow(dim, start, length)
        if self.permute is not None:
            t = t.permute(self.permute)
        return t


@dataclass(frozen=True)
class Part:
    box: Box
    ranks: tuple[int, ...]
    slot: Slot
    shard: int = 0  # training: index of the holder in its gather group (tp or expert rank)


@dataclass
class Logical:
    name: str
    shape: tuple[int, ...]
    train: list[Part] = field(default_factory=list)
    rollout: list[Part] = field(default_factory=list)
    stage: int = 0  # training PP stage that owns it
    # How Megatron shards it: None (replicated in the stage), "tp" or "ep"; used by baselines.
    gather: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Placements:
    model: ModelConfig
    train: TrainLayout
    rollout: RolloutLayout
    world: int
    tcoords: TrainCoords
    rcoords: RolloutCoords
    tensors: list[Logical]
    train_storage: list[dict[str, tuple[int, ...]]]   # per rank: Megatron name -> shape
    rollout_storage: list[dict[str, tuple[int, ...]]]  # per rank: vLLM name -> shape
    rollout_zero: list[list[Slot]]  # per rank: padding regions vLLM zero-fills (vocab)
    stage_layers: list[list[int]]  # global layer ids per stage

    def by_name(self) -> dict[str, Logical]:
        return {t.name: t for t in self.tensors}


def _split(shape: tuple[int, ...], dim: int, n: int, what: str, side: str) -> list[Box]:
    if shape[dim] % n:
        raise LayoutError(f"{what}: {side} splits dim {dim} of size {shape[dim]} into {n} parts, "
                          f"which does not divide (shape {list(shape)})")
    k = shape[dim] // n
    return [tuple((i * k, (i + 1) * k) if d == dim else (0, s) for d, s in enumerate(shape))
            for i in range(n)]


def build_placements(model: ModelConfig, train: TrainLayout, rollout: RolloutLayout) -> Placements:
    """Every logical tensor of the model with its training and rollout parts."""
    W = rollout.world
    t, p, e = train.tp, train.pp, train.ep
    tr = rollout.tp
    for what, v in (("train tp", t), ("train pp", p), ("train ep", e), ("rollout tp", tr),
                    ("rollout dp", rollout.dp), ("rollout instances", rollout.instances)):
        if v < 1:
            raise LayoutError(f"{what} must be >= 1, got {v}")
    if W % (t * p):
        raise LayoutError(f"world {W} (rollout {rollout.instances}x{rollout.dp}x{rollout.tp}) is not "
                          f"divisible by train tp*pp = {t * p}")
    d = W // (t * p)
    if d % e:
        raise LayoutError(f"train data parallel {d} (= world {W} / tp {t} / pp {p}) is not divisible "
                          f"by ep {e}")
    layers = train.layers or tuple([model.num_layers // p] * p)
    if len(layers) != p or sum(layers) != model.num_layers or min(layers) < 0:
        raise LayoutError(f"train layers {list(layers)}: need {p} stages summing to "
                          f"{model.num_layers} layers")
    if train.layers == () and model.num_layers % p:
        raise LayoutError(f"{model.num_layers} layers do not split evenly over pp {p}: give layers=")
    tc = train_coords(t, p, e, W)
    rc = rollout_coords(rollout)

    stage_ranks: list[list[int]] = [[] for _ in range(p)]
    for r in range(W):
        stage_ranks[tc.pp_rank[r]].append(r)
    # ranks of stage s with TP rank i / expert rank k
    stage_tp = [[[r for r in stage_ranks[s] if tc.tp_rank[r] == i] for i in range(t)] for s in range(p)]
    te = t * e
    stage_ep = [[[r for r in stage_ranks[s] if tc.expert_rank[r] == k] for k in range(te)]
                for s in range(p)]
    rtp = [[r for r in range(W) if rc.tp_rank[r] == i] for i in range(tr)]
    ep_r = rollout.dp * tr
    rep = [[r for r in range(W) if rc.ep_rank[r] == q] for q in range(ep_r)]
    all_ranks = tuple(range(W))

    stage_layers: list[list[int]] = []
    first = 0
    for n in layers:
        stage_layers.append(list(range(first, first + n)))
        first += n
    layer_stage = {g: s for s, ls in enumerate(stage_layers) for g in ls}
    local_idx = {g: i for ls in stage_layers for i, g in enumerate(ls)}

    tensors: list[Logical] = []
    tstore: list[dict[str, tuple[int, ...]]] = [dict() for _ in range(W)]
    rstore: list[dict[str, tuple[int, ...]]] = [dict() for _ in range(W)]
    rzero: list[list[Slot]] = [[] for _ in range(W)]

    def add_train(lt: Logical, boxes: list[Box], holders: list[list[int]], slots: list[Slot],
                  storage_shape: tuple[int, ...]) -> None:
        for i, (b, hs, sl) in enumerate(zip(boxes, holders, slots)):
            if box_numel(b) == 0:
                continue
            lt.train.append(Part(b, tuple(hs), sl, i))
        for hs, sl in zip(holders, slots):
            for r in hs:
                tstore[r][sl.name] = storage_shape

    def add_roll(lt: Logical, boxes: list[Box], needers: list[list[int]], slots: list[Slot],
                 storage_shapes: list[tuple[int, ...]]) -> None:
        for b, ns, sl, shp in zip(boxes, needers, slots, storage_shapes):
            if box_numel(b):
                lt.rollout.append(Part(b, tuple(ns), sl))
            for r in ns:
                rstore[r][sl.name] = shp

    def dense(name: str, shape: tuple[int, ...], s: int, tname: str, rname: str,
              tdim: int | None, rdim: int | None, fused: tuple[int, int] | None = None) -> None:
        """A weight TP-split (dim tdim / rdim, None = replicated) on each side. fused=(k, n):
        the storage fuses n logical tensors of this shape along the split dim, this is the k-th
        (gate=0 / up=1 of a SwiGLU fc1 / gate_up_proj)."""
        lt = Logical(name, shape, stage=s, gather=None if tdim is None else "tp")
        k, n = fused or (0, 1)
        # training
        if tdim is None:
            lt.train.append(Part(full_box(shape), tuple(stage_ranks[s]), Slot(tname)))
            for r in stage_ranks[s]:
                tstore[r][tname] = shape
        else:
            boxes = _split(shape, tdim, t, name, f"training tp={t}")
            per = shape[tdim] // t
            sshape = tuple(per * n if dd == tdim else x for dd, x in enumerate(shape))
            slots = [Slot(tname, narrows=((tdim, k * per, per),) if n > 1 else ()) for _ in boxes]
            add_train(lt, boxes, stage_tp[s], slots, sshape)
        # rollout
        if rdim is None:
            # Replicated; a fused storage (gate_up) stacks its n parts on the training split dim.
            fd = tdim if tdim is not None else 0
            rshape = tuple(x * n if dd == fd else x for dd, x in enumerate(shape))
            lt.rollout.append(Part(full_box(shape), all_ranks,
                                   Slot(rname, narrows=((fd, k * shape[fd], shape[fd]),) if n > 1 else ())))
            for r in all_ranks:
                rstore[r][rname] = rshape
        else:
            boxes = _split(shape, rdim, tr, name, f"rollout tp={tr}")
            per = shape[rdim] // tr
            sshape = tuple(per * n if dd == rdim else x for dd, x in enumerate(shape))
            slots = [Slot(rname, narrows=((rdim, k * per, per),) if n > 1 else ()) for _ in boxes]
            add_roll(lt, boxes, rtp, slots, [sshape] * len(boxes))
        tensors.append(lt)

    def vocab(name: str, tname: str, rname: str, s: int) -> None:
        V, H = model.vocab_size, model.hidden_size
        lt = Logical(name, (V, H), stage=s, gather="tp")
        vp = pad_to(V, train.vocab_divisible_by * t)
        per = vp // t
        for i in range(t):
            a, b = min(i * per, V), min((i + 1) * per, V)
            if b > a:
                lt.train.append(Part(((a, b), (0, H)), tuple(stage_tp[s][i]),
                                     Slot(tname, narrows=((0, 0, b - a),)), i))
            for r in stage_tp[s][i]:
                tstore[r][tname] = (per, H)
        # vLLM VocabParallelEmbedding / ParallelLMHead: pad to 64, split evenly over TP, rows
        # past the real vocabulary are zero-filled by its weight_loader.
        vpr = pad_to(V, 64)
        if vpr % tr:
            raise LayoutError(f"{name}: vLLM pads vocab {V} to {vpr}, not divisible by rollout tp {tr}")
        perr = vpr // tr
        for i in range(tr):
            a, b = min(i * perr, V), min((i + 1) * perr, V)
            if b > a:
                lt.rollout.append(Part(((a, b), (0, H)), tuple(rtp[i]), Slot(rname, narrows=((0, 0, b - a),))))
            for r in rtp[i]:
                rstore[r][rname] = (perr, H)
                if perr - (b - a) > 0:
                    rzero[r].append(Slot(rname, narrows=((0, b - a, perr - (b - a)),)))
        tensors.append(lt)

    def experts(name: str, shape: tuple[int, int, int], s: int, tname: str, rname: str,
                tslot: Any, rslot: Any, tshape: tuple[int, ...], rshape_fn: Any,
                per_expert: tuple[Any, tuple[int, ...]] | None = None) -> None:
        lt = Logical(name, shape, stage=s, gather="ep")
        E = shape[0]
        if E % te:
            raise LayoutError(f"{name}: {E} experts do not split over the training expert group "
                              f"tp*ep = {t}*{e} = {te}")
        el = E // te
        for k in range(te):
            if per_expert is None:
                lt.train.append(Part(((k * el, (k + 1) * el),) + full_box(shape[1:]), tuple(stage_ep[s][k]),
                                     tslot(el), k))
                for r in stage_ep[s][k]:
                    tstore[r][tname] = tshape
                continue
            # One parameter per local expert j: one part each.
            slot_of, pshape = per_expert
            for j in range(el):
                sl = slot_of(j)
                lt.train.append(Part(((k * el + j, k * el + j + 1),) + full_box(shape[1:]),
                                     tuple(stage_ep[s][k]), sl, k))
                for r in stage_ep[s][k]:
                    tstore[r][sl.name] = pshape
        for q in range(ep_r):
            a, b = vllm_expert_range(E, ep_r, q)
            if b > a:
                lt.rollout.append(Part(((a, b),) + full_box(shape[1:]), tuple(rep[q]), rslot(b - a)))
            for r in rep[q]:
                rstore[r][rname] = rshape_fn(b - a)
        tensors.append(lt)

    H = model.hidden_size
    nh = model.num_heads
    vocab("model.embed_tokens.weight", "embedding.word_embeddings.weight", "model.embed_tokens.weight", 0)
    for g in range(model.num_layers):
        s = layer_stage[g]
        tp_ = f"decoder.layers.{local_idx[g]}."
        hp = f"model.layers.{g}."
        dense(hp + "input_layernorm.weight", (H,), s, tp_ + "input_layernorm.weight",
              hp + "input_layernorm.weight", None, None)
        att = tp_ + "self_attention."
        down_dim = 0 if train.mla_down_split else None
        if model.q_lora_rank is not None:
            dense(hp + "self_attn.q_a_proj.weight", (model.q_lora_rank, H), s,
                  att + "linear_q_down_proj.weight", hp + "self_attn.q_a_proj.weight", down_dim, None)
            dense(hp + "self_attn.q_a_layernorm.weight", (model.q_lora_rank,), s,
                  att + "linear_q_up_proj.layer_norm_weight", hp + "self_attn.q_a_layernorm.weight",
                  None, None)
            dense(hp + "self_attn.q_b_proj.weight", (nh * model.qk_head_dim, model.q_lora_rank), s,
                  att + "linear_q_up_proj.weight", hp + "self_attn.q_b_proj.weight", 0, 0)
        else:
            dense(hp + "self_attn.q_proj.weight", (nh * model.qk_head_dim, H), s,
                  att + "linear_q_proj.weight", hp + "self_attn.q_proj.weight", 0, 0)
        dense(hp + "self_attn.kv_a_proj_with_mqa.weight", (model.kv_lora_rank + model.qk_rope_head_dim, H),
              s, att + "linear_kv_down_proj.weight", hp + "self_attn.kv_a_proj_with_mqa.weight",
              down_dim, None)
        dense(hp + "self_attn.kv_a_layernorm.weight", (model.kv_lora_rank,), s,
              att + "linear_kv_up_proj.layer_norm_weight", hp + "self_attn.kv_a_layernorm.weight",
              None, None)
        dense(hp + "self_attn.kv_b_proj.weight",
              (nh * (model.qk_nope_head_dim + model.v_head_dim), model.kv_lora_rank), s,
              att + "linear_kv_up_proj.weight", hp + "self_attn.kv_b_proj.weight", 0, 0)
        dense(hp + "self_attn.o_proj.weight", (H, nh * model.v_head_dim), s,
              att + "linear_proj.weight", hp + "self_attn.o_proj.weight", 1, 1)
        if not model.is_moe(g):
            I = model.intermediate_size
            dense(hp + "post_attention_layernorm.weight", (H,), s, tp_ + "mlp.linear_fc1.layer_norm_weight",
                  hp + "post_attention_layernorm.weight", None, None)
            dense(hp + "mlp.gate_proj.weight", (I, H), s, tp_ + "mlp.linear_fc1.weight",
                  hp + "mlp.gate_up_proj.weight", 0, 0, fused=(0, 2))
            dense(hp + "mlp.up_proj.weight", (I, H), s, tp_ + "mlp.linear_fc1.weight",
                  hp + "mlp.gate_up_proj.weight", 0, 0, fused=(1, 2))
            dense(hp + "mlp.down_proj.weight", (H, I), s, tp_ + "mlp.linear_fc2.weight",
                  hp + "mlp.down_proj.weight", 1, 1)
            continue
        E, Im = model.n_routed_experts, model.moe_intermediate_size
        dense(hp + "post_attention_layernorm.weight", (H,), s, tp_ + "pre_mlp_layernorm.weight",
              hp + "post_attention_layernorm.weight", None, None)
        dense(hp + "mlp.gate.weight", (E, H), s, tp_ + "mlp.router.weight", hp + "mlp.gate.weight",
              None, None)
        if model.expert_bias:
            dense(hp + "mlp.gate.e_score_correction_bias", (E,), s, tp_ + "mlp.router.expert_bias",
                  hp + "mlp.gate.e_score_correction_bias", None, None)
        if model.n_shared_experts:
            Is = Im * model.n_shared_experts
            sh, rs = tp_ + "mlp.shared_experts.", hp + "mlp.shared_experts."
            r0, r1 = (None, None) if rollout.shared_replicated else (0, 1)
            dense(rs + "gate_proj.weight", (Is, H), s, sh + "linear_fc1.weight", rs + "gate_up_proj.weight",
                  0, r0, fused=(0, 2))
            dense(rs + "up_proj.weight", (Is, H), s, sh + "linear_fc1.weight", rs + "gate_up_proj.weight",
                  0, r0, fused=(1, 2))
            dense(rs + "down_proj.weight", (H, Is), s, sh + "linear_fc2.weight", rs + "down_proj.weight", 1, r1)
        el = E // (te) if E % te == 0 else 0
        w1, w2 = tp_ + "mlp.experts.weight1", tp_ + "mlp.experts.weight2"
        r13, r2 = hp + "mlp.experts.w13_weight", hp + "mlp.experts.w2_weight"
        # Megatron GroupedMLP: weight1 [H, El*2I] is used as view(El, H, 2I) (gate | up on the
        # last dim), weight2 [El*I, H] as view(El, I, H): both transposed relative to HF/vLLM.
        # vLLM FusedMoE: w13 [El, 2I, H] (gate rows then up rows), w2 [El, H, I].
        # TEGroupedMLP / SequentialMLP: one [2I, H] fc1 (gate rows then up rows) and one [H, I]
        # fc2 per local expert, already in HF/vLLM orientation.
        fc1, fc2 = _per_expert_names(tp_ + "mlp.experts.", train.expert_storage)
        for k, lname in ((0, "gate_proj"), (1, "up_proj")):
            experts(hp + f"mlp.experts.{lname}.weight", (E, Im, H), s, w1, r13,
                    lambda n, k=k: Slot(w1, reshape=(n, H, 2 * Im), narrows=((2, k * Im, Im),),
                                        permute=(0, 2, 1)),
                    lambda n, k=k: Slot(r13, narrows=((1, k * Im, Im),)),
                    (H, el * 2 * Im), lambda n: (n, 2 * Im, H),
                    None if fc1 is None else
                    (lambda j, k=k: Slot(fc1(j), reshape=(1, 2 * Im, H), narrows=((1, k * Im, Im),)),
                     (2 * Im, H)))
        experts(hp + "mlp.experts.down_proj.weight", (E, H, Im), s, w2, r2,
                lambda n: Slot(w2, reshape=(n, Im, H), permute=(0, 2, 1)),
                lambda n: Slot(r2), (el * Im, H), lambda n: (n, H, Im),
                None if fc2 is None else (lambda j: Slot(fc2(j), reshape=(1, H, Im)), (H, Im)))
    dense("model.norm.weight", (H,), p - 1, "decoder.final_layernorm.weight", "model.norm.weight", None, None)
    vocab("lm_head.weight", "output_layer.weight", "lm_head.weight", p - 1)
    return Placements(model, train, rollout, W, tc, rc, tensors, tstore, rstore, rzero, stage_layers)


def _per_expert_names(prefix: str, storage: str) -> tuple[Any, Any]:
    """Megatron parameter names of local expert j's fc1 / fc2, or (None, None) for GroupedMLP."""
    if storage == "te_grouped":
        return (lambda j: f"{prefix}linear_fc1.weight{j}"), (lambda j: f"{prefix}linear_fc2.weight{j}")
    if storage == "sequential":
        return ((lambda j: f"{prefix}local_experts.{j}.linear_fc1.weight"),
                (lambda j: f"{prefix}local_experts.{j}.linear_fc2.weight"))
    if storage != "grouped":
        raise LayoutError(f"expert storage {storage!r}: expected one of {EXPERT_STORAGES}")
    return None, None


def hf_expert_names(name: str, num_experts: int) -> list[str]:
    """HF per-expert names of a stacked logical expert tensor (model.layers.L.mlp.experts.X.weight)."""
    prefix, _, tail = name.rpartition(".experts.")
    return [f"{prefix}.experts.{j}.{tail}" for j in range(num_experts)]


_EXPERT_STACKS = (".mlp.experts.gate_proj.weight", ".mlp.experts.up_proj.weight",
                  ".mlp.experts.down_proj.weight")


def is_expert_stack(name: str) -> bool:
    """Whether a logical name is a routed-expert stack (model.layers.L.mlp.experts.X.weight)."""
    return name.endswith(_EXPERT_STACKS)
