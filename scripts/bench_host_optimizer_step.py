#!/usr/bin/env python3
"""One HybridDeviceOptimizer step at a real per-GPU optimizer shard: the 128 x H100 layout's (5.75 B
parameters per GPU, docs/NVIDIA.md), with a node's host cores shared by its GPUs, one process per GPU.

    python scripts/bench_host_optimizer_step.py --procs 4 --threads 16     # 4 GPUs, 16 cores each
    python scripts/bench_host_optimizer_step.py --device cpu --params 0.001 --steps 2   # CI: the host part

Each process builds what megatron-core 0.12.1's get_megatron_optimizer builds for
optimizer_cpu_offload with offload fraction 1 and the precision-aware optimizer (the recipe's patch
verl.optim.cpu_offload): bf16 params on its GPU with fp32 gradients (``decoupled_grad``), and a
HybridDeviceOptimizer over them (torch AdamW, fused, on the host; fp32 masters, pinned grad and param
copies), pinned to its own --threads cores (os.sched_setaffinity) and torch threads. It times
opt.step() (the grads' device-to-host copy, Adam on the host, the params' host-to-device copy; the first
step builds Adam's state and is not timed) and, separately, the step's copies alone through the
optimizer's own buffers (fp32 grads down into its pinned grad copies, its fp32 host params up into the
bf16 device params); it reports the process's resident growth. The processes run at the same time, as a node's GPUs step together.

On the CPU (no device to offload from: the hybrid optimizer needs CUDA params) it times the host part
alone, torch's fused AdamW over fp32 host params of the same count, and says the hybrid step was not run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The option rules (verl_patches/base/schema.py, standard library only) from this checkout.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PARAMS_B = 64.3 * (1 << 30) / 12 / 1e9  # the H100 layout's optimizer shard: 64.3 GiB at 12 bytes


def _args(argv: list[str] | None) -> argparse.Namespace:
    from verl_patches.base.schema import Integer, Number, Text
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--params", type=Number(low=0, low_open=True, high=64), default=DEFAULT_PARAMS_B, help="billions of parameters per process")
    p.add_argument("--tensor-m", type=Number(low=0, low_open=True), default=256.0, help="millions of parameters per tensor")
    p.add_argument("--procs", type=Integer(low=1), default=1, help="processes at once, one per GPU")
    p.add_argument("--threads", type=Integer(low=1), default=16, help="host cores (and torch threads) per process")
    p.add_argument("--steps", type=Integer(low=1), default=3, help="timed steps (after one untimed)")
    p.add_argument("--json-out", type=Text(), default=None)
    p.add_argument("--worker", type=Integer(low=0), default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not 0 < a.params <= 64:
        p.error(f"--params must be in (0, 64] (billions), got {a.params}")
    if a.tensor_m <= 0 or a.procs < 1 or a.threads < 1 or a.steps < 1:
        p.error("--tensor-m must be positive, --procs, --threads and --steps at least 1")
    return a


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _sizes(total: int, per: int) -> list[int]:
    return [per] * (total // per) + ([total % per] if total % per else [])


def worker(a: argparse.Namespace, index: int) -> dict:
    import torch

    cores = os.sched_getaffinity(0)
    mine = sorted(cores)[index * a.threads:(index + 1) * a.threads] or sorted(cores)
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    n = int(a.params * 1e9)
    sizes = _sizes(n, int(a.tensor_m * 1e6))
    cuda = a.device == "cuda"
    out = {"index": index, "params": n, "tensors": len(sizes), "cores": len(mine)}
    rss0 = _rss()
    t_build = time.perf_counter()
    g = torch.Generator(device="cuda" if cuda else "cpu").manual_seed(index)
    if not cuda:
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in sizes]
        for q in params:
            q.grad = torch.randn(q.numel(), generator=g) * 1e-3
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8, fused=True)
        sync = (lambda: None)
    else:
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

        torch.cuda.set_device(0)
        params = []
        for s in sizes:
            q = torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).to(torch.bfloat16))
            q.decoupled_grad = torch.randn(s, device="cuda", generator=g) * 1e-3
            params.append(q)
        # megatron-core's arguments for Adam with optimizer_cpu_offload (get_megatron_optimizer), less the
        # GPU Adam's own flag bias_correction (torch's AdamW always corrects).
        opt = HybridDeviceOptimizer([{"params": params}], offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW,
                                    gpu_optimizer_cls=torch.optim.AdamW, overlap_cpu_optimizer_d2h_h2d=False,
                                    pin_cpu_grads=True, pin_cpu_params=True, param_update_in_fp32=True,
                                    lr=1e-4, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8, fused=True)
        sync = torch.cuda.synchronize
    sync()
    out["build_s"] = time.perf_counter() - t_build  # params, grads and the optimizer (its host copies)
    times = []
    for k in range(a.steps + 1):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        if k:
            times.append(time.perf_counter() - t0)
    out["step_s"] = times
    out["median_step_s"] = statistics.median(times)
    out["host_rss_growth_bytes"] = _rss() - rss0
    if cuda:
        # The step's copies alone, through the optimizer's own buffers: the fp32 grads down into its pinned
        # grad copies, its fp32 host params up into the bf16 device params (what its copy-back hook does).
        pairs = [(opt.cpu_copy_map_grad[c], c, q) for c, q in opt.cpu_copys_map_gpu_param.items()]
        d2h, h2d = [], []
        for _ in range(2):
            sync()
            t0 = time.perf_counter()
            for grad, _, q in pairs:
                grad.copy_(q.decoupled_grad, non_blocking=True)
            sync()
            t1 = time.perf_counter()
            for _, host, q in pairs:
                q.data.copy_(host.data, non_blocking=True)
            sync()
            d2h.append(t1 - t0)
            h2d.append(time.perf_counter() - t1)
        out["d2h_s"], out["h2d_s"] = min(d2h), min(h2d)
        out["device_allocated_bytes"] = torch.cuda.memory_allocated()
    return out


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.device == "auto":
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.worker is not None:
        print("RESULT " + json.dumps(worker(a, a.worker)), flush=True)
        return 0
    if a.device == "cuda":
        import torch

        if torch.cuda.device_count() < a.procs:
            raise SystemExit(f"--procs {a.procs}: only {torch.cuda.device_count()} GPUs here")
    cores = len(os.sched_getaffinity(0))
    if a.procs * a.threads > cores:
        raise SystemExit(f"--procs {a.procs} x --threads {a.threads} needs {a.procs * a.threads} cores, {cores} here")
    t0 = time.time()
    procs = []
    for i in range(a.procs):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i)) if a.device == "cuda" else dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, __file__, "--worker", str(i), "--device", a.device, "--params", str(a.params),
               "--tensor-m", str(a.tensor_m), "--threads", str(a.threads), "--steps", str(a.steps)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    rows = []
    for pr in procs:
        text, _ = pr.communicate()
        if pr.returncode:
            raise SystemExit(f"a worker failed (exit {pr.returncode}):\n{text[-2000:]}")
        rows.append(json.loads(next(line for line in text.splitlines() if line.startswith("RESULT "))[7:]))
    gib = 1 << 30
    worst = max(rows, key=lambda r: r["median_step_s"])
    res = {"device": a.device, "procs": a.procs, "threads": a.threads, "params_per_proc": worst["params"],
           "wall_s": time.time() - t0, "rows": rows, "median_step_s_max": worst["median_step_s"]}
    kind = "HybridDeviceOptimizer step" if a.device == "cuda" else "host AdamW step (fused, fp32)"
    print(f"{a.procs} process(es) x {worst['params'] / 1e9:.3f} B params, {a.threads} cores each: {kind} "
          f"median {min(r['median_step_s'] for r in rows):.3f}-{worst['median_step_s']:.3f} s over processes "
          f"(steps {', '.join(f'{t:.3f}' for t in worst['step_s'])} s on the slowest); host resident growth "
          f"{max(r['host_rss_growth_bytes'] for r in rows) / gib:.1f} GiB per process; built in "
          f"{max(r['build_s'] for r in rows):.1f} s")
    if a.device == "cuda":
        print(f"  the step's copies alone: grads down {max(r['d2h_s'] for r in rows):.3f} s, params up "
              f"{max(r['h2d_s'] for r in rows):.3f} s (slowest process); device holds "
              f"{max(r['device_allocated_bytes'] for r in rows) / gib:.1f} GiB")
    else:
        res["hybrid_not_run"] = "HybridDeviceOptimizer moves CUDA params to the host: it needs a GPU"
        print(f"  hybrid step not run: {res['hybrid_not_run']}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
