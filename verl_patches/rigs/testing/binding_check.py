"""One rank of the sharding-manager binding test: real megatron-core actor, real vLLM model, verl's
real MegatronVLLMShardingManager entered with our patch; for run_distributed (spawned processes).

The verl rollout engine around the vLLM model is a stand-in recording wake_up / sleep calls (the
recipe engine's routing of those calls to the offload engine is tested with vLLM's real LLM in
tests/patches/vllm/test_llm_sleep_wake.py). The actor's memory is under the switch loop
(verl_patches/offload/live.py) as the worker attaches it: the real ActorMemory for megatron's DDP,
else the training params alone (the grads and optimizer state are not what this checks), whose
offload is recorded among the engine's calls. The worker's generate_sequences wrapper is played
by ``_generation``: the rollout segment begins, the manager is entered and left, the segment ends.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from verl_patches.core import stash
import torch
from verl_patches.core.apply import apply_all
from verl_patches.offload import HookedGroup, OffloadEngine, TensorGroup
from verl_patches.offload.live import live_switch, reset_live_switch
from verl_patches.offload.megatron_memory import _Memory, param_tensors, ActorMemory
from verl_patches.patches import get_patch
from verl_patches.reshard.binding import megatron_params, check_expert_placement
from verl_patches.reshard.shards import full_state, logical_state, train_shards
from verl_patches.rollout.mla import release_mla_derived
from verl_patches.rollout.settings import STASH_KEY, RolloutSettings
from verl_patches.rigs.testing.live_models import (megatron_cpu_stand_ins, vllm_cpu_stand_ins, build_megatron_deepseek,
    build_vllm_deepseek, megatron_to_hf, mla_derived, randomize, vllm_post_load)
from torch.distributed.device_mesh import init_device_mesh

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _Engine:
    """Stand-in for vLLM's LLM as verl's manager sees it: the model runner path and wake_up / sleep."""

    def __init__(self, model: Any, settings: Any, events: list[str]) -> None:
        runner = SimpleNamespace(model=model)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner))))
        self.events = events
        if settings is not None:
            stash.put(self, STASH_KEY, settings)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.events.append(f"wake_up:{','.join(tags or [])}")

    def sleep(self, level: int = 1) -> None:
        self.events.append(f"sleep:{level}")


def _params_memory(actor: torch.nn.Module, events: list[str]) -> Any:
    """The training params as the worker's ActorMemory groups them, attached to the switch loop."""
    class ParamsMemory(_Memory):
        def __init__(self) -> None:
            self.engine = OffloadEngine()
            group = TensorGroup(self.engine, "actor_params", param_tensors([actor]))
            self._groups = {"train_params": HookedGroup(group, before={
                "offload": lambda: events.append("offload_train_params")})}

        def groups(self) -> dict[str, Any]:
            return self._groups

    memory = ParamsMemory()
    live_switch().attach(memory)
    return memory


@contextlib.contextmanager
def _generation(manager: Any):
    """What the worker's generate_sequences wrapper does around verl's body (the manager's
    __enter__ / __exit__ are verl's, with our patch)."""
    live_switch().begin_rollout()
    with manager:
        yield
    live_switch().reach("release_rollout_weights", "the test's generate_sequences")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n for n in set(a) | set(b) if n not in a or n not in b or not torch.equal(a[n], b[n]))


def _cpu_device_stand_ins() -> None:
    # Stand-ins: verl's manager keeps device RNG states and logs memory through get_torch_device(),
    # torch.cpu here, which has none of these; the CPU generator plays the device's.
    for name, fn in (("get_rng_state", torch.get_rng_state), ("set_rng_state", torch.set_rng_state),
                     ("manual_seed", torch.manual_seed), ("empty_cache", lambda: None),
                     ("memory_allocated", lambda *a: 0), ("memory_reserved", lambda *a: 0),
                     ("mem_get_info", lambda *a: (0, 0))):
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def sharding_manager_rank(rank: int, world: int, model_dir: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case: grouped (GroupedMLP or SequentialMLP experts), method, dtype, recipe (extra
    recipe keys), patched. Unpatched cases must come first: the patch stays applied after."""
    vllm_cpu_stand_ins()
    megatron_cpu_stand_ins()
    _cpu_device_stand_ins()
    # Lazy: megatron-core and verl load inside the rank, after the patches are applied.
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(1, 1)
    out, applied = [], False
    for case in cases:
        if case.get("patched", True) and not applied:
            apply_all([get_patch("verl.sharding_manager.reshard")])
            applied = True
        elif not case.get("patched", True) and applied:
            raise ValueError("unpatched cases must come before patched ones")
        out.append(_case(world, Path(model_dir), **{k: v for k, v in case.items() if k != "patched"}))
    return out


def _ddp(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """megatron-core's DDP with the distributed optimizer's layout: params are views of param_data."""
    # Lazy: megatron-core and verl load inside the rank, after the patches are applied.
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=True, grad_reduce_in_fp32=True))


def _case(world: int, model_dir: Path, grouped: bool, method: str, dtype: str,
          recipe: dict[str, Any] | None = None, ddp: bool = False) -> dict[str, Any]:
    # Lazy: megatron-core and verl load inside the rank, after the patches are applied.
    from verl.workers.sharding_manager.megatron_vllm import MegatronVLLMShardingManager

    dt = _DTYPES[dtype]
    cfg = json.loads((model_dir / "config.json").read_text())
    gpt = build_megatron_deepseek(cfg, dt, grouped)
    randomize(gpt, seed=1)
    # Reference: vLLM's own loaders fed the actor's weights in HF names, then its post-load step.
    ref, vcfg = build_vllm_deepseek(model_dir, dt)
    ref.load_weights(megatron_to_hf(gpt, cfg).items())
    actor = _ddp(gpt, dt) if ddp else gpt
    vllm_post_load(ref, vcfg)
    # The rollout model as the engine built it: its own (dummy) weights, post-processed.
    model, _ = build_vllm_deepseek(model_dir, dt)
    randomize(model, seed=2)
    vllm_post_load(model, vcfg)
    params = lambda m: {n: p.data.clone() for n, p in m.named_parameters()}  # noqa: E731
    differ_before = _same(params(model), params(ref))

    events: list[str] = []
    settings = RolloutSettings.from_config(
        {"tensor_model_parallel_size": 1, "recipe": {"reshard_method": method, **(recipe or {})}}, world)
    engine = _Engine(model, settings, events)
    mesh = init_device_mesh("cpu", mesh_shape=(world, 1), mesh_dim_names=["dp", "infer_tp"])
    manager = MegatronVLLMShardingManager(
        actor_module=[actor], inference_engine=engine, model_config=SimpleNamespace(to_dict=lambda: dict(cfg)),
        transformer_config=None, layer_name_mapping={}, weight_converter=None, device_mesh=mesh, offload_param=False)

    switch = reset_live_switch()  # one loop per case, as one worker process has
    if ddp:
        # The worker's real ActorMemory, attached as patch verl.megatron_worker.offload_init does.
        memory = ActorMemory([actor], engine=OffloadEngine())
        switch.attach(memory)
        before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    else:
        memory = _params_memory(actor, events)
    stash.put(manager, "actor_memory", memory)
    error, again = None, None
    try:
        with _generation(manager):
            events.append("generate")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    result = {"differ_before": len(differ_before), "mismatch": _same(params(model), params(ref)),
              "mla_mismatch": _same(mla_derived(model), mla_derived(ref)), "mla_layers": len(mla_derived(ref)) // 2,
              "events": list(events), "error": error}
    session = stash.get(manager, "reshard")  # the run's plan, built on the first switch (the patch's SESSION_ATTR)
    if session is not None:
        result.update(bucket_bytes=session.plan.bucket_bytes, buckets=len(session.plan.buckets))
    if ddp and error is None:
        # After the switch the training params are on host; back on device they are the same bytes.
        params_now = [p for _, p in actor.named_parameters()]
        result["train_params_offloaded"] = all(p.untyped_storage().nbytes() == 0 for p in params_now)
        with switch.excursion("check", ("train_params",)):
            result["train_params_back_exact"] = all(torch.equal(p, before[n]) for n, p in actor.named_parameters())
    if error is None and method != "upstream":
        # What the recipe engine's offload does with the weights (VllmEngineMemory), then the next switch.
        result["mla_freed_bytes"] = release_mla_derived(model)
        result["mla_emptied"] = all(t.numel() == 0 for t in mla_derived(model).values())
        with _generation(manager):  # again right after a generation, as validation does
            pass
        again = _same(mla_derived(model), mla_derived(ref))
    result["mla_mismatch_after_release"] = again
    result["ledger_steps"] = [e.step for e in switch.ledger.entries]
    memory.close()
    return result


def sharding_manager_multirank(rank: int, world: int, model_dir: str, train: dict[str, Any], rollout_tp: int,
                               method: str, bucket_mb: int | None = None) -> dict[str, Any]:
    """Real megatron-core model parallel (train: tp, pp, layers; experts over TP x EP) and a
    real vLLM model with TP = EP = rollout_tp over all ranks. The actor is filled from a seeded
    full model through the layout (its names and shapes are checked against the real modules;
    the single-rank cases check the values' mapping independently); the reference is vLLM's
    own load_weights of that full model on every rank. ``bucket_mb``: recipe.reshard_bucket_mb (None: absent)."""
    # Lazy: megatron-core and verl load inside the rank, after the patches are applied.
    from megatron.core import parallel_state as mpu

    vllm_cpu_stand_ins()
    megatron_cpu_stand_ins()
    _cpu_device_stand_ins()
    # Lazy: megatron-core and verl load inside the rank, after the patches are applied.
    from verl.workers.sharding_manager.megatron_vllm import MegatronVLLMShardingManager

    tp, pp, layers = train["tp"], train["pp"], tuple(train["layers"])
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  expert_model_parallel_size=world // pp, expert_tensor_parallel_size=1)
    dt = torch.float32
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    actor = build_megatron_deepseek(cfg, dt, grouped=True, layers=layers)
    ref, vcfg = build_vllm_deepseek(Path(model_dir), dt, tp=rollout_tp)
    model, _ = build_vllm_deepseek(Path(model_dir), dt, tp=rollout_tp)
    randomize(model, seed=2)
    vllm_post_load(model, vcfg)

    apply_all([get_patch("verl.sharding_manager.reshard")])
    events: list[str] = []
    settings = RolloutSettings.from_config({"tensor_model_parallel_size": rollout_tp, "recipe": {
        "reshard_method": method, "megatron": {"num_layer_list": list(layers)},
        **({} if bucket_mb is None else {"reshard_bucket_mb": bucket_mb})}}, world)
    mesh = init_device_mesh("cpu", mesh_shape=(world // rollout_tp, rollout_tp), mesh_dim_names=["dp", "infer_tp"])
    manager = MegatronVLLMShardingManager(
        actor_module=[actor], inference_engine=_Engine(model, settings, events),
        model_config=SimpleNamespace(to_dict=lambda: dict(cfg)), transformer_config=None, layer_name_mapping={},
        weight_converter=None, device_mesh=mesh, offload_param=False)

    stash.put(manager, "actor_memory", _params_memory(actor, events))
    # The plan (built on the first switch) gives the layout; fill the actor through it, then switch again.
    with _generation(manager):
        pass
    live_switch().begin_rollout()  # the training params back on device for the fill (rollout_again)
    plan = stash.get(manager, "reshard").plan
    P = plan.placements

    experts_checked = check_expert_placement(model, P, rank)
    full = full_state(P, seed=3, dtype="float32")
    mine = train_shards(P, rank, logical_state(P, full))
    live = megatron_params([actor])
    for name, t in live.items():
        t.copy_(mine[name])
    ref.load_weights(full.items())
    vllm_post_load(ref, vcfg)
    params = lambda m: {n: p.data.clone() for n, p in m.named_parameters()}  # noqa: E731
    differ_before = _same(params(model), params(ref))
    with manager:
        events.append("generate")
    live_switch().reach("release_rollout_weights", "the test's generate_sequences")
    return {"differ_before": len(differ_before), "mismatch": _same(params(model), params(ref)),
            "mla_mismatch": _same(mla_derived(model), mla_derived(ref)), "events": events,
            "local_layers": sorted({n.split(".")[2] for n in live if n.startswith("decoder.layers.")}),
            "extra_names": sorted(set(live) - set(mine)), "layout": str(P.train), "experts_checked": experts_checked,
            "bucket_bytes": plan.bucket_bytes, "buckets": len(plan.buckets)}
