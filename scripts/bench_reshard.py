"""Benchmark of the three reshard methods (direct, upstream A, alltoallv B) side by side on
DeepSeek-V3-shaped layers: time, bytes, peak device memory, bus bandwidth vs all_to_all.

The all-to-all ceiling: before any layout, a plain all_to_all_single is timed over per-rank message
sizes (--a2a-sizes-mb, 16 MiB to 2 GiB by default; bus bandwidth = bytes a rank sends to its peers /
time, median of --a2a-repeats, slowest rank). Each method's bus bandwidth is then given as a fraction
of two references: "of a2a" the all-to-all at the reshard's own per-collective size (half a bucket
each way), "of peak" the best value of that curve (the large-message ceiling). A third, "of staged":
the same all-to-all with a copy of twice its bytes (a pack and an unpack) on a side stream beside it,
timed until both finish: the most a reshard that stages its bytes through buffers can reach, since the
copies and the collective share the device's memory bandwidth. direct@N in --methods runs the direct
method with N buckets in flight (the executor's default is 2).

Launch with torchrun (gloo on CPU, NCCL on GPU through the accelerator facade):
    torchrun --nproc-per-node 2 scripts/bench_reshard.py --train tp=1,pp=2,ep=1 --rollout tp=2,dp=1
The plan needs megatron-core (rank coordinates); where it is not installed, build it elsewhere
with --save-plan FILE (no torchrun needed) and pass --plan FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_patches.base import accelerator  # noqa: E402
from verl_patches.reshard.alltoallv import alltoallv_stats  # noqa: E402
from verl_patches.reshard.baselines import upstream_stats  # noqa: E402
from verl_patches.config.settings import (BUCKET_MB, METHODS, TOOL_BUCKET_MB_HIGH,  # noqa: E402
                                          TOOL_BUCKET_MB_LOW)
from verl_patches.reshard.weight_sync import execute  # noqa: E402
from verl_patches.reshard.layouts import RolloutLayout, TrainLayout  # noqa: E402
from verl_patches.reshard.model import ModelConfig  # noqa: E402
from verl_patches.reshard.placements import build_placements  # noqa: E402
from verl_patches.reshard.planner import Plan, build_plan  # noqa: E402
from verl_patches.reshard.shards import allocate, random_train_shards, torch_dtype  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def bench_model(layers: int, experts: int, path: str = str(REPO / "configs/model/deepseek_v3.json")) -> ModelConfig:
    """DeepSeek-V3 with its real hidden, MLA, expert and vocab sizes, fewer layers and experts."""
    cfg = json.loads(Path(path).read_text())
    cfg.update(num_hidden_layers=layers, first_k_dense_replace=min(1, layers), n_routed_experts=experts)
    return ModelConfig.from_hf(cfg)


def make_plans(args: argparse.Namespace) -> list[Plan]:
    model = bench_model(args.layers, args.experts, args.model)
    plans = []
    for train, rollout in zip(args.train, args.rollout):
        P = build_placements(model, TrainLayout.parse(train), RolloutLayout.parse(rollout))
        plans.append(build_plan(model, P.train, P.rollout, bucket_bytes=int(args.bucket_mb * (1 << 20)),
                                dtype=args.dtype, placements=P))
    return plans


def a2a_busbw(nbytes: int, dtype: torch.dtype, device: torch.device, world: int, rank: int,
              repeats: int) -> float:
    """Bus bandwidth (bytes a rank sends to peers / time) of one all_to_all_single in which each
    rank sends nbytes in total, split evenly over its peers."""
    es = torch.empty((), dtype=dtype).element_size()
    peers = max(1, world - 1)
    n = max(peers, nbytes // es)
    splits = [0 if p == rank and world > 1 else n // peers for p in range(world)]
    total = sum(splits)
    rsplits = [0 if p == rank and world > 1 else n // peers for p in range(world)]
    sbuf = torch.ones(total, dtype=dtype, device=device)
    rbuf = torch.empty(sum(rsplits), dtype=dtype, device=device)
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        accelerator.synchronize()
        t0 = time.perf_counter()
        dist.all_to_all_single(rbuf, sbuf, output_split_sizes=rsplits, input_split_sizes=splits)
        accelerator.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return total * es / float(t.item())


def a2a_beside_copies(nbytes: int, dtype: torch.dtype, device: torch.device, world: int, rank: int,
                      repeats: int) -> dict[str, float]:
    """The staged ceiling: an all_to_all_single of nbytes per rank (as in a2a_busbw) with a copy of
    2 x nbytes (a pack and an unpack of the same bytes) on a side stream beside it, the most that a
    reshard which stages its bytes through buffers can overlap. Seconds (median, slowest rank) of
    the all-to-all alone, the copy alone and both together; busbw = bytes sent / both."""
    es = torch.empty((), dtype=dtype).element_size()
    peers = max(1, world - 1)
    n = max(peers, nbytes // es)
    splits = [0 if p == rank and world > 1 else n // peers for p in range(world)]
    sbuf = torch.ones(sum(splits), dtype=dtype, device=device)
    rbuf = torch.empty(sum(splits), dtype=dtype, device=device)
    csrc = torch.ones(2 * sum(splits), dtype=dtype, device=device)
    cdst = torch.empty_like(csrc)
    side = accelerator.new_stream()

    def timed(a2a: bool, copy: bool) -> float:
        times = []
        for i in range(repeats + 2):
            dist.barrier()
            accelerator.synchronize()
            t0 = time.perf_counter()
            if copy:
                with accelerator.stream(side):
                    cdst.copy_(csrc)
            if a2a:
                dist.all_to_all_single(rbuf, sbuf, output_split_sizes=splits, input_split_sizes=splits)
            accelerator.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    out = {"a2a_s": timed(True, False), "copy_s": timed(False, True), "both_s": timed(True, True)}
    out["busbw"] = sum(splits) * es / out["both_s"]
    del sbuf, rbuf, csrc, cdst
    accelerator.empty_cache()
    return out


def a2a_curve(sizes_mb: list[float], dtype: torch.dtype, device: torch.device, world: int, rank: int,
              repeats: int) -> list[dict[str, float]]:
    """The all-to-all's bus bandwidth over per-rank message sizes (each rank sends that many bytes in
    total, evenly to its peers), smallest first; buffers are freed after each size."""
    out = []
    for mb in sorted(sizes_mb):
        bw = a2a_busbw(int(mb * (1 << 20)), dtype, device, world, rank, repeats)
        accelerator.empty_cache()
        out.append({"mib_per_rank": mb, "busbw": bw})
    return out


def phase_times(plan: Plan, rank: int, train: dict, roll: dict, device: torch.device) -> dict[str, float]:
    """Direct method run phase by phase with a sync after each (no overlap): where time goes."""
    from verl_patches.reshard.direct import _program, copy_local, pack, unpack

    prog = _program(plan, rank)
    out = {"local": 0.0, "pack": 0.0, "a2a": 0.0, "unpack": 0.0}
    ref = next(iter(roll.values()))

    def timed(key: str, fn):
        accelerator.synchronize()
        t0 = time.perf_counter()
        r = fn()
        accelerator.synchronize()
        out[key] += time.perf_counter() - t0
        return r

    timed("local", lambda: copy_local(plan, rank, train, roll))
    for b, (_, rsplit, _, _) in enumerate(prog.buckets):
        sbuf, ssplit = timed("pack", lambda: pack(plan, rank, b, train, ref.dtype, ref.device))
        rbuf = torch.empty(sum(rsplit), dtype=ref.dtype, device=ref.device)
        timed("a2a", lambda: dist.all_to_all_single(rbuf, sbuf, output_split_sizes=rsplit,
                                                     input_split_sizes=ssplit))
        timed("unpack", lambda: unpack(plan, rank, b, rbuf, roll))
    t = torch.tensor([out[k] for k in sorted(out)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {k: float(v) for k, v in zip(sorted(out), t.tolist())}


def check_copy_kernel(device: torch.device) -> bool:
    """The transposing copy used on CUDA equals torch's own copy_ (bitwise), on the shapes the
    expert weights have (Megatron [E, H, 2I] view -> vLLM [E, I, H]) and on ragged ones."""
    from verl_patches.reshard.copyops import copy_into

    ok = True
    for e, h, i2, lo, n in ((3, 7168, 4096, 2048, 2048), (2, 1000, 300, 0, 150), (1, 513, 257, 1, 255)):
        w = torch.randn(e, h, i2, device=device).to(torch.bfloat16)
        src = w[:, :, lo:lo + n].permute(0, 2, 1)
        a = torch.empty(src.shape, dtype=src.dtype, device=device)
        b = torch.empty_like(a)
        copy_into(a, src)
        b.copy_(src)
        ok &= bool(torch.equal(a, b))
        copy_into(a[0], src[0])  # 2-D
        ok &= bool(torch.equal(a, b))
    return ok


def base_method(name: str) -> str:
    """'direct@3' -> 'direct' (the executor's method)."""
    return name.split("@", 1)[0]


def in_flight(name: str) -> int:
    """'direct@3' -> 3 buckets in flight; a plain method name -> the executor's default, 2."""
    if "@" not in name:
        return 2
    base, n = name.split("@", 1)
    if base != "direct" or not n.isdigit() or int(n) < 1:
        raise ValueError("only direct takes @N, N an integer of at least 1")
    return int(n)


def run(args: argparse.Namespace) -> int:
    backend = accelerator.dist_backend()
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = accelerator.set_device(local)
    dist.init_process_group(backend)
    world = dist.get_world_size()
    if args.plan:
        with open(args.plan, "rb") as f:
            plans = pickle.load(f)
    else:
        plans = make_plans(args)
    copy_ok = check_copy_kernel(device)
    if rank == 0:
        print(f"transposing copy kernel equals torch copy_: {copy_ok}", flush=True)
    if not copy_ok:
        raise SystemExit("copy kernel mismatch")
    curve = a2a_curve(args.a2a_sizes_mb, torch_dtype(plans[0].dtype), device, world, rank, args.a2a_repeats)
    peak = max(c["busbw"] for c in curve)
    if rank == 0:
        print("all_to_all_single bus bandwidth by per-rank message size (GB/s): " +
              ", ".join(f"{c['mib_per_rank']:g} MiB {c['busbw'] / 1e9:.1f}" for c in curve), flush=True)
    staged = {p.bucket_bytes: a2a_beside_copies(p.bucket_bytes // 2, torch_dtype(p.dtype), device, world, rank,
                                                args.a2a_repeats) for p in plans}
    if rank == 0:
        for b, v in staged.items():
            print(f"all-to-all of {b / 2 / (1 << 20):g} MiB per rank with a pack + unpack copy of its bytes on a side "
                  f"stream (ms): alone {v['a2a_s'] * 1e3:.2f}, copy alone {v['copy_s'] * 1e3:.2f}, both "
                  f"{v['both_s'] * 1e3:.2f}; staged ceiling {v['busbw'] / 1e9:.1f} GB/s", flush=True)
    a2a_first = {p.bucket_bytes: a2a_busbw(p.bucket_bytes // 2, torch_dtype(p.dtype), device, world, rank,
                                           3 * args.repeats) for p in plans}
    rows = []
    for plan in plans:
        P = plan.placements
        if P.world != world:
            raise SystemExit(f"plan is for {P.world} ranks, torchrun started {world}")
        dt = torch_dtype(plan.dtype)
        train = random_train_shards(P, rank, plan.dtype, device=device, seed=1)
        roll = allocate(P.rollout_storage[rank], dt, device)
        reference = None
        modelled = {"direct": plan.ranks, "upstream": upstream_stats(P, plan.elem_size),
                    "alltoallv": alltoallv_stats(P, plan.elem_size)}
        for method in args.methods:
            times, peaks, st = [], [], None
            for i in range(args.warmup + args.repeats):
                for v in roll.values():
                    v.fill_(float("nan"))
                accelerator.synchronize()
                dist.barrier()
                base = accelerator.memory_allocated()
                accelerator.reset_peak_memory_stats()
                t0 = time.perf_counter()
                st = execute(plan, rank, train, roll, method=base_method(method), check=(i == 0),
                             in_flight=in_flight(method))
                accelerator.synchronize()
                dt_s = time.perf_counter() - t0
                peaks.append(accelerator.max_memory_allocated() - base)
                if i >= args.warmup:
                    times.append(dt_s)
            med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            if reference is None:
                reference = {n: v.clone() for n, v in roll.items()}
                same = True
            else:
                same = all(torch.equal(roll[n], reference[n]) for n in roll)
            flag = torch.tensor([0 if same else 1], device=device)
            dist.all_reduce(flag)
            # link bytes of a rank: the larger of what it sends and receives (the baselines
            # count only what they receive: their sends mirror it)
            sent = torch.tensor([max(st.sent_bytes, st.recv_bytes), st.recv_bytes, max(peaks)],
                                dtype=torch.float64, device=device)
            dist.all_reduce(sent, op=dist.ReduceOp.MAX)
            rows.append({
                "train": P.train, "rollout": P.rollout, "method": method, "seconds": float(med.item()),
                "max_link_bytes": float(sent[0].item()), "max_recv_bytes": float(sent[1].item()),
                "planned_max_recv_bytes": max(s.recv_bytes for s in modelled[base_method(method)]),
                "peak_extra_bytes": float(sent[2].item()), "collectives": st.collectives,
                "identical_to_first": int(flag.item()) == 0,
            })
            if rank == 0:
                print(f"  {method:<9} {float(med.item()) * 1e3:9.1f} ms", flush=True)
        if args.phases:
            phase_times(plan, rank, train, roll, device)  # warm-up
            ph = phase_times(plan, rank, train, roll, device)
            if rank == 0:
                print("  direct phases, serialised (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ph.items()),
                      flush=True)
        del train, roll, reference
        accelerator.empty_cache()
        # A bucket bounds a rank's send + receive volume, so a full bucket moves about half of
        # it each way: compare with an all_to_all_single of that per-rank size.
        # Best of two measurements, before any allocation and after this layout (the links'
        # bandwidth varies from run to run; the higher reference gives the lower fraction).
        same_size = [c["busbw"] for c in curve if int(c["mib_per_rank"] * (1 << 20)) == plan.bucket_bytes // 2]
        a2a = max(a2a_first[plan.bucket_bytes], *same_size,
                  a2a_busbw(plan.bucket_bytes // 2, dt, device, world, rank, 3 * args.repeats))
        for r in rows:
            if r["train"] is P.train and r["rollout"] is P.rollout:
                r["a2a_busbw"] = a2a
                r["busbw"] = r["max_link_bytes"] / r["seconds"]
                r["busbw_fraction"] = r["busbw"] / a2a
                r["a2a_peak_busbw"] = peak
                r["busbw_fraction_of_peak"] = r["busbw"] / peak
                r["ideal_seconds_at_peak"] = r["max_link_bytes"] / peak
                r["staged_busbw"] = staged[plan.bucket_bytes]["busbw"]
                r["busbw_fraction_of_staged"] = r["busbw"] / r["staged_busbw"]
    if rank == 0:
        info = accelerator.describe()
        print(f"\ndevice {info.get('device_name', 'cpu')} x{world}, backend {backend}, torch {torch.__version__}, "
              f"bucket {plans[0].bucket_bytes / (1 << 20):g} MiB, {plans[0].dtype}, "
              f"layers {plans[0].placements.model.num_layers}, experts {plans[0].placements.model.n_routed_experts}, "
              f"hidden {plans[0].placements.model.hidden_size}")
        print(f"{'train -> rollout':<44}{'method':<10}{'time ms':>9}{'vs direct':>10}{'recv GB':>9}"
              f"{'peak GB':>9}{'coll':>6}{'busbw GB/s':>11}{'of a2a':>8}{'of peak':>8}{'of staged':>10}{'same':>6}")
        for r in rows:
            d = next(x for x in rows if x["train"] is r["train"] and x["rollout"] is r["rollout"]
                     and x["method"] == "direct")
            lay = (f"tp{r['train'].tp} pp{r['train'].pp} ep{r['train'].ep} -> "
                   f"tp{r['rollout'].tp} dp{r['rollout'].dp} x{r['rollout'].instances}")
            print(f"{lay:<44}{r['method']:<10}{r['seconds'] * 1e3:>9.1f}{r['seconds'] / d['seconds']:>9.2f}x"
                  f"{r['max_recv_bytes'] / 1e9:>9.3f}{r['peak_extra_bytes'] / 1e9:>9.3f}{r['collectives']:>6}"
                  f"{r['busbw'] / 1e9:>11.1f}{r['busbw_fraction']:>8.2f}{r['busbw_fraction_of_peak']:>8.2f}"
                  f"{r['busbw_fraction_of_staged']:>10.2f}"
                  f"{str(r['identical_to_first']):>6}")
        per = {p.bucket_bytes: r["a2a_busbw"] for p in plans for r in rows if r["train"] is p.placements.train}
        print(f"of a2a: over the all-to-all at the reshard's per-collective size (" +
              ", ".join(f"{b / 2 / (1 << 20):g} MiB per rank {v / 1e9:.1f} GB/s" for b, v in per.items()) +
              f", best of the curve's point and two more measurements); of peak: over the curve's best, "
              f"{peak / 1e9:.1f} GB/s at {max(curve, key=lambda c: c['busbw'])['mib_per_rank']:g} MiB per rank; of staged: "
              f"over the all-to-all at the per-collective size with a pack + unpack copy of its bytes beside it")
        if args.json_out:
            out = [dict(r, train=vars(r["train"]), rollout=vars(r["rollout"])) for r in rows]
            Path(args.json_out).write_text(json.dumps({"device": accelerator.describe(), "world": world,
                                                       "a2a_curve": curve, "a2a_peak_busbw": peak,
                                                       "rows": out}, indent=2, default=str))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    from verl_patches.base.schema import Integer, Number, Text
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", action="append", type=Text(), help="Megatron layout (repeat for several cases)")
    ap.add_argument("--rollout", action="append", type=Text(), help="vLLM layout, one per --train")
    ap.add_argument("--model", type=Text(), default=str(REPO / "configs/model/deepseek_v3.json"),
                    help="HF config whose sizes are used (default: DeepSeek-V3)")
    ap.add_argument("--layers", type=Integer(low=1), default=4, help="decoder layers (first one dense)")
    ap.add_argument("--experts", type=Integer(low=1), default=16, help="routed experts per MoE layer")
    ap.add_argument("--bucket-mb", type=Number(low=TOOL_BUCKET_MB_LOW, high=TOOL_BUCKET_MB_HIGH),
                    default=float(BUCKET_MB))
    ap.add_argument("--dtype", type=Text(), default="bfloat16")
    ap.add_argument("--methods", type=Text(), default="direct,upstream,alltoallv",
                    help="methods to time; direct@N runs direct with N buckets in flight (direct: 2)")
    ap.add_argument("--warmup", type=Integer(low=0), default=1)
    ap.add_argument("--repeats", type=Integer(low=1), default=5)
    ap.add_argument("--a2a-sizes-mb", type=Text(), default="16,32,64,128,256,512,1024,2048",
                    help="per-rank message sizes (MiB, comma-separated) of the all-to-all curve")
    ap.add_argument("--a2a-repeats", type=Integer(low=1), default=10, help="timed all-to-alls per size (median)")
    ap.add_argument("--phases", action="store_true", help="also time the direct method's phases one by one")
    ap.add_argument("--plan", type=Text(), help="load plans pickled by --save-plan instead of planning here")
    ap.add_argument("--save-plan", type=Text(), help="plan (metadata only), pickle to this file and exit")
    ap.add_argument("--json-out", type=Text(), help="write the result rows as JSON (rank 0)")
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    for m in args.methods:
        try:
            in_flight(m)
        except ValueError as e:
            ap.error(f"--methods {m!r}: {e}")
        if base_method(m) not in METHODS:
            ap.error(f"--methods {m!r}: expected one of {METHODS} (direct@N for N buckets in flight)")
    try:
        args.a2a_sizes_mb = [float(x) for x in args.a2a_sizes_mb.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--a2a-sizes-mb {args.a2a_sizes_mb!r}: give sizes in MiB separated by commas")
    if not args.a2a_sizes_mb or min(args.a2a_sizes_mb) <= 0:
        ap.error("--a2a-sizes-mb needs at least one size, each above 0")
    if args.a2a_repeats < 1:
        ap.error(f"--a2a-repeats must be at least 1, got {args.a2a_repeats}")
    if not args.plan:
        args.train = args.train or ["tp=1,pp=2,ep=1"]
        args.rollout = args.rollout or ["tp=2,dp=1"]
        if len(args.train) != len(args.rollout):
            ap.error("give one --rollout per --train")
    if args.save_plan:
        plans = make_plans(args)
        with open(args.save_plan, "wb") as f:
            pickle.dump(plans, f)
        for p in plans:
            print(f"{p.placements.train} -> {p.placements.rollout}: {len(p.buckets)} buckets, "
                  f"max recv {max(s.recv_bytes for s in p.ranks) / 1e9:.3f} GB")
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
