"""The switch schedule in verl 0.4.1's real Megatron worker bodies (docs/DESIGN.md section 3): a real
megatron-core 0.12.1 GPTModel in megatron-core's DDP on one gloo rank, driven through init_model,
load_checkpoint, generate_sequences, compute_log_prob, save_checkpoint, update_actor and
compute_ref_log_prob with all, none, and all-but-one of the overlay's patches; torch.compile restored for
building and running the rollout only. Stand-ins (the Megatron optimizer, which creates CUDA tensors;
the rollout engine; the sharding manager, which keeps the contract on the first step and not on the
second; MindSpeed's torch.compile replacement) are listed in megatron_worker_rank.py. All scenarios run
in one spawned process (megatron's parallel state is per process)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_worker_rank as mwr  # noqa: E402

from verl_patches.launch.local_ranks import run_distributed  # noqa: E402
from verl_patches.offload.schedule import our_steps  # noqa: E402

# Multi-process or Ray: the slow tier (README: fast tier = -m 'not slow').
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def res():
    out = run_distributed(mwr.run_all, 1, timeout=300,
                          env={"VERL_PATCHES_DEVICE": "cpu", "TORCHINDUCTOR_COMPILE_THREADS": "1"})[0]
    # Leaving one patch out may break a cycle outright; everywhere else an exception is a bug.
    failed = {k: v["exception"] for k, v in out.items()
              if isinstance(v, dict) and "exception" in v and ":-" not in k}
    assert not failed, "\n".join(f"--- {k}\n{v}" for k, v in failed.items())
    return out


def actor_problems(r: dict) -> list[str]:
    """What of the schedule does not hold in one actor cycle (empty: all of it holds)."""
    if "exception" in r:
        return ["the cycle raised: " + r["exception"].strip().splitlines()[-1]]
    bad = []
    check = lambda ok, what: ok or bad.append(what)  # noqa: E731
    check(r["attached"], "ActorMemory not attached to the sharding manager")
    check(r["verl_flags_after_init"] == [False, False, False], "verl's own offload still on")
    check(r["after_init"]["params"] > 0 and r["after_init"]["grads"] == 0, "init does not end where an update ends")
    check(r["opt_bytes_at_load"] > 0, "load_checkpoint wrote into offloaded optimizer state")
    check(r["opt_bytes_after_load"] == 0, "optimizer not put back after load_checkpoint")
    for i, s in enumerate(r["steps"]):
        g, u = s["after_generate"], s["after_update"]
        check(g["reshard_saw"] > 0, f"step {i}: params not resident at the reshard")
        check(all(b == 0 for _, b in g["h2d_in_generate"]), f"step {i}: generate reloaded something")
        check(g["params"] == 0 and g["grads"] == 0, f"step {i}: params or grads resident after generate")
        check(s["after_log_prob"]["in_log_prob"] > 0, f"step {i}: old log-prob ran on offloaded params")
        check(s["after_log_prob"]["params"] == 0, f"step {i}: params left resident by old log-prob")
        check(s["opt_bytes_at_save"] > 0, f"step {i}: checkpoint saved offloaded optimizer state")
        check(s["grads_zero_at_update"], f"step {i}: grads not zero at the update")
        check(s["update_saw_trained_params_exactly"], f"step {i}: update did not get the trained params back")
        check(u["params"] > 0, f"step {i}: params offloaded by the update")
        check(u["grads"] == 0 and u["opt"] == 0, f"step {i}: grads or optimizer state resident after the update")
    return bad


def ref_problems(r: dict) -> list[str]:
    if "exception" in r:
        return ["the cycle raised: " + r["exception"].strip().splitlines()[-1]]
    bad = []
    check = lambda ok, what: ok or bad.append(what)  # noqa: E731
    check(r["verl_ref_flag"] is False, "verl's own reference offload still on")
    check(r["after_init"] == 0, "reference resident after init")
    check(r["forward_saw_exact"] == [True, True], "reference forward did not see the exact params")
    check(r["d2h"] == [0, 0], "reference copied to host again")
    check(r["after"] == 0, "reference resident after its forward")
    return bad


def test_real_ddp_params_grads_optimizer_round_trip_byte_exact(res):
    r = res["ddp_round_trip"]
    # One storage per DDP buffer (params are views of param_data, main_grads of grad_data), none missed.
    assert r["groups"]["train_params"] == 2 and r["groups"]["grads"] == 2
    assert r["steps"][0] == "attach:ActorMemory"
    assert r["steps"][1:] == ["reshard", "offload_train_params", "update_onload", "update", "update_end"] * 3
    for c in r["cycles"]:
        assert c["resident_offloaded"] == {"train_params": 0, "grads": 0, "optimizer": 0}
        assert c["exact"] == [True, True, True, True]  # param_data, grad_data, Adam state, fp32 masters
        assert c["views"] and c["buckets"]  # DDP's params, main_grads and buckets see the same storage again


def test_actor_follows_the_switch_schedule_with_the_patches(res):
    assert actor_problems(res["actor:all"]) == []
    on = res["actor:all"]
    # Inside generate the loop ran the reshard and the params' offload, nothing host->device: on step 0
    # the sharding manager reached them, on step 1 (its sharding manager did not) the worker's exit did.
    for s in on["steps"]:
        assert [name for name, _ in s["after_generate"]["h2d_in_generate"]] == ["reshard", "offload_train_params"]
    # The whole run is our_steps() in order (the steps this process has: no rollout engine, no reference),
    # with the old log-prob forward and the checkpoints as excursions that leave the loop where it was.
    loop = [n for n in on["ledger_steps"] if ":" not in n]
    ours = [s.name for s in our_steps() if s.name in set(loop)]
    start = ours.index("reshard")  # the loop starts where an update ends
    assert loop == (ours[start:] + ours[:start]) * 2
    assert on["ledger_steps"][0] == "attach:ActorMemory"
    assert [n for n in on["ledger_steps"] if ":" in n][1:] == [
        "load_checkpoint:in", "load_checkpoint:out"] + ["compute_log_prob:in", "compute_log_prob:out",
                                                       "save_checkpoint:in", "save_checkpoint:out"] * 2


def test_upstream_keeps_grads_and_optimizer_resident(res):
    off = res["actor:none"]
    assert not off["attached"]
    for step in off["steps"]:
        assert step["after_update"]["grads"] > 0 and step["after_update"]["opt"] > 0
        assert step["after_generate"]["params"] > 0


@pytest.mark.parametrize("pid", mwr.OFFLOAD_IDS)
def test_each_offload_patch_is_needed(res, pid):
    missing = actor_problems(res[f"actor:-{pid}"]) + ref_problems(res[f"ref:-{pid}"])
    assert missing, f"nothing breaks without {pid}"


def test_generate_offloads_when_the_sharding_manager_does_not(res):
    assert res["generate_without_contract"]["reshard_saw"] > 0 and res["generate_without_contract"]["after"] == 0


def test_swap_optimizer_leaves_the_optimizer_alone_and_offload_off_is_upstream(res):
    assert res["swap_optimizer"]["opt_group"] is False and res["swap_optimizer"]["grads"] == 0
    assert res["swap_optimizer"]["opt"] > 0
    # Without MindSpeed the flag does nothing, so the optimizer state is ours to offload.
    assert res["swap_optimizer_without_mindspeed"]["opt_group"] is True
    assert res["swap_optimizer_without_mindspeed"]["opt"] == 0
    assert res["offload_off"]["memory"] is False and res["offload_off"]["grads"] > 0


def test_reference_is_onloaded_for_its_forward_and_only_freed_after(res):
    assert ref_problems(res["ref:all"]) == []
    assert res["ref:none"]["after_init"] > 0 and res["ref:none"]["after"] > 0


def test_reference_layout_must_be_the_shared_groups(res):
    assert "ref.megatron.tensor_model_parallel_size=2 but the process's groups have 1" in res["layout_patched"]["error"]
    assert res["layout_unpatched"]["error"] is None  # upstream silently builds with the actor's groups
    assert res["layout_same_patched"]["error"] is None
    assert "use the colocated 'actor_rollout' and 'ref' workers" in res["role_arr_patched"]["error"]
    assert "colocated" not in (res["role_arr_unpatched"]["error"] or "")


def test_real_torch_compile_for_building_and_generating_only(res):
    real_everywhere_it_compiles = {"build": "real", "after_build": "mindspeed", "generate": "real",
                                   "after_generate": "mindspeed"}
    assert res["compile_patched"] == real_everywhere_it_compiles
    assert set(res["compile_unpatched"].values()) == {"mindspeed"}
    assert res["compile_-build"]["build"] == "mindspeed" and res["compile_-build"]["generate"] == "real"
    assert res["compile_-generate"]["generate"] == "mindspeed" and res["compile_-generate"]["build"] == "real"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="megatron-core's optimizers create CUDA tensors")
def test_real_megatron_optimizer_state_round_trips_exactly_and_memory_is_freed():
    import math

    r = run_distributed(mwr.real_optimizer_continuation, 1, backend="nccl", timeout=300)[0]
    print(r["optimizer"], r["inner"], r["freed"], r["round_trip_exact"], r["losses"], r["ledger"], sep="\n")
    # Params, main_grads, fp32 masters and Adam state: every byte the next step reads came back.
    assert r["round_trip_exact"] == [True] * len(r["freed"])
    for f in r["freed"]:
        assert set(f["resident_after"].values()) == {0}
        assert f["allocator_bytes"] >= f["groups_bytes"] - (1 << 20)  # the allocator really gave it back
    assert all(math.isfinite(x) for x in r["losses"])
