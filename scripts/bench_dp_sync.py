#!/usr/bin/env python3
"""vLLM's per-step DP agreement on the gloo group (upstream) and on the device group (the recipe), checked and timed.

    torchrun --nproc-per-node 4 scripts/bench_dp_sync.py                 # 4 GPUs: gloo against NCCL
    torchrun --nproc-per-node 2 scripts/bench_dp_sync.py --device cpu --steps 20 --warmup 2   # CI

Every decode step with DP > 1, vLLM's ranks agree on three things (docs/RECIPE.md item 6): whether any
rank is unfinished (``ParallelConfig.has_unfinished_dp``, a MAX all-reduce), every rank's token count
(``DPMetadata.num_tokens_across_dp``, a SUM of a one-hot vector; vLLM-Ascend's model runner agrees on padded
counts, prefill and dual-batch overlap in one SUM instead). Upstream runs them on the DP coordinator's gloo
group with CPU tensors; with ``recipe.dp_sync_on_device`` the recipe's patches run the same collectives on its
device group (``verl_patches/rollout/dp_sync.py``: ``any_unfinished``, ``tokens_across_dp``, ``agree_forward``).

This script calls those three functions, each step, once on a gloo group with the CPU (upstream's group and
tensors) and once on the device group with the device, in the same processes. Each rank draws every rank's
inputs from a seed shared by all ranks, so it knows what every answer must be: a wrong one stops the run,
naming the path, the step, the rank and the call. Where vLLM imports, its own ``has_unfinished_dp`` (the
upstream code the patch wraps) runs on the gloo group too. Each call is timed on the host, from the call to
its answer there (the device path includes its copies to and from the device); the table gives the median and
the 90th percentile over steps, the slowest rank's. On the CPU the device group is gloo as well: both rows are
gloo there, and only the checks mean something. ``VERL_PATCHES_PLATFORM=npu-rehearsal`` takes the Ascend path
(torch.npu, the hccl backend) on the NPU rehearsal platform's torch_npu stand-in, whose hccl is gloo.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

# The option rules (verl_patches/base/schema.py, standard library only) from this checkout.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CALLS = ("any_unfinished", "tokens_across_dp", "agree_forward")
TIMEOUT_S = 300  # a rank missing from a collective ends the run with torch's timeout error, not a silent wait


class AgreementError(RuntimeError):
    """A DP agreement returned something other than what every rank's inputs make it."""


def inputs(seed: int, step: int, world: int) -> list[dict]:
    """Every rank's inputs at ``step``, the same on every rank: tokens, padded tokens, unfinished, prefill,
    and whether the rank can run dual-batch overlap."""
    rng = random.Random(seed * 1_000_003 + step)
    out = []
    for _ in range(world):
        tokens = rng.randint(0, 8192)
        out.append({"tokens": tokens, "padded": -(-tokens // 8) * 8, "unfinished": rng.random() < 0.3,
                    "prefill": rng.random() < 0.2, "dbo": rng.random() < 0.9})
    return out


def expected(ins: list[dict]) -> dict:
    return {"any_unfinished": any(r["unfinished"] for r in ins),
            "tokens_across_dp": [r["tokens"] for r in ins],
            "agree_forward": ([r["padded"] for r in ins], [r["tokens"] for r in ins],
                              any(r["prefill"] for r in ins), all(r["dbo"] for r in ins))}


def check(path: str, step: int, rank: int, call: str, got, want) -> None:
    if got != want:
        raise AgreementError(f"{path}: step {step}, rank {rank}: {call} returned {got!r}, the ranks' inputs make "
                             f"{want!r}")


def _answers(fns, group, device, ins: list[dict], rank: int, world: int) -> tuple[dict, dict]:
    """The three calls on one group, each timed to its answer on the host."""
    mine = ins[rank]
    got, took = {}, {}
    t0 = time.perf_counter()
    got["any_unfinished"] = fns.any_unfinished(mine["unfinished"], group, device)
    t1 = time.perf_counter()
    got["tokens_across_dp"] = fns.tokens_across_dp(mine["tokens"], world, rank, group, device).tolist()
    t2 = time.perf_counter()
    a = fns.agree_forward(mine["padded"], mine["tokens"], mine["prefill"], mine["dbo"], world, rank, group, device)
    t3 = time.perf_counter()
    got["agree_forward"] = (a.padded_across_dp.tolist(), a.tokens_across_dp.tolist(), a.with_prefill, a.enable_dbo)
    took.update(any_unfinished=t1 - t0, tokens_across_dp=t2 - t1, agree_forward=t3 - t2)
    return got, took


def _vllm_has_unfinished():
    """vLLM's own ParallelConfig.has_unfinished_dp (the upstream the patch wraps), or the reason it is absent."""
    # The overlay's platform (vLLM refuses two platform plugins, and vLLM-Ascend's is installed beside it on CPU).
    os.environ.setdefault("VLLM_PLUGINS", "verl_patches")
    try:
        from vllm.config import ParallelConfig
    except Exception as e:  # noqa: BLE001 - absent or not importable here (the GPU image has no vLLM): say why
        return None, f"vllm not importable here ({type(e).__name__}: {str(e)[:120]})"
    return ParallelConfig.has_unfinished_dp, ""


def run(a: argparse.Namespace) -> int:
    if a.device == "cpu":
        os.environ["VERL_PATCHES_DEVICE"] = "cpu"  # read by the accelerator facade as it resolves the device
    import torch
    import torch.distributed as dist

    from verl_patches.rigs import npu_rehearsal
    from verl_patches.base import accelerator
    from verl_patches.rollout import dp_sync

    if npu_rehearsal.selected():
        # VERL_PATCHES_PLATFORM=npu-rehearsal: the Ascend path (torch.npu, the hccl backend) on the declared
        # torch_npu stand-in, whose hccl is gloo and whose device is the host: only the checks mean something.
        # Its "npu" tensors are host tensors through transfer_to_npu, which verl's NPU workers import too.
        npu_rehearsal.activate()
        import torch_npu.contrib.transfer_to_npu  # noqa: F401
    rank = int(os.environ.get("RANK", "0"))
    device = accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = accelerator.dist_backend()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    world = dist.get_world_size()
    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))  # vLLM's DP cpu_group
    paths = [("gloo, CPU tensors (upstream)", gloo, torch.device("cpu")),
             (f"{backend}, device tensors (recipe)", None, device)]
    # Every rank must take the same calls: vLLM's row runs only where it imports on every rank (one rank
    # running an extra all-reduce would hang the others), and the reasons of those where it does not are said.
    vllm_fn, vllm_absent = _vllm_has_unfinished()
    reasons = [None] * world
    dist.all_gather_object(reasons, vllm_absent, group=gloo)
    if any(reasons):
        vllm_fn = None
        vllm_absent = "; ".join(f"rank {r}: {why}" for r, why in enumerate(reasons) if why)
    times: dict[str, dict[str, list[float]]] = {p[0]: {c: [] for c in CALLS} for p in paths}
    vllm_times: list[float] = []
    for step in range(a.warmup + a.steps):
        ins = inputs(a.seed, step, world)
        want = expected(ins)
        for name, group, dev in paths:
            got, took = _answers(dp_sync, group, dev, ins, rank, world)
            for call in CALLS:
                check(name, step, rank, call, got[call], want[call])
                if step >= a.warmup:
                    times[name][call].append(took[call])
        if vllm_fn is not None:
            t0 = time.perf_counter()
            got = vllm_fn(gloo, ins[rank]["unfinished"])
            took = time.perf_counter() - t0
            check("vLLM's has_unfinished_dp on gloo", step, rank, "any_unfinished", got, want["any_unfinished"])
            if step >= a.warmup:
                vllm_times.append(took)
    mine = {name: {c: [statistics.median(v), _p90(v)] for c, v in per.items()} for name, per in times.items()}
    if vllm_times:
        mine["vLLM has_unfinished_dp, gloo (upstream code)"] = {"any_unfinished": [statistics.median(vllm_times),
                                                                                  _p90(vllm_times)]}
    every = [None] * world
    dist.all_gather_object(every, mine, group=gloo)
    if rank == 0:
        rows = []
        for name in mine:
            for call in mine[name]:
                med = max(r[name][call][0] for r in every)
                p90 = max(r[name][call][1] for r in every)
                rows.append({"path": name, "call": call, "median_ms": med * 1e3, "p90_ms": p90 * 1e3})
        desc = accelerator.describe()
        print(f"device {desc.get('device_name', desc['device_type'])} x{world}, backend {backend}, torch {torch.__version__}; "
              f"{a.steps} timed steps after {a.warmup}; every answer checked on every rank: True")
        print(f"{'path':<48}{'call':<18}{'median ms':>10}{'p90 ms':>9}")
        for r in rows:
            print(f"{r['path']:<48}{r['call']:<18}{r['median_ms']:>10.3f}{r['p90_ms']:>9.3f}")
        if vllm_absent:
            print(f"vLLM's own has_unfinished_dp not run: {vllm_absent}")
        print("times: the slowest rank's median and 90th percentile, from the call to its answer on the host")
        if a.json_out:
            Path(a.json_out).write_text(json.dumps({"device": desc, "world": world, "backend": backend,
                                                    "steps": a.steps, "warmup": a.warmup, "checked": True,
                                                    "vllm_not_run": vllm_absent, "rows": rows}, indent=2,
                                                   default=str))
    dist.barrier(group=gloo)  # every rank is past its last collective; main() ends the process (see there)
    return 0


def _p90(v: list[float]) -> float:
    return sorted(v)[min(len(v) - 1, int(0.9 * len(v)))]


def main(argv: list[str] | None = None) -> int:
    from verl_patches.base.schema import Integer, Text
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cpu"),
                   help="auto: the accelerator's device group (NCCL on CUDA, HCCL on NPU); cpu: gloo for both")
    p.add_argument("--steps", type=Integer(low=1), default=500, help="timed steps (each runs every call on both groups)")
    p.add_argument("--warmup", type=Integer(low=0), default=50, help="untimed steps first (still checked)")
    p.add_argument("--seed", type=Integer(low=0), default=0, help="the shared seed the ranks' inputs come from")
    p.add_argument("--json-out", type=Text(), default=None, help="write the rows as JSON (rank 0)")
    a = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("run it under torchrun (torchrun --nproc-per-node N scripts/bench_dp_sync.py): it needs a world")
    try:
        rc = run(a)
    except AgreementError as e:
        print(f"bench_dp_sync: {e}", file=sys.stderr)
        rc = 1
    # The process ends here, without destroying its process groups: torch 2.5.1's ProcessGroupGloo destructor
    # joins its worker threads with the GIL held, and a worker freeing a finished all-reduce whose tensor Python
    # had already dropped waits for the GIL: a deadlock, seen in CI as a run that printed its table and never
    # exited (about one run in seven on a loaded 2-core machine). Ranks past the final barrier need nothing more.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
