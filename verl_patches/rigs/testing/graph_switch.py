"""Many train/rollout switches under a captured CUDA graph: a tiny DeepSeek-V3-shaped decode forward
(MLA with W_UK_T / W_UV, dense and MoE MLPs) reads the rollout weights, MLA's derived tensors and a
KV cache, driven by the real offload engine and switch schedule and the real weight sync.

Run as a child process (``python -m verl_patches.rigs.testing.graph_switch --mode stable|resize``): it
writes its JSON result to --json and leaves with os._exit, because torch_memory_saver reports a
late free and exits non-zero at interpreter shutdown. tests/offload/test_graph_switch_gpu.py runs
it; docs/benchmarks.md records the runs.

Every cycle: release -> training-phase allocations of varied sizes -> allocate -> reshard of new
values -> MLA redo -> replay every graph and run its forward eagerly. A cycle passes when each
replay == its eager forward bit for bit, every address a graph reads is the one it captured, and the
rollout weights are the expected shards. ``--mode resize`` is the storage-resize path (eager
mode's): it fails.

Several graphs (``--graph-sizes 1,2,4,8``): one decode graph per captured batch size, as vLLM captures
one CUDA graph per capture size and vLLM-Ascend one TorchAir graph per ``graph_batch_sizes`` entry,
all over the same weights, MLA tensors and KV cache (the same regions); each graph keeps its own
captured addresses, and each is replayed and compared every cycle.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from verl_patches.core.lock import REPO_ROOT
from verl_patches.base import accelerator
from verl_patches.base.schema import Integer, Text, refuse_renamed
from verl_patches.launch.local_ranks import free_port
from verl_patches.offload import (OffloadEngine, Region, TensorGroup, kv_cache_group, ours, reference_group,
    rollout_weights_group, train_params_group)
from verl_patches.offload.stable import stable_memory
from verl_patches.preflight.graph_check import GraphCheck
from verl_patches.reshard.values import expected_rollout_by_param, train_shards, update_in_place
from verl_patches.reshard.checksum import verify
from verl_patches.reshard.direct import prepare
from verl_patches.reshard.weight_sync import execute
from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
from verl_patches.reshard.model import ModelConfig
from verl_patches.reshard.placements import build_placements
from verl_patches.reshard.planner import build_plan
from verl_patches.rollout.mla import rewrite_in_place
import torch.distributed as dist

MODEL = REPO_ROOT / "configs" / "model" / "tiny_deepseek_v3.json"
BATCH = 4  # the decode batch of a single-graph run


class MLAImpl:
    """W_UK_T / W_UV derived from one layer's kv_b_proj as vLLM-Ascend derives them (contiguous
    copies; vLLM's CUDA MLA derives views of the weight instead, which stay current by themselves)."""

    def __init__(self, kv_b: torch.Tensor, heads: int, nope: int, v: int) -> None:
        self.kv_b, self.heads, self.nope, self.v = kv_b, heads, nope, v
        self.W_UK_T = self.W_UV = None
        self.recompute()

    def recompute(self) -> None:
        w = self.kv_b.t().reshape(self.kv_b.shape[1], self.heads, self.nope + self.v)
        uk, uv = w.split([self.nope, self.v], dim=-1)
        self.W_UV = uv.transpose(0, 1).contiguous()
        self.W_UK_T = uk.permute(1, 2, 0).contiguous()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class TinyDecoder:
    """One decode step of ``batch`` tokens, weights looked up by vLLM name at call time (no copies)."""

    def __init__(self, cfg: dict, roll: dict[str, torch.Tensor], impls: list[MLAImpl], kv: torch.Tensor,
                 batch: int = BATCH) -> None:
        self.cfg, self.roll, self.impls, self.kv, self.batch = cfg, roll, impls, kv, batch
        dev = kv.device
        self.tokens = torch.arange(7, 7 + 13 * batch, 13, device=dev) % cfg["vocab_size"]
        self.slots = torch.arange(batch, device=dev) * 97 + 5

    def __call__(self) -> torch.Tensor:
        c, r, b = self.cfg, self.roll, self.batch
        nh = c["num_attention_heads"]
        nope, rope, vd, lora = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        x = r["model.embed_tokens.weight"][self.tokens]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = _rms(x, r[p + "input_layernorm.weight"])
            q = _rms(h @ r[p + "self_attn.q_a_proj.weight"].t(), r[p + "self_attn.q_a_layernorm.weight"])
            q = (q @ r[p + "self_attn.q_b_proj.weight"].t()).view(b, nh, nope + rope)
            ckv = h @ r[p + "self_attn.kv_a_proj_with_mqa.weight"].t()
            lat = _rms(ckv[:, :lora], r[p + "self_attn.kv_a_layernorm.weight"])
            self.kv[i, self.slots] = torch.cat([lat, ckv[:, lora:]], dim=-1)  # the decode step's cache write
            cache = self.kv[i]
            impl = self.impls[i]
            ql = torch.bmm(q[..., :nope].transpose(0, 1), impl.W_UK_T)  # (nh, B, lora): absorbed W_UK
            scores = ql @ cache[:, :lora].t() + q[..., nope:].transpose(0, 1) @ cache[:, lora:].t()
            attn = torch.softmax(scores.float() * (nope + rope) ** -0.5, dim=-1).to(x.dtype)
            o = torch.bmm(attn @ cache[:, :lora], impl.W_UV)  # (nh, B, v)
            x = x + o.transpose(0, 1).reshape(b, nh * vd) @ r[p + "self_attn.o_proj.weight"].t()
            h = _rms(x, r[p + "post_attention_layernorm.weight"])
            if p + "mlp.gate_up_proj.weight" in r:
                g, u = (h @ r[p + "mlp.gate_up_proj.weight"].t()).chunk(2, dim=-1)
                x = x + (F.silu(g) * u) @ r[p + "mlp.down_proj.weight"].t()
                continue
            # MoE as dense all-expert math with a top-k mask: no data-dependent shapes under capture.
            logits = (h @ r[p + "mlp.gate.weight"].t()).float()
            score = torch.sigmoid(logits)
            sel = (score + r[p + "mlp.gate.e_score_correction_bias"].float()).topk(c["num_experts_per_tok"], -1).indices
            weight = torch.zeros_like(score).scatter(1, sel, score.gather(1, sel))
            weight = weight / weight.sum(-1, keepdim=True) * c["routed_scaling_factor"]
            g, u = torch.einsum("bh,eih->bei", h, r[p + "mlp.experts.w13_weight"]).chunk(2, dim=-1)
            ye = torch.einsum("bei,ehi->beh", F.silu(g) * u, r[p + "mlp.experts.w2_weight"])
            gs, us = (h @ r[p + "mlp.shared_experts.gate_up_proj.weight"].t()).chunk(2, dim=-1)
            shared = (F.silu(gs) * us) @ r[p + "mlp.shared_experts.down_proj.weight"].t()
            x = x + torch.einsum("be,beh->bh", weight.to(x.dtype), ye) + shared
        return _rms(x, r["model.norm.weight"]) @ r["lm_head.weight"].t()


def _train_phase(rng: random.Random, keep: list, device: torch.device) -> int:
    """Allocations of varied sizes (64 KiB .. 48 MiB) as a training phase makes; about half stay
    alive until the next one. Returns the bytes allocated."""
    keep[:] = [t for t in keep if rng.random() < 0.5]
    total = 0
    for _ in range(rng.randint(4, 12)):
        n = rng.choice([1 << 16, 1 << 20, 3 << 20, 8 << 20, 20 << 20, 48 << 20]) + rng.randrange(0, 1 << 16, 512)
        t = torch.empty(n, dtype=torch.uint8, device=device).fill_(rng.randrange(256))
        total += n
        if rng.random() < 0.5:
            keep.append(t)
    return total


def run(mode: str, cycles: int, seed: int = 0, kv_mib: int = 64, graph_sizes: tuple[int, ...] = (BATCH,)) -> dict[str, Any]:
    cfg = json.loads(MODEL.read_text())
    device = accelerator.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    dtype = torch.bfloat16
    P = build_placements(ModelConfig.from_hf(cfg), TrainLayout.parse("tp=1,pp=1,ep=1"), RolloutLayout.parse("tp=1,dp=1"))
    plan = build_plan(cfg, P.train, P.rollout, dtype="bfloat16", placements=P)
    prepare(plan, 0)
    backend = None
    if mode == "stable":
        backend, why = stable_memory()
        if backend is None:
            raise RuntimeError(f"no address-stable backend: {why}")
    weights_region = Region(backend, "graph_switch_weights") if backend else None
    kv_region = Region(backend, "graph_switch_kv") if backend else None

    def in_region(region, make):
        if region is None:
            return make()
        with region.region():
            return make()

    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    if not graph_sizes or any(b < 1 for b in graph_sizes) or len(set(graph_sizes)) != len(graph_sizes):
        raise ValueError(f"graph sizes must be distinct positive batch sizes, got {list(graph_sizes)}")
    slots = max(max(graph_sizes) * 97 + 8, (kv_mib << 20) // (layers * width * dtype.itemsize))
    # The engine's build: weights, then MLA's post-load step, then the KV cache, all in regions.
    roll = in_region(weights_region, lambda: {n: torch.zeros(s, dtype=dtype, device=device)
                                              for n, s in P.rollout_storage[0].items()})
    impls = in_region(weights_region, lambda: [
        MLAImpl(roll[f"model.layers.{i}.self_attn.kv_b_proj.weight"], heads, cfg["qk_nope_head_dim"],
                cfg["v_head_dim"]) for i in range(layers)])
    kv = in_region(kv_region, lambda: torch.zeros(layers, slots, width, dtype=dtype, device=device))

    def weights_watch() -> dict[str, torch.Tensor]:
        out = dict(roll)
        for i, impl in enumerate(impls):
            out[f"layers.{i}.impl.W_UK_T"], out[f"layers.{i}.impl.W_UV"] = impl.W_UK_T, impl.W_UV
        return out

    engine = OffloadEngine()
    params = train_shards(P, 0, seed=seed, step=0, dtype=dtype, device=device)
    grads = {n: torch.zeros_like(v) for n, v in params.items()}
    ref = {n: v.clone() for n, v in params.items()}
    watched = list(weights_watch().values())
    groups = {
        "train_params": train_params_group(engine, list(params.values())),
        "grads": TensorGroup(engine, "grads", list(grads.values()), zero_on_allocate=True),
        "ref_params": reference_group(engine, list(ref.values())),
        "rollout_weights": rollout_weights_group(engine, watched, region=weights_region,
                                                 watch=weights_watch if weights_region else None),
        "kv_cache": kv_cache_group(engine, [kv], region=kv_region, zero_on_allocate=True,
                                   watch=(lambda: {"kv": kv}) if kv_region else None),
    }
    # One graph per graph size, all over the same weights and KV cache (the same regions).
    checks = {b: GraphCheck(TinyDecoder(cfg, roll, impls, kv, b), lambda: {**weights_watch(), "kv": kv})
              for b in graph_sizes}
    sched = ours(groups)
    rng, keep = random.Random(seed), []
    state: dict[str, Any] = {"step": 0, "last": None}
    records: list[dict[str, Any]] = []

    def reshard(_t, _r) -> None:
        execute(plan, 0, params, roll, method="direct")
        for impl in impls:
            rewrite_in_place(impl, impl.recompute)
        # The run's per-step proof (patch verl.sharding_manager.reshard): the weight fingerprint on the device.
        fp = verify(plan, 0, params, roll, step=state["step"])
        state.setdefault("fingerprint_s", []).append(fp.seconds)
        state["fingerprint_bytes"] = fp.bytes_read

    def generate() -> None:
        s = state["step"]
        now = {n: int(t.data_ptr()) for n, t in {**weights_watch(), "kv": kv}.items()}
        if any(c.graph is not None for c in checks.values()):  # counted before the replays, which may not survive
            state["moved_before_replay"] = sum(now[n] != c.addresses.get(n) for c in checks.values()
                                               if c.graph is not None for n in now)
        per = {b: c.check() for b, c in checks.items()}
        eager = torch.cat([r.pop("eager").flatten() for r in per.values()])
        res = {"equal": all(r["equal"] for r in per.values()),
               "moved": sorted({f"{n}@{b}" for b, r in per.items() for n in r["moved"]}),
               "elements_wrong": sum(max(r["elements_wrong"], 0) for r in per.values()),
               "unequal_graph_sizes": [b for b, r in per.items() if not r["equal"]],
               "captured": any(r["captured"] for r in per.values())}
        wrong = sum(int((roll[n] != w).sum()) for n, w in
                    expected_rollout_by_param(P, 0, seed=seed, step=s, dtype=dtype, device=device))
        changed = state["last"] is None or not torch.equal(eager, state["last"])
        state["last"] = eager.clone()
        res.update(cycle=s, weights_wrong=wrong, output_changed=bool(changed), moved=res["moved"][:8],
                   moved_count=len(res["moved"]), finite=bool(torch.isfinite(eager).all()))
        # The per-step address audit: what the groups compared since the previous generation.
        audited = groups["rollout_weights"].addresses_checked + groups["kv_cache"].addresses_checked
        res["addresses_checked"] = audited - state.get("audited", 0)
        state["audited"] = audited
        res["ok"] = res["equal"] and not res["moved"] and wrong == 0 and changed
        records.append(res)

    def train() -> None:
        state["step"] += 1
        state["train_bytes"] = state.get("train_bytes", 0) + _train_phase(rng, keep, device)
        update_in_place(P, 0, params, seed=seed, step=state["step"])

    hooks = {"reshard": reshard, "generate": generate, "ref_forward": lambda: None, "train": train}
    sched.prepare()
    freed: list[int] = []
    t0 = time.perf_counter()
    error = None
    try:
        for _ in range(cycles):
            for spec in sched.steps:
                if spec.name == "free_kv_cache":
                    accelerator.synchronize()
                    accelerator.empty_cache()
                    before = accelerator.mem_get_info()[0]
                sched.advance(**hooks)
                if spec.name == "release_rollout_weights":
                    accelerator.empty_cache()
                    freed.append(accelerator.mem_get_info()[0] - before)
    except Exception as e:  # noqa: BLE001 - reported: the resize path may fail by raising too
        error = f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - t0
    if weights_region is not None:  # map back before anything is freed at exit
        weights_region.allocate()
        kv_region.allocate()
    region_bytes = (backend.region_bytes(weights_region.tag) + backend.region_bytes(kv_region.tag)) if backend else None
    return {
        "mode": mode, "backend": backend.name if backend else None, "cycles": len(records), "seconds": seconds,
        "graph_sizes": list(graph_sizes), "graphs": sum(c.graph is not None for c in checks.values()),
        "replays": sum(c.checks for c in checks.values()),
        "ok_cycles": sum(r["ok"] for r in records), "failed_cycles": [r for r in records if not r["ok"]][:5],
        "failed_count": sum(not r["ok"] for r in records), "moved_cycles": sum(bool(r["moved_count"]) for r in records),
        "unequal_cycles": sum(not r["equal"] for r in records), "error": error,
        "moved_before_last_replay": state.get("moved_before_replay"), "watched": len(weights_watch()) + 1,
        "kv_bytes": kv.numel() * kv.element_size(), "region_bytes": region_bytes,
        "freed_bytes_min": min(freed) if freed else None, "freed_bytes_max": max(freed) if freed else None,
        "train_phase_bytes": state.get("train_bytes", 0), "device": accelerator.describe(),
        "fingerprint_checks": len(state.get("fingerprint_s", [])),
        "fingerprint_s_median": sorted(state["fingerprint_s"])[len(state["fingerprint_s"]) // 2]
        if state.get("fingerprint_s") else None, "fingerprint_bytes": state.get("fingerprint_bytes"),
        "addresses_checked_min": min((r["addresses_checked"] for r in records), default=None),
        "addresses_checked_max": max((r["addresses_checked"] for r in records), default=None),
    }


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("stable", "resize"), required=True)
    ap.add_argument("--cycles", type=Integer(low=1), default=100)
    ap.add_argument("--kv-mib", type=Integer(low=1), default=64)
    ap.add_argument("--graph-sizes", type=Text(), default=str(BATCH),
                    help="captured decode batch sizes, comma-separated: one graph each (default: %(default)s)")
    refuse_renamed(ap, {"--buckets": "--graph-sizes"})  # issue 38: graph sizes, not buckets
    ap.add_argument("--json", type=Text(), required=True)
    a = ap.parse_args(argv)
    try:
        graph_sizes = tuple(int(x) for x in a.graph_sizes.split(","))
        out = run(a.mode, a.cycles, kv_mib=a.kv_mib, graph_sizes=graph_sizes)
    except BaseException as e:  # noqa: BLE001 - the parent reads the reason from the file
        out = {"mode": a.mode, "error": f"{type(e).__name__}: {e}", "crashed": True}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch_memory_saver exits non-zero at interpreter shutdown (a late free)


if __name__ == "__main__":
    main(sys.argv[1:])
