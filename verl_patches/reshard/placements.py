"""DeepSeek-V3 logical tensors and where every part of each lives in the Megatron training
layout and in the vLLM rollout layout (metadata only: no tensors, no process groups).

A *logical tensor* is one HF-oriented tensor (expert weights stacked over experts). Each side
places it as *parts*: a box of the logical tensor, the ranks holding it (training replicas, or
rollout ranks needing it) and a *slot*: the storage parameter and the view of it that holds
the box (this is where fused gate/up, transposed grouped-GEMM weights and vocab padding live).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from verl_patches.reshard.box import Box, box_numel, full_box
from verl_patches.reshard.coords import RolloutCoords, TrainCoords, rollout_coords, train_coords, vllm_expert_range
from verl_patches.reshard import deepseek_v3_names as names
from verl_patches.reshard.deepseek_v3_names import _per_expert_names
from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
from verl_patches.reshard.model import LayoutError, ModelConfig


def pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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
    A, D, M, X = names.ATTN, names.DENSE, names.MOE, names.EDGES
    vocab(X["embedding"].hf, X["embedding"].mcore, X["embedding"].hf, 0)
    for g in range(model.num_layers):
        s = layer_stage[g]
        tp_ = names.MCORE_LAYER.format(local_idx[g])
        hp = names.HF_LAYER.format(g)

        def same(n: names.Name, shape: tuple[int, ...], tdim: int | None, rdim: int | None, **kw) -> None:
            """A tensor vLLM keeps under its HF name (train name: the TE spec's)."""
            dense(hp + n.hf, shape, s, tp_ + n.mcore, hp + n.hf, tdim, rdim, **kw)

        same(A["input_layernorm"], (H,), None, None)
        down_dim = 0 if train.mla_down_split else None
        if model.q_lora_rank is not None:
            same(A["q_a_proj"], (model.q_lora_rank, H), down_dim, None)
            same(A["q_a_layernorm"], (model.q_lora_rank,), None, None)
            same(A["q_b_proj"], (nh * model.qk_head_dim, model.q_lora_rank), 0, 0)
        else:
            same(A["q_proj"], (nh * model.qk_head_dim, H), 0, 0)
        same(A["kv_a_proj"], (model.kv_lora_rank + model.qk_rope_head_dim, H), down_dim, None)
        same(A["kv_a_layernorm"], (model.kv_lora_rank,), None, None)
        same(A["kv_b_proj"], (nh * (model.qk_nope_head_dim + model.v_head_dim), model.kv_lora_rank), 0, 0)
        same(A["o_proj"], (H, nh * model.v_head_dim), 1, 1)
        if not model.is_moe(g):
            I = model.intermediate_size
            same(D["post_attention_layernorm"], (H,), None, None)
            for k, key in enumerate(("gate_proj", "up_proj")):
                dense(hp + D[key].hf, (I, H), s, tp_ + D[key].mcore, hp + names.VLLM_GATE_UP, 0, 0, fused=(k, 2))
            same(D["down_proj"], (H, I), 1, 1)
            continue
        E, Im = model.n_routed_experts, model.moe_intermediate_size
        same(M["post_attention_layernorm"], (H,), None, None)
        same(M["router"], (E, H), None, None)
        if model.expert_bias:
            same(M["expert_bias"], (E,), None, None)
        if model.n_shared_experts:
            Is = Im * model.n_shared_experts
            r0, r1 = (None, None) if rollout.shared_replicated else (0, 1)
            for k, key in enumerate(("shared_gate_proj", "shared_up_proj")):
                dense(hp + M[key].hf, (Is, H), s, tp_ + M[key].mcore, hp + names.VLLM_SHARED_GATE_UP, 0, r0,
                      fused=(k, 2))
            same(M["shared_down_proj"], (H, Is), 1, r1)
        el = E // (te) if E % te == 0 else 0
        w1, w2 = tp_ + names.MCORE_GROUPED_W1, tp_ + names.MCORE_GROUPED_W2
        r13, r2 = hp + names.VLLM_EXPERTS_W13, hp + names.VLLM_EXPERTS_W2
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
    dense(X["final_norm"].hf, (H,), p - 1, X["final_norm"].mcore, X["final_norm"].hf, None, None)
    vocab(X["output"].hf, X["output"].mcore, X["output"].hf, p - 1)
    return Placements(model, train, rollout, W, tc, rc, tensors, tstore, rstore, rzero, stage_layers)
