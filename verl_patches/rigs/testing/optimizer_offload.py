"""megatron-core's DistributedOptimizer with the optimizer on the device, and with megatron-core's own CPU
offload (HybridDeviceOptimizer, built through the recipe's patch verl.optim.cpu_offload), trained side by
side on a small DeepSeek-V3-shaped model (MLA, dense and MoE layers, shared experts, sigmoid router with
expert bias) through the recipe's switch loop: between steps the loop offloads the training params and
releases the grads as in a run (docs/DESIGN.md section 3) and brings them back for the update.

Used by tests/offload/test_optimizer_offload_gpu.py (the same steps on a GPU) and
scripts/bench_optimizer_offload.py (step time, device and host memory of each). One process, its own
one-rank process group.

What is compared: the fp32 master weights after each step, as the change they made from the start
(``masters_k - masters_0``), by ``rel_diff = ||d_variant - d_device|| / ||d_device||``, and the share of
bf16 params that are bit-equal at the end. Why not bit-exact: the host runs torch's AdamW on the CPU and
the device AdamW on the GPU; the same formula in fp32 rounds differently on the two. After the first step
(same params, same data, same gradients) that is all that differs; from the second step a master a
rounding apart can round to a different bf16 param, and an MoE router can then send a token to another
expert, so later steps drift apart by more than rounding (the device optimizer against a repeat of itself
shows how much the run repeats). A real fault shows at the first step already (a skipped step: 1.0; a
10 % wrong learning rate: about 0.1): the test runs such a control and requires it to fail the bound.
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from verl_patches.base import accelerator
from verl_patches.config.optim_offload import apply_offload, offload_settings
from verl_patches.core.apply import apply_all
from verl_patches.launch.local_ranks import free_port
from verl_patches.offload import HostBufferPool, OffloadEngine
from verl_patches.offload.live import LiveSwitch
from verl_patches.offload.megatron_memory import inner_optimizers, ActorMemory, host_optimizer_bytes, hybrid_optimizers
from verl_patches.patches import get_patch
from verl_patches.rigs.testing.live_models import build_megatron_deepseek
from verl_patches.rigs.testing.upstream_env import prepare_cpu_upstream
import torch.distributed as dist

TINY = Path(__file__).resolve().parents[3] / "configs" / "model" / "tiny_deepseek_v3.json"


class TorchCoreAttention(torch.nn.Module):
    """Causal softmax attention for megatron-core's MLA (q/k head dim differs from v's), in plain torch:
    the local spec's kernel is a parameter-free module, and this one needs no Transformer Engine."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        s, b = out.shape[2], out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def ensure_process_group(device: str) -> None:
    if dist.is_initialized():
        return

    port = free_port()
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def _cpu_stand_ins() -> None:
    """What megatron-core needs to build and step on the host (CPU platform only): its optimizers through
    the overlay's patch cpu.megatron.optimizer_on_host, and torch.cuda.current_device answering the host."""
    prepare_cpu_upstream()
    torch.cuda.current_device = lambda: "cpu"  # stand-in: megatron-core's DDP asks it for the buffer device
    apply_all([get_patch("cpu.megatron.optimizer_on_host")])


def host_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def model_config(path: Path | str = TINY, **overrides: Any) -> dict:
    cfg = json.loads(Path(path).read_text())
    cfg.update(overrides)
    return cfg


def build(cfg: dict, *, seed: int, lr: float, fraction: float | None, overlap: bool = False,
          device: str = "cuda"):
    """A bf16 DDP chunk (as verl's get_model wraps it) and its megatron-core optimizer; ``fraction``:
    None = the optimizer on the device (what verl builds), else optimizer_cpu_offload with that
    offload fraction, through the recipe patch's own config function."""
    # Lazy: megatron-core loads inside the rank, after the patches are applied.
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)  # megatron-core's CPU initialisation draws from it: every variant starts equal
    model = build_megatron_deepseek(cfg, torch.bfloat16, grouped=False, core_attention=TorchCoreAttention,
                                    config_overrides={"hidden_dropout": 0.0, "attention_dropout": 0.0})
    tc = model.config
    if device == "cuda":
        model = model.cuda()
    ddp = DDP(config=tc, module=Float16Module(tc, model), ddp_config=DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=True, grad_reduce_in_fp32=True))
    # verl 0.4.1's init_megatron_optim_config, field for field, then the patch's offload fields.
    config = OptimizerConfig(optimizer="adam", lr=lr, clip_grad=1.0, weight_decay=0.01, bf16=True,
                             params_dtype=torch.bfloat16, use_distributed_optimizer=True)
    if fraction is not None:
        settings = offload_settings({"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction,
                                     "overlap_cpu_optimizer_d2h_h2d": overlap})
        config = apply_offload(config, settings)
    return ddp, get_megatron_optimizer(config, [ddp])


def masters(opt) -> list[torch.Tensor]:
    """The fp32 master shards in the optimizer's order, on the host: the inner AdamW's params on the
    device; a HybridDeviceOptimizer's fp32 copies (host or device) of its bf16 shards."""
    out = []
    for o in inner_optimizers(opt):
        fp32 = getattr(o, "param_to_fp32_param", None)
        for g in o.param_groups:
            for p in g["params"]:
                m = fp32.get(p, p) if fp32 is not None else p
                out.append(m.detach().float().cpu().clone())
    return out


def run_variant(cfg: dict, *, steps: int, fraction: float | None, lr: float, overlap: bool = False,
                batch: int = 2, seq: int = 32, seed: int = 1234, device: str = "cuda",
                snapshots: bool = True) -> dict:
    """``steps`` updates of one variant through a fresh switch loop; its masters (after every step with
    ``snapshots``, else the last), params, times and memory (device figures relative to what was allocated
    before the variant was built)."""
    # Lazy: megatron-core loads inside the rank, after the patches are applied.
    import megatron.core.optimizer.distrib_optimizer as dopt

    # megatron-core 0.12.1's DistributedOptimizer calls Transformer Engine's FP8 cast on every step and
    # raises without TE (neither the GPU image nor the host has it); with no FP8 params there is nothing to
    # cast: the CPU platform's replacement (patch cpu.megatron.fp8_quantize_without_te) returns, and
    # raises if an FP8 param ever appears.
    dopt.quantize_param_shard = get_patch("cpu.megatron.fp8_quantize_without_te").load_replacement()
    cuda = device == "cuda"
    gc.collect()  # the previous variant's model and optimizer (megatron's objects hold reference cycles)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    alloc0 = torch.cuda.memory_allocated() if cuda else 0
    rss0 = host_rss_bytes()
    ddp, opt = build(cfg, seed=seed, lr=lr, fraction=fraction, overlap=overlap, device=device)
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed + 1)
    data = [torch.randint(0, cfg["vocab_size"], (batch, seq + 1), generator=gen).to(dev) for _ in range(steps)]
    pos = torch.arange(seq, device=dev).unsqueeze(0).expand(batch, -1)
    times: list[dict] = []
    grad_norms: list[float] = []
    trail: list[list[torch.Tensor]] = []
    peaks: list[int] = []

    def train(k: int) -> float:
        accelerator.synchronize()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        tokens = data[k]
        loss = ddp(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        accelerator.synchronize()
        t1 = time.perf_counter()
        ok, norm, _ = opt.step()
        accelerator.synchronize()
        t2 = time.perf_counter()
        if not ok:
            raise RuntimeError(f"optimizer step {k} was skipped (inf/nan grads)")
        times.append({"step_s": t2 - t0, "optimizer_s": t2 - t1})
        grad_norms.append(float(norm))
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated() - alloc0)
        if snapshots or k == steps - 1:
            trail.append(masters(opt))  # everything is on the device here, before the loop moves it
        return float(loss.detach())

    start = masters(opt)
    engine = OffloadEngine(pool=HostBufferPool(reserve_bytes=0)) if device == "cpu" else OffloadEngine()
    memory = ActorMemory([ddp], opt, engine=engine)
    switch = LiveSwitch()
    losses = [train(0)]  # Adam's state exists after the first step; then the memory joins the loop
    switch.attach(memory)  # where an update ends: grads released, the device optimizer state on host
    rollout_resident, rollout_allocated, opt_group = [], [], []
    for k in range(1, steps):
        switch.reach("offload_train_params")  # the rollout phase: what the training side leaves on device
        rollout_resident.append(memory.resident())
        rollout_allocated.append(torch.cuda.memory_allocated() - alloc0 if cuda else None)
        switch.reach("update_onload")
        opt_group.append(memory.groups()["optimizer"].nbytes if "optimizer" in memory.groups() else 0)
        losses.append(switch.call("update", lambda k=k: train(k)))
        switch.reach("update_end")
    out = {
        "fraction": fraction, "overlap": overlap, "lr": lr, "steps": steps,
        "optimizer": type(opt).__name__, "inner": [type(o).__name__ for o in inner_optimizers(opt)],
        "hybrid": bool(hybrid_optimizers(opt)),
        "losses": losses, "grad_norms": grad_norms, "times": times,
        "start": start, "trail": trail, "end": trail[-1],
        "optimizer_group_bytes": opt_group,
        "rollout_resident": rollout_resident, "rollout_device_allocated": rollout_allocated,
        "update_peak_allocated": max(peaks[1:] or peaks) if peaks else None,
        "host_optimizer_bytes": host_optimizer_bytes(opt),
        "host_pool_bytes": sum(g.host_nbytes for g in memory.groups().values()),
        "host_rss_growth_bytes": host_rss_bytes() - rss0,
        "ledger": switch.ledger.format_table(),
    }
    switch.detach(memory)
    memory.close()  # everything back on the device (the update's end left the optimizer state on host)
    out["params"] = [p.detach().cpu().clone() for p in ddp.parameters()]
    return out


def _delta(start: list[torch.Tensor], end: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(e - s).flatten() for s, e in zip(start, end)]).double()


def rel_diffs(a: dict, ref: dict) -> list[float]:
    """rel_diff after each step (both variants run with ``snapshots``)."""
    out = []
    for ea, er in zip(a["trail"], ref["trail"]):
        da, dr = _delta(a["start"], ea), _delta(ref["start"], er)
        out.append(float((da - dr).norm() / dr.norm()))
    return out


def rel_diff(a: dict, ref: dict) -> float:
    """||(end - start) of a - (end - start) of ref|| / ||(end - start) of ref|| over every master."""
    da, dr = _delta(a["start"], a["end"]), _delta(ref["start"], ref["end"])
    if da.shape != dr.shape:
        raise ValueError(f"the variants hold different master shapes: {da.shape} vs {dr.shape}")
    return float((da - dr).norm() / dr.norm())


def equal_params(a: dict, ref: dict) -> float:
    same = sum(int((x == y).sum()) for x, y in zip(a["params"], ref["params"]))
    return same / sum(x.numel() for x in ref["params"])


def summary(r: dict) -> dict:
    """The figures of a variant without its tensors (for JSON and the record)."""
    keep = {k: v for k, v in r.items() if k not in ("start", "end", "trail", "params", "ledger")}
    steady = r["times"][1:] or r["times"]  # the first step builds Adam's state
    keep["median_step_s"] = sorted(t["step_s"] for t in steady)[len(steady) // 2]
    keep["median_optimizer_s"] = sorted(t["optimizer_s"] for t in steady)[len(steady) // 2]
    return keep


def setup(device: str) -> None:
    """One rank's process group and megatron-core's parallel state (TP = PP = EP = 1)."""
    os.environ.setdefault("VERL_PATCHES_DEVICE", device)
    if device == "cuda":
        # One answer per run: cuBLAS and the MoE's scatter-adds in their deterministic forms (where torch
        # has one; warn_only leaves the rest), so the device run repeats itself and what differs between
        # two variants is the optimizer. Set before the first CUDA matmul creates cuBLAS's handle.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if device == "cpu":
        _cpu_stand_ins()
    ensure_process_group(device)
    # Lazy: megatron-core loads inside the rank, after the patches are applied.
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(1, 1)
    if device == "cuda":
        # Lazy: megatron-core loads inside the rank, after the patches are applied.
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1234)
