"""`python -m verl_patches plan`: plan the reshard for a model and two layouts from metadata
alone and print each method's cost (ours, upstream A, recipe B), as a table or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from verl_patches.config.settings import BUCKET_MB, TOOL_BUCKET_MB_HIGH, TOOL_BUCKET_MB_LOW
from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
from verl_patches.reshard.model import LayoutError, ModelConfig
from verl_patches.reshard.placements import build_placements
from verl_patches.reshard.planner import DTYPE_BYTES, build_plan
from verl_patches.reshard.weight_sync import plan_summaries
from verl_patches.base.schema import Number, Text


# Input bounds: far above any DeepSeek-V3 layout (the recipe's world is 256 ranks), low enough that
# a mistyped number is an error at once and never hours of planning or an exhausted host.
MAX_WORLD = 8192
# HF config keys that decide shapes: (minimum, maximum); None: may be absent or null.
MODEL_INTS = {
    "hidden_size": (1, 1 << 17), "num_hidden_layers": (1, 1024), "first_k_dense_replace": (0, 1024),
    "n_routed_experts": (0, 1 << 14), "moe_intermediate_size": (1, 1 << 18), "intermediate_size": (1, 1 << 18),
    "num_attention_heads": (1, 1 << 12), "kv_lora_rank": (1, 1 << 14), "qk_nope_head_dim": (1, 1 << 12),
    "qk_rope_head_dim": (1, 1 << 12), "v_head_dim": (1, 1 << 12), "vocab_size": (1, 1 << 24),
}
OPTIONAL_INTS = {"q_lora_rank": (1, 1 << 14), "n_shared_experts": (0, 1 << 10), "moe_layer_freq": (1, 1024),
                 "num_nextn_predict_layers": (0, 1024)}


def load_model(path: str) -> ModelConfig:
    """The model config at ``path``, every shape-deciding value checked (LayoutError naming the
    file and the key), before the planner computes anything from it."""
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 24)
        cfg = json.loads(raw.decode("utf-8"))
    except OSError as e:
        raise LayoutError(f"--model {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise LayoutError(f"--model {path}: not a JSON config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise LayoutError(f"--model {path}: a JSON object (a HF config.json) is expected, got {type(cfg).__name__}")
    problems = []
    for key, (lo, hi) in [*MODEL_INTS.items(), *OPTIONAL_INTS.items()]:
        if key not in cfg or (key in OPTIONAL_INTS and cfg[key] is None):
            continue
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            problems.append(f"{key}={v!r} (a whole number in [{lo}, {hi}])")
    if problems:
        raise LayoutError(f"--model {path}: " + "; ".join(problems))
    try:
        return ModelConfig.from_hf(cfg)
    except LayoutError as e:
        raise LayoutError(f"--model {path}: {e}") from None


def check_sizes(train: TrainLayout, rollout: RolloutLayout) -> None:
    for what, v in (("train tp", train.tp), ("train pp", train.pp), ("train ep", train.ep),
                    ("rollout tp", rollout.tp), ("rollout dp", rollout.dp), ("rollout instances", rollout.instances)):
        if v < 1:
            raise LayoutError(f"{what} must be >= 1, got {v}")
        if v > MAX_WORLD:
            raise LayoutError(f"{what} must be <= {MAX_WORLD}, got {v}")
    if rollout.world > MAX_WORLD or train.tp * train.pp * train.ep > MAX_WORLD:
        raise LayoutError(f"the world ({rollout.instances}x{rollout.dp}x{rollout.tp} = {rollout.world} ranks, train "
                          f"tp*pp*ep = {train.tp * train.pp * train.ep}) exceeds {MAX_WORLD} ranks, what this planner "
                          "is meant for")
    if any(n < 0 or n > 1024 for n in train.layers):
        raise LayoutError(f"train layers {list(train.layers)}: each stage holds 0 to 1024 layers")
    if not 1 <= train.vocab_divisible_by <= 1 << 20:
        raise LayoutError(f"train vocab_div must be in [1, {1 << 20}], got {train.vocab_divisible_by}")


def _gb(n: float) -> str:
    return f"{n / 1e9:,.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m verl_patches plan",
        description="Plan the train->rollout reshard of a DeepSeek-V3 model and compare methods.")
    ap.add_argument("--model", type=Text(), required=True, help="HF config.json of the model (e.g. configs/model/deepseek_v3.json)")
    ap.add_argument("--train", type=Text(), required=True,
                    help="Megatron layout, e.g. tp=4,pp=8,ep=8,layers=7,7,8,8,8,8,8,7 "
                         "[,vocab_div=128][,mla_down=split|replicated]")
    ap.add_argument("--rollout", type=Text(), required=True, help="vLLM layout, e.g. tp=2,dp=128[,instances=1]")
    ap.add_argument("--bucket-mb", type=Number(low=TOOL_BUCKET_MB_LOW, high=TOOL_BUCKET_MB_HIGH),
                    default=float(BUCKET_MB),
                    help=f"transfer bucket bound, MiB (default {BUCKET_MB}): what one rank sends plus receives in one "
                         "collective; the executor keeps two buckets in flight")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        model = load_model(args.model)
        train, rollout = TrainLayout.parse(args.train), RolloutLayout.parse(args.rollout)
        check_sizes(train, rollout)
        P = build_placements(model, train, rollout)
        plan = build_plan(model, P.train, P.rollout, bucket_bytes=int(args.bucket_mb * (1 << 20)),
                          dtype=args.dtype, placements=P)
        rows = plan_summaries(plan)
    except (LayoutError, OSError) as exc:
        print(f"plan: error: {exc}", file=sys.stderr)
        return 2
    secs = time.perf_counter() - t0
    shard = max(s.shard_bytes for s in plan.ranks)
    redundancy_free = all(s.recv_bytes == s.shard_bytes - s.local_bytes for s in plan.ranks)
    if args.json:
        print(json.dumps({"world": P.world, "bucket_bytes": plan.bucket_bytes, "dtype": plan.dtype,
                          "max_rollout_shard_bytes": shard, "direct_recv_is_shard_minus_local": redundancy_free,
                          "plan_seconds": round(secs, 3), "methods": rows}, indent=2))
        return 0
    print(f"world {P.world} ranks, bucket {plan.bucket_bytes / (1 << 20):g} MiB, {plan.dtype}; "
          f"largest rollout shard {_gb(shard)} GB; planned in {secs:.1f} s")
    hdr = f"{'method':<10}{'max recv/rank GB':>18}{'mean recv/rank GB':>19}{'total on links GB':>19}" \
          f"{'collectives':>13}{'peak extra/rank GB':>20}"
    print(hdr)
    for r in rows:
        print(f"{r['method']:<10}{_gb(r['max_recv_bytes']):>18}{_gb(r['mean_recv_bytes']):>19}"
              f"{_gb(r['total_link_bytes']):>19}{r['collectives']:>13}{_gb(r['peak_extra_bytes']):>20}")
    d = rows[0]["max_recv_bytes"] or 1
    print(f"max recv vs direct: upstream {rows[1]['max_recv_bytes'] / d:.1f}x, recipe "
          f"{rows[2]['max_recv_bytes'] / d:.1f}x; direct receives exactly its shard minus local "
          f"bytes on every rank: {redundancy_free}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
