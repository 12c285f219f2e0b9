"""`python -m verl_patches plan`: plan the reshard for a model and two layouts from metadata
alone and print each method's cost (ours, upstream A, recipe B), as a table or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
from verl_patches.reshard.model import LayoutError, ModelConfig
from verl_patches.reshard.placements import build_placements
from verl_patches.reshard.planner import DTYPE_BYTES, build_plan
from verl_patches.reshard.summary import plan_summaries


def _gb(n: float) -> str:
    return f"{n / 1e9:,.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m verl_patches plan",
        description="Plan the train->rollout reshard of a DeepSeek-V3 model and compare methods.")
    ap.add_argument("--model", required=True, help="HF config.json of the model (e.g. configs/model/deepseek_v3.json)")
    ap.add_argument("--train", required=True,
                    help="Megatron layout, e.g. tp=4,pp=8,ep=8,layers=7,7,8,8,8,8,8,7 "
                         "[,vocab_div=128][,mla_down=split|replicated]")
    ap.add_argument("--rollout", required=True, help="vLLM layout, e.g. tp=2,dp=128[,instances=1]")
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="bucket bound, MiB (default 256): what one rank sends plus receives in one "
                         "collective; the executor keeps two buckets in flight")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        model = ModelConfig.load(args.model)
        P = build_placements(model, TrainLayout.parse(args.train), RolloutLayout.parse(args.rollout))
        if args.bucket_mb <= 0:
            raise LayoutError(f"--bucket-mb must be positive, got {args.bucket_mb}")
        plan = build_plan(model, P.train, P.rollout, bucket_bytes=int(args.bucket_mb * (1 << 20)),
                          dtype=args.dtype, placements=P)
        rows = plan_summaries(plan)
    except (LayoutError, OSError, json.JSONDecodeError) as exc:
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
