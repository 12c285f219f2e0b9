"""The reshard engine on live models: Megatron's actor modules in, vLLM's model parameters out.

Collects each side's parameters by name and derives the training layout from what this rank
really stores (agreed by every rank, so all build the same plan) and the rollout layout from
vLLM's model; the weight sync (verl_patches/reshard/weight_sync.py) plans and moves with them.
Framework-light: torch.distributed only; megatron and vLLM objects are passed in by the patch.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from verl_patches.config.megatron_args import RecipeMegatron, check_layout
from verl_patches.reshard import deepseek_v3_names as names
from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
from verl_patches.reshard.model import LayoutError, ModelConfig

_WRAPPER = "module."  # DDP and Float16Module both hold the model as .module
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# fc2 of one local expert: TEGroupedMLP (linear_fc2.weight<j>) or SequentialMLP (local_experts.<j>.linear_fc2.weight)
_PER_EXPERT = re.compile(r"mlp\.experts\.(linear_fc2\.weight(?P<te>\d+)|local_experts\.(?P<seq>\d+)\.linear_fc2\.weight)$")
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


# megatron-core's local (non-Transformer-Engine) spec keeps the layer norms that the TE spec
# (verl's GPU models, mirrored by MindSpeed) fuses into the following linear; the plan uses
# the TE names.
_LOCAL_TO_TE = names.local_to_te()
_DENSE_PRE_MLP = (names.DENSE["post_attention_layernorm"].local, names.DENSE["post_attention_layernorm"].mcore)


def _te_name(name: str, dense_layers: set[str]) -> str:
    m = _LAYER.match(name)
    if not m:
        return name
    layer, rest = name[: m.end()], name[m.end():]
    if rest in _LOCAL_TO_TE:
        return layer + _LOCAL_TO_TE[rest]
    if rest == _DENSE_PRE_MLP[0] and layer in dense_layers:
        return layer + _DENSE_PRE_MLP[1]
    return name


def _split_fused_down(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MindSpeed-LLM's DeepSeek spec (the NPU's training model) fuses MLA's two down projections into one
    TP-replicated ``linear_qkv``: q_a_proj's rows, then kv_a_proj_with_mqa's. The plan names them apart (the
    TE names, replicated: ``mla_down_split`` False), so each becomes a row view of the one tensor. Its query
    LoRA rank, where q's rows end, is the input size of the layer's ``linear_q_up_proj``."""
    out: dict[str, torch.Tensor] = {}
    for n, t in raw.items():
        if not n.endswith("." + names.MINDSPEED_LLM_QKV):
            out[n] = t
            continue
        layer = n[: -len(names.MINDSPEED_LLM_QKV)]
        up = raw.get(layer + names.ATTN["q_b_proj"].mcore)
        if up is None:
            raise LayoutError(f"{n}: a fused down projection (MindSpeed-LLM's spec) in a layer without "
                              f"{names.ATTN['q_b_proj'].mcore}: the reshard binding supports it with a query LoRA "
                              "rank (q_lora_rank) only, as DeepSeek-V3 has")
        q_rows = up.shape[1]
        if t.dim() != 2 or not 0 < q_rows < t.shape[0]:
            raise LayoutError(f"{n}: shape {tuple(t.shape)} cannot hold q_lora_rank {q_rows} rows and the kv rows")
        out[layer + names.ATTN["q_a_proj"].mcore] = t.narrow(0, 0, q_rows)
        out[layer + names.ATTN["kv_a_proj"].mcore] = t.narrow(0, q_rows, t.shape[0] - q_rows)
    return out


def megatron_params(modules: Any) -> dict[str, torch.Tensor]:
    """The training parameters of this rank under megatron-core's names in the Transformer-
    Engine spec (wrappers stripped, local layer numbering of the PP stage; local-spec and
    MindSpeed-LLM-spec norm names mapped to their TE names, MindSpeed-LLM's fused down
    projection split in two row views). One model chunk only: virtual pipeline stages would need
    one train layout per chunk."""
    chunks = list(modules) if isinstance(modules, (list, tuple, torch.nn.ModuleList)) else [modules]
    if len(chunks) != 1:
        raise LayoutError(f"the reshard binding takes one Megatron model chunk per rank, got {len(chunks)} "
                          "(virtual pipeline parallel is not supported: set virtual_pipeline_model_parallel_size=null)")
    raw: dict[str, torch.Tensor] = {}
    # The router's expert bias (aux-loss-free balancing) is a buffer in megatron-core, a
    # parameter (e_score_correction_bias) in vLLM.
    tensors = list(chunks[0].named_parameters()) + [
        (n, b) for n, b in chunks[0].named_buffers() if n.endswith("mlp.router.expert_bias")]
    for name, p in tensors:
        while name.startswith(_WRAPPER):
            name = name[len(_WRAPPER):]
        raw[name] = p.data
    raw = _split_fused_down(raw)
    dense = {n[: _LAYER.match(n).end()] for n in raw if _LAYER.match(n) and n.endswith(".mlp.linear_fc1.weight")}
    out = {_te_name(n, dense): t for n, t in raw.items()}
    if len(out) != len(raw):
        raise LayoutError("Megatron parameters collide after mapping local-spec norm names to the TE spec")
    return out


def vllm_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """vLLM's model parameters by name (what its load_weights would write)."""
    return {n: p.data for n, p in model.named_parameters()}


def _local_layers(train: Mapping[str, torch.Tensor]) -> int:
    return len({int(m.group(1)) for n in train for m in [_LAYER.match(n)] if m})


def _local_facts(cfg: ModelConfig, tp: int, train: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What this rank's storage says about the layout (None where it holds no evidence)."""
    facts: dict[str, Any] = {"mla_down_split": None, "experts_per_rank": None, "expert_storage": None}
    kv_rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    for n, t in train.items():
        if n.endswith("self_attention.linear_kv_down_proj.weight") and tp > 1:
            if t.shape[0] == kv_rows:
                facts["mla_down_split"] = False
            elif t.shape[0] * tp == kv_rows:
                facts["mla_down_split"] = True
            else:
                raise LayoutError(f"{n}: {t.shape[0]} rows, expected {kv_rows} (replicated) or {kv_rows}/{tp} "
                                  "(split over TP)")
    Im = cfg.moe_intermediate_size
    for n, t in train.items():
        if n.endswith("mlp.experts.weight2"):  # GroupedMLP: [experts * I, H]
            facts["expert_storage"], facts["experts_per_rank"] = "grouped", t.shape[0] // Im
            break
        m = _PER_EXPERT.search(n)
        if m:
            storage = "te_grouped" if m.group("te") is not None else "sequential"
            layer = n[: m.start()]
            facts["expert_storage"] = storage
            facts["experts_per_rank"] = sum(1 for x in train if x.startswith(layer) and _PER_EXPERT.search(x))
            break
    return facts


def _agree(facts: dict[str, Any], group: Any = None) -> dict[str, Any]:
    """Every rank's non-None facts must agree; ranks without evidence take the others' value."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return facts
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, facts, group=group)
    out: dict[str, Any] = {}
    for key in facts:
        seen = {f[key] for f in everyone if f[key] is not None}
        if len(seen) > 1:
            raise LayoutError(f"ranks disagree on the training layout's {key}: {sorted(map(str, seen))}")
        out[key] = seen.pop() if seen else None
    return out


def derive_train_layout(cfg: ModelConfig, *, tp: int, pp: int, pp_rank: int, layers: Iterable[int] | None,
                        train: Mapping[str, torch.Tensor], group: Any = None) -> TrainLayout:
    """The TrainLayout of a running Megatron model: TP/PP from megatron's parallel state, the
    layer list from the recipe (MindSpeed num_layer_list) or an even split, and from the
    parameters themselves (agreed over all ranks): how the MLA down-projections are stored,
    how many experts a rank holds (tp * ep = experts / experts-per-rank, which is how
    moe_tp_extend_ep shows in storage) and how they are stored. The vocabulary is not
    padded: verl builds GPTModel with the HF vocab size."""
    layers = tuple(int(x) for x in layers) if layers else ()
    if not layers:
        if cfg.num_layers % pp:
            raise LayoutError(f"{cfg.num_layers} layers do not split evenly over pp={pp}: set "
                              "actor_rollout_ref.rollout.recipe.megatron.num_layer_list")
        layers = (cfg.num_layers // pp,) * pp
    check_layout(RecipeMegatron(num_layer_list=layers), num_layers=cfg.num_layers, pp=pp)
    have = _local_layers(train)
    if have != layers[pp_rank]:
        raise LayoutError(f"PP stage {pp_rank} holds {have} decoder layers, recipe.megatron.num_layer_list says "
                          f"{layers[pp_rank]}: the Megatron model was built with another layer split")
    facts = _agree(_local_facts(cfg, tp, train), group)
    per = facts["experts_per_rank"]
    if per is None or per == 0:
        raise LayoutError("no rank holds routed experts: the reshard binding expects a DeepSeek-V3 MoE model")
    E = cfg.n_routed_experts
    if E % per or (E // per) % tp:
        raise LayoutError(f"{per} experts per rank of {E}: the expert group ({E // max(per, 1)} ranks) must be a "
                          f"multiple of tp={tp} (moe_tp_extend_ep: experts over the TP x EP ranks, no expert TP)")
    return TrainLayout(tp=tp, pp=pp, ep=E // per // tp, layers=layers, vocab_divisible_by=1,
                       mla_down_split=True if facts["mla_down_split"] is None else facts["mla_down_split"],
                       expert_storage=facts["expert_storage"])


def derive_rollout_layout(cfg: ModelConfig, rollout: RolloutLayout, roll: Mapping[str, torch.Tensor]) -> RolloutLayout:
    """What the engine's own model says beyond the DP / TP sizes: vLLM-Ascend replicates the
    shared experts over TP under multistream MoE (every rank holds both halves of gate_up)."""
    rows = 2 * cfg.moe_intermediate_size * cfg.n_shared_experts
    for n, t in roll.items():
        if n.endswith("mlp.shared_experts.gate_up_proj.weight") and rollout.tp > 1:
            if t.shape[0] == rows:
                return replace(rollout, shared_replicated=True)
            if t.shape[0] * rollout.tp != rows:
                raise LayoutError(f"{n}: {t.shape[0]} rows, expected {rows} (replicated) or {rows}/{rollout.tp} "
                                  "(split over the rollout TP)")
            break
    return rollout


def check_expert_placement(model: torch.nn.Module, P: Any, rank: int) -> int:
    """vLLM's experts must sit where the plan puts them: contiguous blocks per EP rank (vLLM's
    determine_expert_map). vLLM-Ascend's expert_map_path / dynamic EPLB move them elsewhere;
    refused here, by layer, instead of resharding into the wrong experts. Returns layers checked."""
    want: dict[str, tuple[int, int]] = {}
    for lt in P.tensors:
        for part in lt.rollout:
            if rank in part.ranks and part.slot.name.endswith(".mlp.experts.w13_weight"):
                want[part.slot.name[: -len(".w13_weight")]] = part.box[0]
    checked = 0
    for name, module in model.named_modules():
        if name not in want or not hasattr(module, "w13_weight"):
            continue
        a, b = want[name]
        em = getattr(module, "expert_map", None)
        if em is None:  # no expert parallel: the rank holds every expert
            ok = (a, b) == (0, module.w13_weight.shape[0])
        else:
            em = em.tolist()
            ok = [i for i, x in enumerate(em) if x >= 0] == list(range(a, b)) and \
                all(em[i] == i - a for i in range(a, b))
        if not ok:
            raise LayoutError(f"{name}: this rank's vLLM experts are not the contiguous block [{a}, {b}) the "
                              "reshard plan writes (expert_map_path / dynamic EPLB in vLLM-Ascend's "
                              "additional_config?); the reshard needs vLLM's default expert placement")
        checked += 1
    return checked


# Training tensors kept in another precision than the rest (megatron-core keeps the router's
# expert bias in fp32 under a bf16 model) are cast for the reshard; vLLM's own loader casts them
# the same way. A whole model in another dtype is a configuration error, not something to copy.
MAX_CAST_BYTES = 256 << 20


def as_rollout_dtype(train: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = dict(train)
    other = {n: t for n, t in train.items() if t.dtype != dtype}
    size = sum(t.numel() * t.element_size() for t in other.values())
    if size > MAX_CAST_BYTES:
        kinds = sorted({str(t.dtype) for t in other.values()})
        raise LayoutError(f"{len(other)} training tensors ({size} bytes, {kinds}, e.g. {next(iter(other))}) are not "
                          f"{dtype} like vLLM's parameters: set rollout.dtype to the actor's param dtype")
    out.update({n: t.to(dtype) for n, t in other.items()})
    return out
