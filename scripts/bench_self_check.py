#!/usr/bin/env python3
"""What the run's self-checks cost: the weight fingerprint (verl_patches/reshard/checksum.py), its
throughput on this device beside a plain copy (the memory-bandwidth reference) and its share of a switch
at the reference scale worked out on paper from the reshard plan's bytes; and what the rollout-vs-train
mismatch adds to an update (verl_patches/train/mismatch.py): the entropy pass over the logits, per GiB of
logits, and on paper per step at the reference scale.

    python scripts/bench_self_check.py                       # the device here, DeepSeek-V3 at 256 dies
    python scripts/bench_self_check.py --device cpu --gib 0.05 --repeats 3 \\
        --model configs/model/tiny_deepseek_v3.json --train tp=2,pp=2,ep=2,layers=3,1 --rollout tp=2,dp=2

Measured, on a bf16 tensor of --gib GiB (median of --repeats after one warm-up):
- copy: x.clone() (reads and writes every byte: the device's memory bandwidth, for scale);
- receive side: the checksum of a whole rollout parameter (tensor_checksum);
- send side: the checksum of a transposed box at its destination offsets (view_checksum on a
  [E, R, C] stack read through .transpose(1, 2), as Megatron's expert weights reach vLLM's).
Each side on the path the run takes here (the fused Triton kernel on CUDA, else torch) and on the torch
path (an NPU's); these must give the same integers (and the torch path's gather fallback too). Beside them,
both sides of the torch path as it was before the checksum moved to 2**32 (its own integers; timed only).
GiB/s counts the bf16 bytes checked. Paper: per rank, the fingerprint reads its rollout shard once
(receive rate) and each distinct box it sent once (send rate; checksum.checked_bytes); the largest
rank's time over --switch-s, the reference's published switch (17 s: 11.5 s reshard + 5.5 s offload,
docs/PERFORMANCE.md).

The mismatch: chunked_entropy (the overlay's, 1024 tokens a chunk, no autograd) over fp32 logits of
--entropy-tokens x --vocab-shard, with verl's vocab_parallel_entropy's arithmetic at tensor parallel 1
(its all-reduces are then no-ops; verl itself is not imported, so this runs on a device image without
verl), plus UpdateProbe.add on the same tokens. Paper: the last pipeline stage's tokens per step at
the reference (--step-tokens: 512 prompts x 16 x (77.8 + 1576.6) tokens / training DP 8) times the
vocabulary shard (129280 / TP 4), over the published update (319.3 s) and step (859.7 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_MODEL = "configs/model/deepseek_v3.json"
DEFAULT_TRAIN = "tp=4,pp=8,ep=8,layers=7,7,8,8,8,8,8,7"
DEFAULT_ROLLOUT = "tp=2,dp=128"


def _args(argv: list[str] | None) -> argparse.Namespace:
    from verl_patches.base.schema import Integer, Number, Text
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("cuda", "npu", "cpu", "auto"), help="cuda, npu, cpu or auto (the accelerator if any)")
    p.add_argument("--gib", type=Number(low=0, low_open=True, high=64), default=None, help="test tensor size in GiB (default 1 on a device, 0.25 on cpu)")
    p.add_argument("--repeats", type=Integer(low=1), default=5)
    p.add_argument("--model", type=Text(), default=DEFAULT_MODEL, help="HF config JSON for the paper share")
    p.add_argument("--train", type=Text(), default=DEFAULT_TRAIN)
    p.add_argument("--rollout", type=Text(), default=DEFAULT_ROLLOUT)
    p.add_argument("--switch-s", type=Number(low=0, low_open=True), default=17.0, help="the switch's seconds to compare with")
    p.add_argument("--entropy-tokens", type=Integer(low=1), default=8192, help="tokens of the timed entropy pass")
    p.add_argument("--vocab-shard", type=Integer(low=1), default=129280 // 4, help="vocabulary per tensor-parallel rank")
    p.add_argument("--step-tokens", type=Number(low=0, low_open=True), default=512 * 16 * (77.8 + 1576.6) / 8,
                   help="tokens the last pipeline stage of one training DP rank processes per step")
    p.add_argument("--json-out", type=Text(), default=None)
    a = p.parse_args(argv)
    if a.gib is not None and not 0 < a.gib <= 64:
        p.error(f"--gib must be in (0, 64], got {a.gib}")
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    if a.switch_s <= 0:
        p.error(f"--switch-s must be positive, got {a.switch_s}")
    for name in ("entropy_tokens", "vocab_shard"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if a.step_tokens <= 0:
        p.error(f"--step-tokens must be positive, got {a.step_tokens}")
    if not (ROOT / a.model).is_file() and not Path(a.model).is_file():
        p.error(f"--model {a.model}: no such file")
    return a


def _device(name: str):
    import torch

    from verl_patches.base import accelerator

    if name == "auto":
        return torch.device(accelerator.device_type() if accelerator.device_type() != "cpu" else "cpu")
    return torch.device(name)


def _timed(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- the torch path as it was before the checksum moved to 2**32 (issue 37): timed beside the new one ----
# Its definition: C = sum bits_i * (K[i mod 2**22] + c(i div 2**22)) mod (2**31 - 1), K in [1, 2**15] from the
# same seed, c(q) = (q * 40503 + 7) & 0x7FFF; int64 sums (torch's sum(dtype=int64) of int32 writes an int64
# copy first) and, on the send side, an int32 index per element and two gathers. Kept only here, to time it.
_PREV_MOD = (1 << 31) - 1
_PREV_TABLES: dict = {}


def _previous_table(device):
    import torch

    from verl_patches.reshard.checksum import CHUNK

    if str(device) not in _PREV_TABLES:
        g = torch.Generator().manual_seed(0x5EED)
        _PREV_TABLES[str(device)] = torch.randint(1, (1 << 15) + 1, (CHUNK,), generator=g, dtype=torch.int32).to(device)
    return _PREV_TABLES[str(device)]


def _previous_chunk_key(q):
    return (q * 40503 + 7) & 0x7FFF


def _previous_receive(t):
    """The previous receive side (2-byte values): int32 products added in pairs, then an int64 sum."""
    import torch

    from verl_patches.reshard.checksum import BLOCK, CHUNK

    flat = t.reshape(-1)
    table = _previous_table(t.device)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    per, full = BLOCK // CHUNK, flat.numel() // CHUNK
    for q0 in range(0, full, per):
        q1 = min(full, q0 + per)
        bits = flat[q0 * CHUNK:q1 * CHUNK].view(torch.int16).view(q1 - q0, CHUNK)
        prod = bits * table
        rows = (prod[:, 0::2] + prod[:, 1::2]).sum(dim=1, dtype=torch.int64)
        groups = bits.view(q1 - q0, CHUNK // (1 << 15), 1 << 15)
        sums = groups.sum(dim=2, dtype=torch.int32).sum(dim=1, dtype=torch.int64)
        qs = torch.arange(q0, q1, dtype=torch.int64, device=t.device)
        total = torch.remainder(total + (rows + _previous_chunk_key(qs) * sums).sum(), _PREV_MOD)
    if full * CHUNK < flat.numel():
        bits = flat[full * CHUNK:].view(torch.int16)
        part = (bits * table[:bits.numel()]).sum(dtype=torch.int64) + \
            _previous_chunk_key(full) * bits.sum(dtype=torch.int64)
        total = torch.remainder(total + part, _PREV_MOD)
    return total


def _previous_send(values, dest):
    """The previous send side (2-byte values): per block of leading rows, each element's int32 destination
    index, its key gathered from the table and its chunk key from a 512-entry table, an int64 sum."""
    import math

    import torch

    from verl_patches.reshard.checksum import BLOCK, CHUNK

    device = values.device
    table = _previous_table(device)
    chunk_keys = _previous_chunk_key(torch.arange(512, dtype=torch.int32, device=device))
    total = torch.zeros((), dtype=torch.int64, device=device)
    rest = torch.zeros((), dtype=torch.int32, device=device)
    for d in range(1, values.dim()):
        shape = [1] * (values.dim() - 1)
        shape[d - 1] = values.shape[d]
        rest = rest + (torch.arange(values.shape[d], dtype=torch.int32, device=device) * dest.stride(d)).view(shape)
    rows = max(1, BLOCK // max(1, math.prod(values.shape[1:])))
    for a in range(0, values.shape[0], rows):
        b = min(values.shape[0], a + rows)
        lead = torch.arange(a, b, dtype=torch.int32, device=device) * dest.stride(0) + dest.storage_offset()
        index = lead.view([-1] + [1] * (values.dim() - 1)) + rest
        keys = table[index & (CHUNK - 1)]
        keys += chunk_keys[index >> 22]
        part = (values[a:b].view(torch.int16) * keys).sum(dtype=torch.int64)
        total = torch.remainder(total + part, _PREV_MOD)
    return total


def measure(device, gib: float, repeats: int) -> dict[str, float]:
    """GiB/s of each path; "receive"/"send" are the path the run takes on this device (auto: the fused
    kernel on CUDA where Triton is, else torch), "*_torch" the torch path (an NPU's), "*_previous" the
    torch path before the checksum moved to 2**32 (other integers: timed only). Every path's integer is
    checked against the torch path's."""
    import torch

    from verl_patches.base import accelerator
    from verl_patches.reshard.checksum import _use_fused, tensor_checksum, view_checksum

    sync = accelerator.synchronize if device.type != "cpu" else (lambda: None)
    cols = 2048
    rows = max(1, int(gib * (1 << 30) / 2 / cols / 8)) * 8
    x = torch.randn(rows, cols, device=device).to(torch.bfloat16)
    nbytes = x.numel() * 2
    stack = x.view(8, rows // 8, cols)
    meta = torch.empty(8, cols, rows // 8, device="meta")
    fused = _use_fused(x, "auto")
    out = {"bytes": float(nbytes), "fused": fused}
    variants = [("copy", lambda: x.clone()),
                ("receive", lambda: tensor_checksum(x)),
                ("send", lambda: view_checksum(stack.transpose(1, 2), meta)),
                ("receive_torch", lambda: tensor_checksum(x, impl="torch")),
                ("send_torch", lambda: view_checksum(stack.transpose(1, 2), meta, impl="torch"))]
    variants += [("receive_previous", lambda: _previous_receive(x)),
                 ("send_previous", lambda: _previous_send(stack.transpose(1, 2), meta))]
    for name, fn in variants:
        s = _timed(fn, repeats, sync)
        out[f"{name}_s"] = s
        out[f"{name}_gib_s"] = nbytes / s / (1 << 30)
    r_t, s_t = int(tensor_checksum(x, impl="torch")), int(view_checksum(stack.transpose(1, 2), meta, impl="torch"))
    out["same_integers"] = (int(tensor_checksum(x)) == r_t == int(tensor_checksum(x, impl="gather"))
                            and int(view_checksum(stack.transpose(1, 2), meta)) == s_t
                            == int(view_checksum(stack.transpose(1, 2), meta, impl="gather")))
    if not out["same_integers"]:
        raise SystemExit("weight fingerprint: the paths disagree on the same tensor")
    return out


def _entropy_tp1(logits):
    """verl 0.4.1's _VocabParallelEntropy.forward at tensor parallel 1 (its all-reduces are no-ops)."""
    m = logits.max(dim=-1, keepdim=True).values
    exp = (logits - m).exp()
    sum_exp = exp.sum(dim=-1, keepdim=True)
    return (m + sum_exp.log() - ((exp / sum_exp) * logits).sum(dim=-1, keepdim=True)).squeeze(-1)


def measure_mismatch(device, tokens: int, vocab: int, repeats: int) -> dict[str, float]:
    import torch

    from verl_patches.base import accelerator
    from verl_patches.train.mismatch import UpdateProbe, chunked_entropy

    sync = accelerator.synchronize if device.type != "cpu" else (lambda: None)
    logits = torch.randn(tokens, vocab, device=device, dtype=torch.float32)
    rows = max(1, tokens // 1024)
    lp = torch.randn(rows, tokens // rows, device=device).clamp(max=0)
    mask = torch.ones_like(lp, dtype=torch.bool)

    def probe():
        p = UpdateProbe(compare=True, loss_agg_mode="token-mean")
        p.add(lp, mask, lp.abs(), rollout_log_prob=lp + 1e-3)
        return p.local_stats()

    ent_s = _timed(lambda: chunked_entropy(logits, _entropy_tp1), repeats, sync)
    probe_s = _timed(probe, repeats, sync)
    nbytes = logits.numel() * 4
    return {"logits_bytes": float(nbytes), "entropy_s": ent_s, "entropy_gib_s": nbytes / ent_s / (1 << 30),
            "probe_s": probe_s, "tokens": float(tokens)}


def paper(model: str, train: str, rollout: str, rates: dict[str, float], switch_s: float,
          path: str = "") -> dict[str, float]:
    """The busiest rank's check at these rates (``path``: "" for the run's path, "_torch"): its rollout
    shard at the receive rate plus the training values it sums as a sender (each distinct box and
    destination once, local copies included: checksum.checked_bytes) at the send rate."""
    from verl_patches.reshard.checksum import checked_bytes
    from verl_patches.reshard.planner import build_plan

    p = ROOT / model if (ROOT / model).is_file() else Path(model)
    plan = build_plan(str(p), train, rollout)
    checked = [checked_bytes(plan, r) for r in range(len(plan.ranks))]
    return _share(plan, checked, rates, switch_s, path)


def _share(plan, checked, rates, switch_s, path=""):
    gib = 1 << 30
    per_rank = [sh / gib / rates[f"receive{path}_gib_s"] + se / gib / rates[f"send{path}_gib_s"] for sh, se in checked]
    worst = max(range(len(per_rank)), key=per_rank.__getitem__)
    r = plan.ranks[worst]
    return {"ranks": len(plan.ranks), "rank": worst, "shard_gb": checked[worst][0] / 1e9,
            "sent_gb": r.sent_bytes / 1e9, "checked_sent_gb": checked[worst][1] / 1e9,
            "fingerprint_s": per_rank[worst], "switch_s": switch_s, "share": per_rank[worst] / switch_s}


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    device = _device(a.device)
    gib = a.gib if a.gib is not None else (0.25 if device.type == "cpu" else 1.0)
    m = measure(device, gib, a.repeats)
    print(f"device {device}: {m['bytes'] / (1 << 30):.3f} GiB bf16, median of {a.repeats}; the run's path here: "
          f"{'fused Triton kernel' if m['fused'] else 'torch'}; every path gives the same integers: {m['same_integers']}")
    for name in ("copy", "receive", "send", "receive_torch", "send_torch", "receive_previous", "send_previous"):
        print(f"  {name:17s} {m[name + '_s'] * 1e3:9.2f} ms  {m[name + '_gib_s']:8.1f} GiB/s")
    from verl_patches.reshard.checksum import checked_bytes
    from verl_patches.reshard.planner import build_plan

    path = ROOT / a.model if (ROOT / a.model).is_file() else Path(a.model)
    plan = build_plan(str(path), a.train, a.rollout)
    checked = [checked_bytes(plan, r) for r in range(len(plan.ranks))]
    p = _share(plan, checked, m, a.switch_s)
    pt = _share(plan, checked, m, a.switch_s, "_torch")
    pp = _share(plan, checked, m, a.switch_s, "_previous")
    for label, q in (("the run's path", p), ("torch path", pt), ("previous torch path", pp)):
        print(f"paper ({label}): {a.model} train {a.train} -> rollout {a.rollout} ({q['ranks']} ranks): the busiest "
              f"rank ({q['rank']}) checks its {q['shard_gb']:.2f} GB shard and {q['checked_sent_gb']:.2f} GB of "
              f"distinct sent boxes (of {q['sent_gb']:.2f} GB sent) in {q['fingerprint_s']:.3f} s = "
              f"{100 * q['share']:.2f}% of a {a.switch_s:g} s switch")
    e = measure_mismatch(device, a.entropy_tokens, a.vocab_shard, a.repeats)
    step_bytes = a.step_tokens * a.vocab_shard * 4
    e["paper_entropy_s"] = step_bytes / (1 << 30) / e["entropy_gib_s"]
    e["paper_probe_s"] = e["probe_s"] * a.step_tokens / a.entropy_tokens
    print(f"mismatch: entropy over {a.entropy_tokens} x {a.vocab_shard} fp32 logits {e['entropy_s'] * 1e3:.2f} ms "
          f"({e['entropy_gib_s']:.1f} GiB/s), the probe's comparison {e['probe_s'] * 1e3:.3f} ms")
    print(f"paper: {a.step_tokens:.0f} tokens x {a.vocab_shard} logits per step on the last stage: entropy "
          f"{e['paper_entropy_s']:.2f} s + comparison {e['paper_probe_s']:.3f} s = "
          f"{100 * (e['paper_entropy_s'] + e['paper_probe_s']) / 319.3:.2f}% of the 319.3 s update, "
          f"{100 * (e['paper_entropy_s'] + e['paper_probe_s']) / 859.7:.2f}% of the 859.7 s step")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"device": str(device), "measured": m, "paper": p, "paper_torch": pt,
                                                "paper_previous": pp,
                                                "mismatch": e},
                                               indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
