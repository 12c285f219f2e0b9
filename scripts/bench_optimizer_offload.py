#!/usr/bin/env python3
"""The optimizer on the device against megatron-core's own CPU offload (HybridDeviceOptimizer, the recipe's
patch verl.optim.cpu_offload): step time, device memory and host memory of each, trained through the
recipe's switch loop on a small DeepSeek-V3-shaped model (verl_patches/rigs/testing/optimizer_offload.py).

    python scripts/bench_optimizer_offload.py                                  # the GPU here, tiny model
    python scripts/bench_optimizer_offload.py --set hidden_size=1024 --set moe_intermediate_size=512 \\
        --set n_routed_experts=32 --steps 6 --fractions 1.0,0.5
    python scripts/bench_optimizer_offload.py --device cpu --steps 2           # CI: the code path on the host

Per variant (the device optimizer first, then each --fractions value): median step time (forward,
backward and optimizer step) and optimizer-step time over the steps after the first (which builds Adam's
state), the device memory the update peaks at and what the training side leaves on the device while the
rollout runs (after the switch's offload of the training params), the host bytes the hybrid optimizer
holds (fp32 masters, Adam's moments, pinned grad copies), the switch's pinned pool and the growth of the
process's resident memory; and how far its fp32 masters moved from the device optimizer's
(||d - d_device|| / ||d_device|| over the change since the start) with the share of bit-equal bf16 params;
the device optimizer runs twice, so the second row shows how far the run repeats itself.

On the CPU there is no device to offload from: megatron-core's HybridDeviceOptimizer moves only CUDA
params to the host and cannot step host params, so --device cpu runs the device-optimizer variant through
the switch loop and records every hybrid variant as not run, with that reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _args(argv: list[str] | None) -> argparse.Namespace:
    from verl_patches.base.schema import Integer, Number, Text
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--model", type=Text(), default=str(ROOT / "configs" / "model" / "tiny_deepseek_v3.json"),
                   help="DeepSeek-V3 config.json")
    p.add_argument("--set", action="append", type=Text(), default=[], metavar="KEY=INT",
                   help="override an integer field of the model config (repeatable)")
    p.add_argument("--steps", type=Integer(low=2), default=6, help="updates per variant (at least 2)")
    p.add_argument("--fractions", type=Text(), default="1.0", help="comma-separated offload fractions in (0, 1]")
    p.add_argument("--overlap", action="store_true", help="overlap_cpu_optimizer_d2h_h2d for the hybrid variants")
    p.add_argument("--lr", type=Number(low=0, low_open=True), default=1e-3)
    p.add_argument("--batch", type=Integer(low=1), default=2)
    p.add_argument("--seq", type=Integer(low=1), default=32)
    p.add_argument("--json-out", type=Text(), default=None)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be at least 2 (the first builds Adam's state), got {args.steps}")
    try:
        args.fractions = [float(x) for x in args.fractions.split(",") if x.strip()]
    except ValueError:
        p.error(f"--fractions must be comma-separated numbers, got {args.fractions!r}")
    if not all(0.0 < f <= 1.0 for f in args.fractions):
        p.error(f"--fractions must each be in (0, 1], got {args.fractions}")
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key.strip()] = int(value)
        except ValueError:
            p.error(f"--set {item!r}: expected KEY=INT")
    args.overrides = overrides
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    import torch

    from verl_patches.rigs.testing import optimizer_offload as oo

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    oo.setup(device)
    cfg = oo.model_config(args.model, **args.overrides)
    common = dict(steps=args.steps, lr=args.lr, batch=args.batch, seq=args.seq, device=device, snapshots=False)
    ref = oo.run_variant(cfg, fraction=None, **common)
    rows = [{"variant": "device", **oo.summary(ref)}]
    # The device optimizer again: how far the run repeats itself (the floor for the rel diff column).
    again = oo.run_variant(cfg, fraction=None, **common)
    rows.append({"variant": "device, again", **oo.summary(again), "rel_diff_vs_device": oo.rel_diff(again, ref),
                 "equal_bf16_params_vs_device": oo.equal_params(again, ref)})
    for f in args.fractions:
        name = f"host fraction {f:g}" + (" overlap" if args.overlap else "")
        if device != "cuda":
            rows.append({"variant": name, "fraction": f, "not_run": "HybridDeviceOptimizer moves CUDA params to "
                         "the host and cannot step host params: it needs a GPU"})
            continue
        r = oo.run_variant(cfg, fraction=f, overlap=args.overlap, **common)
        rows.append({"variant": name, **oo.summary(r), "rel_diff_vs_device": oo.rel_diff(r, ref),
                     "equal_bf16_params_vs_device": oo.equal_params(r, ref)})
    params = sum(x.numel() for x in ref["params"])
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "model_params": params, "config_overrides": args.overrides, "steps": args.steps}
    gib = 1 << 30
    print(json.dumps(info))
    print(f"{'variant':<28} {'step ms':>9} {'opt ms':>9} {'upd peak GiB':>13} {'rollout dev GiB':>16} "
          f"{'host opt GiB':>13} {'rss +GiB':>9} {'rel diff':>10} {'bf16 equal':>11}")
    for row in rows:
        if "not_run" in row:
            print(f"{row['variant']:<28} not run: {row['not_run']}")
            continue

        def g(x):
            return f"{x / gib:.3f}" if isinstance(x, (int, float)) else "-"

        rollout = row["rollout_device_allocated"][-1] if row["rollout_device_allocated"] else None
        print(f"{row['variant']:<28} {1e3 * row['median_step_s']:>9.2f} {1e3 * row['median_optimizer_s']:>9.2f} "
              f"{g(row['update_peak_allocated']):>13} {g(rollout):>16} {g(row['host_optimizer_bytes']):>13} "
              f"{g(row['host_rss_growth_bytes']):>9} {row.get('rel_diff_vs_device', 0.0):>10.2e} "
              f"{row.get('equal_bf16_params_vs_device', 1.0):>11.4f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"info": info, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
