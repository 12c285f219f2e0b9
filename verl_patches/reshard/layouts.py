"""The training layout (Megatron TP / PP / EP, uneven stages, expert storage) and the rollout
layout (vLLM TP x DP instances with expert parallelism), parsed from their short text form."""

from __future__ import annotations

from dataclasses import dataclass

from verl_patches.reshard.model import LayoutError


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
