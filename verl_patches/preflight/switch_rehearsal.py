"""One rank's rehearsal of the train/rollout switch: our schedule and engines on real process
groups, with every rollout byte checked against the seeded ground truth after each reshard.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from verl_patches.base import accelerator
from verl_patches.config.settings import BUCKET_MB
from verl_patches.offload import (OffloadEngine, TensorGroup, kv_cache_group, ours, reference_group,
    rollout_weights_group, train_params_group, Region)
from verl_patches.offload.stable import stable_memory, install_hint
from verl_patches.reshard.values import expected_rollout_by_param, train_shards, update_in_place
from verl_patches.reshard.direct import prepare
from verl_patches.reshard.weight_sync import execute
from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
from verl_patches.reshard.model import ModelConfig
from verl_patches.reshard.placements import build_placements
from verl_patches.reshard.planner import build_plan
from verl_patches.reshard.shards import torch_dtype
from verl_patches.preflight.graph_check import GraphCheck


@dataclass(frozen=True)
class Options:
    model: dict[str, Any]  # HF config.json contents
    train: str
    rollout: str
    methods: tuple[str, ...]
    steps: int = 2
    seed: int = 0
    dtype: str = "bfloat16"
    bucket_mb: float = float(BUCKET_MB)  # the reshard's transfer bucket: the run's default
    copy_chunk_mb: float = 64.0  # the offload engine's copy chunk
    kv_mb: float = 16.0
    corrupt: tuple[int, str, str] | None = None  # (rank, vLLM parameter, method): fault injection
    gather_shards: bool = False  # send the shards to rank 0 (logit check, dump); small models only
    graph_check: bool = False  # CUDA: rollout weights + KV cache in address-stable regions, a graph replayed per switch


@dataclass
class MethodResult:
    steps: list[dict[str, Any]] = field(default_factory=list)  # per step: exec stats
    phase_seconds: dict[str, float] = field(default_factory=dict)  # mean over iterations
    ledger_peak: int = 0
    ledger_peak_step: str | None = None
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    graph_replays: int = 0


def _settle() -> None:
    """Wait for all device work, drop unreachable Python objects (finished collective work
    objects still holding buffers), and let the allocator process frees deferred by
    record_stream (side-stream copies), so memory_allocated counts live tensors only."""
    gc.collect()
    accelerator.synchronize()
    accelerator.empty_cache()


def host_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _compare(rank: int, method: str, step: int, got: dict[str, torch.Tensor],
             want) -> list[dict[str, Any]]:
    bad = []
    for name, w in want:
        g = got[name]
        if g.shape != w.shape or g.dtype != w.dtype or not torch.equal(g, w):
            diff = (g != w) if g.shape == w.shape else None
            first = int(diff.reshape(-1).nonzero()[0]) if diff is not None and diff.any() else -1
            bad.append({"rank": rank, "method": method, "step": step, "param": name,
                        "elements_wrong": int(diff.sum()) if diff is not None else -1, "first_flat_index": first})
    return bad


def _byte_sums(tensors: dict[str, torch.Tensor], kv: torch.Tensor) -> torch.Tensor:
    """The rehearsal's stand-in for a rollout forward: it reads every rollout tensor (a byte sum each,
    exact in any order) and writes then reads a slice of the KV cache, as a decode step does."""
    sums = [t.view(torch.uint8).sum(dtype=torch.int64) for t in tensors.values()]
    first = next(iter(tensors.values())).reshape(-1)
    n = min(first.numel(), kv.numel())
    kv.reshape(-1)[:n].copy_(first[:n])
    return torch.stack(sums + [kv.reshape(-1)[:n].view(torch.uint8).sum(dtype=torch.int64)])


def _regions(opts: Options, method: str):
    """(weights region, KV region) for --graph-check, else (None, None)."""
    if not opts.graph_check:
        return None, None

    if accelerator.device_type() != "cuda":
        raise ValueError(f"--graph-check captures CUDA graphs; this rank's device is {accelerator.device_type()!r}")
    backend, why = stable_memory()
    if backend is None:
        raise ValueError(f"--graph-check needs an address-stable allocator: {why}; install {install_hint('cuda')}")
    return Region(backend, f"preflight_{method}_weights"), Region(backend, f"preflight_{method}_kv")


def _in(region, make):
    if region is None:
        return make()
    with region.region():
        return make()


def rehearse(rank: int, world: int, opts: Options) -> dict[str, Any]:
    """Run ``opts.steps`` switch iterations per method on this rank; return what it saw."""
    device = accelerator.current_device()
    dtype = torch_dtype(opts.dtype)
    P = build_placements(ModelConfig.from_hf(opts.model), TrainLayout.parse(opts.train),
                         RolloutLayout.parse(opts.rollout))
    if P.world != world:
        raise ValueError(f"the rollout layout {opts.rollout!r} covers {P.world} ranks but {world} processes run")
    plan = build_plan(opts.model, P.train, P.rollout, bucket_bytes=int(opts.bucket_mb * (1 << 20)),
                      dtype=opts.dtype, placements=P)
    # Plan once per run, as a real job does: the per-rank program is built before any timing.
    prepare(plan, rank)
    out: dict[str, Any] = {"rank": rank, "methods": {}, "memory": {}}
    kv_elems = max(1, int(opts.kv_mb * (1 << 20)) // dtype.itemsize)

    for method in opts.methods:
        res = MethodResult()
        engine = OffloadEngine(chunk_bytes=int(opts.copy_chunk_mb * (1 << 20)))
        params = train_shards(P, rank, seed=opts.seed, step=0, dtype=dtype, device=device)
        grads = {n: torch.zeros_like(v) for n, v in params.items()}
        ref = {n: v.clone() for n, v in params.items()}  # the reference model is the initial policy
        wr, kr = _regions(opts, method)
        rollout = _in(wr, lambda: {n: torch.empty(s, dtype=dtype, device=device)
                                   for n, s in P.rollout_storage[rank].items()})
        kv = _in(kr, lambda: [torch.empty(kv_elems, dtype=dtype, device=device)])
        graph = None
        if opts.graph_check:
            graph = GraphCheck(lambda: _byte_sums(rollout, kv[0]), lambda: {**rollout, "kv_cache": kv[0]})
        groups = {
            "train_params": train_params_group(engine, list(params.values())),
            # Gradients: released after the update and re-allocated zeroed before it.
            "grads": TensorGroup(engine, "grads", list(grads.values()), zero_on_allocate=True),
            "ref_params": reference_group(engine, list(ref.values())),
            "rollout_weights": rollout_weights_group(engine, list(rollout.values()), region=wr,
                                                     watch=(lambda: dict(rollout)) if wr else None),
            "kv_cache": kv_cache_group(engine, kv, region=kr, watch=(lambda: {"kv_cache": kv[0]}) if kr else None),
        }
        sched = ours(groups)
        sched.prepare()
        step_box = {"step": 0}

        def reshard(_train_group, _rollout_group) -> None:
            s = step_box["step"]
            # Every rank arrives first: the previous phases' host work differs per rank, and a
            # collective started early would count the others' lateness as its own time.
            dist.barrier()
            accelerator.synchronize()
            t0 = time.perf_counter()
            st = execute(plan, rank, params, rollout, method=method)
            accelerator.synchronize()
            seconds = time.perf_counter() - t0
            res.steps.append({"step": s, "recv_bytes": st.recv_bytes, "sent_bytes": st.sent_bytes,
                              "local_bytes": st.local_bytes, "collectives": st.collectives,
                              "peak_extra_bytes": st.peak_extra_bytes, "seconds": seconds})

        def check() -> None:
            # Runs as the (simulated) generation, while the rollout weights are resident, so the
            # reshard phase's time is the reshard's own.
            s = step_box["step"]
            if opts.corrupt and opts.corrupt[0] == rank and opts.corrupt[2] == method:
                # Fault injection (tests): one element of one received parameter changes.
                flat = rollout[opts.corrupt[1]].view(-1)
                flat[0] = flat[0] + 1
            want = expected_rollout_by_param(P, rank, seed=opts.seed, step=s, dtype=dtype, device=device)
            res.mismatches.extend(_compare(rank, method, s, rollout, want))
            if graph is not None:
                g = graph.check()  # captured at the first switch, replayed at every later one
                if not g["equal"] or g["moved"]:
                    res.mismatches.append({"rank": rank, "method": method, "step": s, "param": "<graph replay>",
                                           "elements_wrong": g["elements_wrong"], "first_flat_index": -1,
                                           "moved": g["moved"][:8]})
            if gather(s):
                # The last switch of the first method (every method's shards were just checked
                # equal to the same ground truth), for the logit check and the dump.
                out.setdefault("shards", {})[method] = {
                    "step": s, "rollout": {n: v.detach().to("cpu", copy=True) for n, v in rollout.items()}}

        def gather(s: int) -> bool:
            return bool(opts.gather_shards) and s == opts.steps - 1 and method == opts.methods[0]

        def train() -> None:
            if gather(step_box["step"]):
                # The training side of that switch: the params are resident again and not yet updated.
                out["shards"][method]["train"] = {n: v.detach().to("cpu", copy=True) for n, v in params.items()}
            # The simulated update: new parameter values, so the next reshard must move them.
            step_box["step"] += 1
            update_in_place(P, rank, params, seed=opts.seed, step=step_box["step"])

        hooks = {"reshard": reshard, "generate": check, "ref_forward": lambda: None, "train": train}
        for it in range(opts.steps):
            for _ in sched.steps:
                e = sched.advance(**hooks)
                if rank == 0:  # one progress line per phase
                    print(f"[preflight] {method:<8} step {it} {e.step:<24} {e.seconds:8.4f} s  "
                          f"resident on rank 0: {e.total / (1 << 20):9.2f} MiB", flush=True)
            if it == 0:
                _settle()
                out["memory"].setdefault(method, {})["after_first"] = {
                    "device_allocated": accelerator.memory_allocated(), "host_rss": host_rss(),
                    "host_pool_bytes": engine.pool.reserved_bytes, "host_allocations": engine.pool.allocations}
        _settle()
        out["memory"][method]["after_last"] = {
            "device_allocated": accelerator.memory_allocated(), "host_rss": host_rss(),
            "host_pool_bytes": engine.pool.reserved_bytes, "host_allocations": engine.pool.allocations}
        n_iter = max(1, opts.steps)
        totals: dict[str, float] = {}
        for e in sched.ledger.entries:
            totals[e.step] = totals.get(e.step, 0.0) + e.seconds
        res.phase_seconds = {k: v / n_iter for k, v in totals.items()}
        res.ledger_peak = sched.ledger.peak_bytes
        res.ledger_peak_step = sched.ledger.peak_step
        if graph is not None:
            res.graph_replays = graph.checks
            groups["rollout_weights"].allocate()  # regions mapped again before their tensors are freed
            groups["kv_cache"].allocate()
        for g in groups.values():
            g.close()
        out["methods"][method] = res.__dict__
        dist.barrier()
    return out
