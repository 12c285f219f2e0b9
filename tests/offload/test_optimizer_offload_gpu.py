"""On a GPU: megatron-core 0.12.1's real DistributedOptimizer with its CPU offload (HybridDeviceOptimizer,
built through the recipe's patch verl.optim.cpu_offload) takes the same steps as the optimizer on the
device, on a small DeepSeek-V3-shaped model (MLA, dense and MoE layers, shared experts, sigmoid router),
with the recipe's switch loop offloading the training params and releasing the grads between steps
(verl_patches/rigs/testing/optimizer_offload.py). Skips without CUDA (CI has none): docs/benchmarks.md records
the runs on an H100.

The tolerance and why: ``rel_diff`` = ||d - d_device|| / ||d_device||, d the change of every fp32 master
since the start (verl_patches/rigs/testing/optimizer_offload.py). The host steps with torch's AdamW on the CPU,
the device with AdamW on the GPU: the same formula, rounded differently in fp32. After the first step both
started from the same params and data, so only that rounding differs: the bound is 1e-3, and the control
run (the same hybrid optimizer with a learning rate 10 % off, about 0.1) must fail it. From the second
step a master a rounding apart can round to another bf16 param and an MoE router can send a token to
another expert, so the runs drift apart by more than rounding; after N steps the hybrid must still be
closer to the device run than half of what the 10 % control drifts over the same steps.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (megatron-core's "
                                "HybridDeviceOptimizer offloads CUDA params; CI has no GPU)")

FIRST_STEP = 1e-3
STEPS = 6
LR = 1e-3


def _compare(rank: int, world: int) -> dict:
    from verl_patches.rigs.testing import optimizer_offload as oo

    oo.setup("cuda")
    cfg = oo.model_config()
    kw = dict(steps=STEPS, device="cuda")
    ref = oo.run_variant(cfg, fraction=None, lr=LR, **kw)
    runs = {"device_again": oo.run_variant(cfg, fraction=None, lr=LR, **kw),
            "host_1.0": oo.run_variant(cfg, fraction=1.0, lr=LR, **kw),
            "host_0.5": oo.run_variant(cfg, fraction=0.5, lr=LR, **kw),
            "host_1.0_overlap": oo.run_variant(cfg, fraction=1.0, lr=LR, overlap=True, **kw),
            "control_lr_1.1": oo.run_variant(cfg, fraction=1.0, lr=1.1 * LR, **kw)}
    out = {"device": oo.summary(ref),
           "numel": sum(m.numel() for m in ref["start"]),
           "ledger_host_1.0": runs["host_1.0"]["ledger"]}
    for name, r in runs.items():
        out[name] = {**oo.summary(r), "rel_diffs": oo.rel_diffs(r, ref), "equal_params": oo.equal_params(r, ref)}
    return out


@pytest.fixture(scope="module")
def res():
    from verl_patches.launch.local_ranks import run_distributed

    r = run_distributed(_compare, 1, backend="nccl", timeout=600)[0]
    for name in ("device_again", "host_1.0", "host_0.5", "host_1.0_overlap", "control_lr_1.1"):
        x = r[name]
        print(name, x["optimizer"], x["inner"], "rel_diffs=" + ",".join(f"{d:.2e}" for d in x["rel_diffs"]),
              f"equal={x['equal_params']:.5f}", f"losses={x['losses']}", f"grad_norms={x['grad_norms']}",
              f"step={x['median_step_s'] * 1e3:.1f}ms", f"opt={x['median_optimizer_s'] * 1e3:.1f}ms",
              f"opt_group={x['optimizer_group_bytes']}", f"host_opt={x['host_optimizer_bytes']}",
              f"peak={x['update_peak_allocated']}", f"rollout_dev={x['rollout_device_allocated']}")
    print(r["ledger_host_1.0"])
    return r


def test_the_hybrid_optimizer_is_megatron_cores_inside_its_optimizer(res):
    # megatron-core 0.12.1 returns a ChainedOptimizer over the DistributedOptimizer(s) of an MoE model; the
    # torch optimizer inside is AdamW on the device, megatron-core's HybridDeviceOptimizer with the offload.
    assert res["device"]["optimizer"] == "ChainedOptimizer" and not res["device"]["hybrid"]
    assert res["device"]["inner"] == ["AdamW"]
    for name in ("host_1.0", "host_0.5", "control_lr_1.1"):
        assert res[name]["optimizer"] == "ChainedOptimizer"
        assert res[name]["inner"] == ["HybridDeviceOptimizer"] and res[name]["hybrid"]


def test_the_host_optimizer_takes_the_device_optimizers_steps(res):
    import math

    assert all(math.isfinite(x) for x in res["device"]["losses"])
    assert res["device_again"]["rel_diffs"][0] <= FIRST_STEP  # the device against itself
    control = res["control_lr_1.1"]["rel_diffs"]
    for name in ("host_1.0", "host_0.5"):
        d = res[name]["rel_diffs"]
        assert len(d) == STEPS and d[0] <= FIRST_STEP, (name, d)
        assert d[-1] <= 0.5 * control[-1], (name, d, control)
        # Same params and data at the first step: its loss and gradient norm are the device run's.
        assert math.isclose(res[name]["losses"][0], res["device"]["losses"][0], rel_tol=1e-5)
        assert math.isclose(res[name]["grad_norms"][0], res["device"]["grad_norms"][0], rel_tol=1e-4)


def test_the_bound_catches_a_ten_percent_step_error(res):
    assert res["control_lr_1.1"]["rel_diffs"][0] > FIRST_STEP, res["control_lr_1.1"]["rel_diffs"]


def test_the_switch_moves_only_the_device_part(res):
    numel = res["numel"]
    dev, full, half = res["device"], res["host_1.0"], res["host_0.5"]
    # Device optimizer: fp32 masters and both moments (12 bytes a parameter) are the loop's to move.
    assert all(b >= 12 * numel for b in dev["optimizer_group_bytes"]), (dev["optimizer_group_bytes"], numel)
    # All on the host: no optimizer group, nothing of it moved; the host holds masters, moments, grad copies.
    assert full["optimizer_group_bytes"] == [0] * (STEPS - 1)
    assert full["host_optimizer_bytes"] >= 16 * numel, (full["host_optimizer_bytes"], numel)
    # Half: the device half is grouped (and moved), the rest on the host.
    assert all(0 < b < dev["optimizer_group_bytes"][0] for b in half["optimizer_group_bytes"])
    assert 0 < half["host_optimizer_bytes"] < full["host_optimizer_bytes"]
    # While the rollout runs the training side leaves nothing of params, grads or optimizer on the device,
    # and the hybrid optimizer adds nothing there that the loop does not see.
    for r in (dev, full, half):
        assert all(set(x.values()) == {0} for x in r["rollout_resident"]), r["rollout_resident"]
        assert max(r["rollout_device_allocated"]) <= max(dev["rollout_device_allocated"]) + (1 << 20), \
            (r["rollout_device_allocated"], dev["rollout_device_allocated"])
