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


def _check_layout(model: ModelConfig, train: TrainLayout, rollout: RolloutLayout) -> tuple[int, ...]:
    """The layouts must divide the model and each other; returns the layers per stage."""
    W, t, p, e = rollout.world, train.tp, train.pp, train.ep
    for what, v in (("train tp", t), ("train pp", p), ("train ep", e), ("rollout tp", rollout.tp),
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
    return layers


class _Builder:
    """Places the model's tensors one kind at a time (replicated or TP-split dense weights, the
    padded vocabulary, stacked experts), filling the per-rank storage tables as it goes."""

    def __init__(self, model: ModelConfig, train: TrainLayout, rollout: RolloutLayout) -> None:
        self.model, self.train, self.rollout = model, train, rollout
        layers = _check_layout(model, train, rollout)
        W, t, p, e = rollout.world, train.tp, train.pp, train.ep
        self.W, self.t, self.tr, self.te = W, t, rollout.tp, t * e
        self.tc, self.rc = train_coords(t, p, e, W), rollout_coords(rollout)
        tc, rc = self.tc, self.rc
        self.stage_ranks: list[list[int]] = [[r for r in range(W) if tc.pp_rank[r] == s] for s in range(p)]
        # ranks of stage s with TP rank i / expert rank k; rollout ranks with TP rank i / EP rank q
        self.stage_tp = [[[r for r in self.stage_ranks[s] if tc.tp_rank[r] == i] for i in range(t)]
                         for s in range(p)]
        self.stage_ep = [[[r for r in self.stage_ranks[s] if tc.expert_rank[r] == k] for k in range(self.te)]
                         for s in range(p)]
        self.rtp = [[r for r in range(W) if rc.tp_rank[r] == i] for i in range(self.tr)]
        self.ep_r = rollout.dp * self.tr
        self.rep = [[r for r in range(W) if rc.ep_rank[r] == q] for q in range(self.ep_r)]
        self.stage_layers: list[list[int]] = []
        first = 0
        for n in layers:
            self.stage_layers.append(list(range(first, first + n)))
            first += n
        self.tensors: list[Logical] = []
        self.tstore: list[dict[str, tuple[int, ...]]] = [dict() for _ in range(W)]
        self.rstore: list[dict[str, tuple[int, ...]]] = [dict() for _ in range(W)]
        self.rzero: list[list[Slot]] = [[] for _ in range(W)]

    def placements(self) -> Placements:
        return Placements(self.model, self.train, self.rollout, self.W, self.tc, self.rc, self.tensors,
                          self.tstore, self.rstore, self.rzero, self.stage_layers)

    # -- the three kinds of tensor ---------------------------------------------------------
    def dense(self, name: str, shape: tuple[int, ...], s: int, tname: str, rname: str,
              tdim: int | None, rdim: int | None, fused: tuple[int, int] | None = None) -> None:
        """A weight TP-split (dim tdim / rdim, None = replicated) on each side. fused=(k, n):
        the storage fuses n logical tensors of this shape along the split dim, this is the k-th
        (gate=0 / up=1 of a SwiGLU fc1 / gate_up_proj)."""
        lt = Logical(name, shape, stage=s, gather=None if tdim is None else "tp")
        k, n = fused or (0, 1)

        def fused_slot(name_: str, dim: int, per: int) -> Slot:
            return Slot(name_, narrows=((dim, k * per, per),) if n > 1 else ())

        def stretched(dim: int, per: int) -> tuple[int, ...]:
            return tuple(per * n if dd == dim else x for dd, x in enumerate(shape))

        if tdim is None:
            lt.train.append(Part(full_box(shape), tuple(self.stage_ranks[s]), Slot(tname)))
            for r in self.stage_ranks[s]:
                self.tstore[r][tname] = shape
        else:
            per = shape[tdim] // self.t
            for i, b in enumerate(_split(shape, tdim, self.t, name, f"training tp={self.t}")):
                if box_numel(b):
                    lt.train.append(Part(b, tuple(self.stage_tp[s][i]), fused_slot(tname, tdim, per), i))
            for holders in self.stage_tp[s]:
                for r in holders:
                    self.tstore[r][tname] = stretched(tdim, per)
        if rdim is None:
            # Replicated; a fused storage (gate_up) stacks its n parts on the training split dim.
            fd = tdim if tdim is not None else 0
            lt.rollout.append(Part(full_box(shape), tuple(range(self.W)), fused_slot(rname, fd, shape[fd])))
            for r in range(self.W):
                self.rstore[r][rname] = stretched(fd, shape[fd])
        else:
            per = shape[rdim] // self.tr
            for i, b in enumerate(_split(shape, rdim, self.tr, name, f"rollout tp={self.tr}")):
                if box_numel(b):
                    lt.rollout.append(Part(b, tuple(self.rtp[i]), fused_slot(rname, rdim, per)))
                for r in self.rtp[i]:
                    self.rstore[r][rname] = stretched(rdim, per)
        self.tensors.append(lt)

    def vocab(self, name: str, tname: str, rname: str, s: int) -> None:
        """Embedding / output layer: vocabulary rows split over TP, padded differently per side."""
        V, H = self.model.vocab_size, self.model.hidden_size
        lt = Logical(name, (V, H), stage=s, gather="tp")
        per = pad_to(V, self.train.vocab_divisible_by * self.t) // self.t
        for i in range(self.t):
            a, b = min(i * per, V), min((i + 1) * per, V)
            if b > a:
                lt.train.append(Part(((a, b), (0, H)), tuple(self.stage_tp[s][i]),
                                     Slot(tname, narrows=((0, 0, b - a),)), i))
            for r in self.stage_tp[s][i]:
                self.tstore[r][tname] = (per, H)
        # vLLM VocabParallelEmbedding / ParallelLMHead: pad to 64, split evenly over TP, rows
        # past the real vocabulary are zero-filled by its weight_loader.
        vpr = pad_to(V, 64)
        if vpr % self.tr:
            raise LayoutError(f"{name}: vLLM pads vocab {V} to {vpr}, not divisible by rollout tp {self.tr}")
        perr = vpr // self.tr
        for i in range(self.tr):
            a, b = min(i * perr, V), min((i + 1) * perr, V)
            if b > a:
                lt.rollout.append(Part(((a, b), (0, H)), tuple(self.rtp[i]), Slot(rname, narrows=((0, 0, b - a),))))
            for r in self.rtp[i]:
                self.rstore[r][rname] = (perr, H)
                if perr - (b - a) > 0:
                    self.rzero[r].append(Slot(rname, narrows=((0, b - a, perr - (b - a)),)))
        self.tensors.append(lt)

    def experts(self, name: str, shape: tuple[int, int, int], s: int, tname: str, rname: str,
                tslot: Any, rslot: Any, tshape: tuple[int, ...], rshape_fn: Any,
                per_expert: tuple[Any, tuple[int, ...]] | None = None) -> None:
        """Experts stacked on dim 0: contiguous blocks per training expert rank (one grouped
        parameter, or ``per_expert`` = (slot of local expert j, its shape): one parameter each)
        and vLLM's contiguous expert ranges per rollout EP rank."""
        lt = Logical(name, shape, stage=s, gather="ep")
        E = shape[0]
        if E % self.te:
            raise LayoutError(f"{name}: {E} experts do not split over the training expert group "
                              f"tp*ep = {self.t}*{self.train.ep} = {self.te}")
        el = E // self.te
        rest = full_box(shape[1:])
        for k in range(self.te):
            holders = self.stage_ep[s][k]
            if per_expert is None:
                lt.train.append(Part(((k * el, (k + 1) * el),) + rest, tuple(holders), tslot(el), k))
                for r in holders:
                    self.tstore[r][tname] = tshape
                continue
            slot_of, pshape = per_expert
            for j in range(el):
                sl = slot_of(j)
                lt.train.append(Part(((k * el + j, k * el + j + 1),) + rest, tuple(holders), sl, k))
                for r in holders:
                    self.tstore[r][sl.name] = pshape
        for q in range(self.ep_r):
            a, b = vllm_expert_range(E, self.ep_r, q)
            if b > a:
                lt.rollout.append(Part(((a, b),) + rest, tuple(self.rep[q]), rslot(b - a)))
            for r in self.rep[q]:
                self.rstore[r][rname] = rshape_fn(b - a)
        self.tensors.append(lt)

    # -- DeepSeek-V3's layers --------------------------------------------------------------
    def layer(self, g: int, s: int, local: int) -> None:
        self.attention(g, s, local)
        if self.model.is_moe(g):
            self.moe(g, s, local)
        else:
            self.dense_mlp(g, s, local)

    def _same(self, g: int, s: int, local: int, n: names.Name, shape: tuple[int, ...], tdim: int | None,
              rdim: int | None, **kw: Any) -> None:
        """A tensor vLLM keeps under its HF name (train name: the TE spec's)."""
        hp = names.HF_LAYER.format(g)
        self.dense(hp + n.hf, shape, s, names.MCORE_LAYER.format(local) + n.mcore, hp + n.hf, tdim, rdim, **kw)

    def attention(self, g: int, s: int, local: int) -> None:
        m, A, H, nh = self.model, names.ATTN, self.model.hidden_size, self.model.num_heads
        same = lambda n, shape, tdim, rdim: self._same(g, s, local, n, shape, tdim, rdim)  # noqa: E731
        same(A["input_layernorm"], (H,), None, None)
        down_dim = 0 if self.train.mla_down_split else None
        if m.q_lora_rank is not None:
            same(A["q_a_proj"], (m.q_lora_rank, H), down_dim, None)
            same(A["q_a_layernorm"], (m.q_lora_rank,), None, None)
            same(A["q_b_proj"], (nh * m.qk_head_dim, m.q_lora_rank), 0, 0)
        else:
            same(A["q_proj"], (nh * m.qk_head_dim, H), 0, 0)
        same(A["kv_a_proj"], (m.kv_lora_rank + m.qk_rope_head_dim, H), down_dim, None)
        same(A["kv_a_layernorm"], (m.kv_lora_rank,), None, None)
        same(A["kv_b_proj"], (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), 0, 0)
        same(A["o_proj"], (H, nh * m.v_head_dim), 1, 1)

    def dense_mlp(self, g: int, s: int, local: int) -> None:
        D, H, I = names.DENSE, self.model.hidden_size, self.model.intermediate_size
        hp, tp_ = names.HF_LAYER.format(g), names.MCORE_LAYER.format(local)
        self._same(g, s, local, D["post_attention_layernorm"], (H,), None, None)
        for k, key in enumerate(("gate_proj", "up_proj")):
            self.dense(hp + D[key].hf, (I, H), s, tp_ + D[key].mcore, hp + names.VLLM_GATE_UP, 0, 0, fused=(k, 2))
        self._same(g, s, local, D["down_proj"], (H, I), 1, 1)

    def moe(self, g: int, s: int, local: int) -> None:
        m, M, H = self.model, names.MOE, self.model.hidden_size
        hp, tp_ = names.HF_LAYER.format(g), names.MCORE_LAYER.format(local)
        E, Im = m.n_routed_experts, m.moe_intermediate_size
        self._same(g, s, local, M["post_attention_layernorm"], (H,), None, None)
        self._same(g, s, local, M["router"], (E, H), None, None)
        if m.expert_bias:
            self._same(g, s, local, M["expert_bias"], (E,), None, None)
        if m.n_shared_experts:
            Is = Im * m.n_shared_experts
            r0, r1 = (None, None) if self.rollout.shared_replicated else (0, 1)
            for k, key in enumerate(("shared_gate_proj", "shared_up_proj")):
                self.dense(hp + M[key].hf, (Is, H), s, tp_ + M[key].mcore, hp + names.VLLM_SHARED_GATE_UP, 0, r0,
                           fused=(k, 2))
            self._same(g, s, local, M["shared_down_proj"], (H, Is), 1, r1)
        el = E // self.te if E % self.te == 0 else 0
        w1, w2 = tp_ + names.MCORE_GROUPED_W1, tp_ + names.MCORE_GROUPED_W2
        r13, r2 = hp + names.VLLM_EXPERTS_W13, hp + names.VLLM_EXPERTS_W2
        # Megatron GroupedMLP: weight1 [H, El*2I] is used as view(El, H, 2I) (gate | up on the
        # last dim), weight2 [El*I, H] as view(El, I, H): both transposed relative to HF/vLLM.
        # vLLM FusedMoE: w13 [El, 2I, H] (gate rows then up rows), w2 [El, H, I].
        # TEGroupedMLP / SequentialMLP: one [2I, H] fc1 (gate rows then up rows) and one [H, I]
        # fc2 per local expert, already in HF/vLLM orientation.
        fc1, fc2 = _per_expert_names(tp_ + "mlp.experts.", self.train.expert_storage)
        for k, lname in ((0, "gate_proj"), (1, "up_proj")):
            self.experts(hp + f"mlp.experts.{lname}.weight", (E, Im, H), s, w1, r13,
                         lambda n, k=k: Slot(w1, reshape=(n, H, 2 * Im), narrows=((2, k * Im, Im),),
                                             permute=(0, 2, 1)),
                         lambda n, k=k: Slot(r13, narrows=((1, k * Im, Im),)),
                         (H, el * 2 * Im), lambda n: (n, 2 * Im, H),
                         None if fc1 is None else
                         (lambda j, k=k: Slot(fc1(j), reshape=(1, 2 * Im, H), narrows=((1, k * Im, Im),)),
                          (2 * Im, H)))
        self.experts(hp + "mlp.experts.down_proj.weight", (E, H, Im), s, w2, r2,
                     lambda n: Slot(w2, reshape=(n, Im, H), permute=(0, 2, 1)),
                     lambda n: Slot(r2), (el * Im, H), lambda n: (n, H, Im),
                     None if fc2 is None else (lambda j: Slot(fc2(j), reshape=(1, H, Im)), (H, Im)))


def build_placements(model: ModelConfig, train: TrainLayout, rollout: RolloutLayout) -> Placements:
    """Every logical tensor of the model with its training and rollout parts, in the model's
    order: embedding, each layer (attention, then the dense MLP or the MoE), final norm, output."""
    b = _Builder(model, train, rollout)
    X, H, last = names.EDGES, model.hidden_size, train.pp - 1
    b.vocab(X["embedding"].hf, X["embedding"].mcore, X["embedding"].hf, 0)
    for s, stage in enumerate(b.stage_layers):
        for local, g in enumerate(stage):
            b.layer(g, s, local)
    b.dense(X["final_norm"].hf, (H,), last, X["final_norm"].mcore, X["final_norm"].hf, None, None)
    b.vocab(X["output"].hf, X["output"].mcore, X["output"].hf, last)
    return b.placements()


def zero_padding(P: Placements, rank: int, roll: dict[str, Any]) -> None:
    """vLLM zero-fills the vocab rows past the real vocabulary; do the same (no traffic)."""
    for slot in P.rollout_zero[rank]:
        slot.view(roll[slot.name]).zero_()
