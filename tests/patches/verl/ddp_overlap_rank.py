"""Rank function for the DDP overlap test (test_ddp_overlap.py): verl 0.4.1's real get_model and
MegatronPPOActor.update_policy with the overlay's DDP-overlap patches, a real megatron-core 0.12.1
GPTModel (bf16, Float16Module) in megatron-core's DistributedDataParallel, its real
DistributedOptimizer (fp32 main shards, Adam) and its real no-pipelining schedule with
finalize_model_grads, over a gloo data-parallel group of 2 ranks (torch 2.5.1's gloo has the
reduce-scatter and all-gather megatron issues, coalesced and asynchronous).

Stand-ins, where the CPU cannot run the real thing or it is not what is tested (declared here):
- the CPU platform's records (cpu.*: torch.cuda's device/stream calls, megatron's optimizer and
  schedules with CUDA scalars made on the host, no Transformer Engine fp8 cast);
- verl's update_policy ``self``: a namespace holding the real chunks and optimizer, a profiler that
  does nothing, and ``forward_backward_batch`` which runs megatron-core's real schedule over the
  micro-batches with a next-token loss (verl's own needs its PPO batch and log-prob machinery);
- megatron_actor's get_torch_device (its empty_cache; torch 2.5 has none for the host).
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

CPU_IDS = ("cpu.torch.", "cpu.verl.", "cpu.megatron.")  # the CPU platform's records (no vLLM here)
OVERLAP_IDS = ("verl.ddp_overlap.build_model_optimizer", "verl.ddp_overlap.get_model", "verl.ddp_overlap.update_policy")
VOCAB, SEQ, MICRO, MINI, UPDATES = 128, 16, 2, 2, 2

# What the recording wrappers saw (per build).
EVENTS: list[dict] = []
PHASE = {"now": "idle"}


def _setup() -> None:
    os.environ["VERL_PATCHES_DEVICE"] = "cpu"
    from megatron.core import parallel_state as mpu

    from verl_patches.core.apply import apply_all
    from verl_patches.patches import load_catalogue

    apply_all([p for p in load_catalogue() if p.id.startswith(CPU_IDS)])
    mpu.initialize_model_parallel(1, 1)
    import verl.workers.actor.megatron_actor as ma

    ma.get_torch_device = lambda: types.SimpleNamespace(empty_cache=lambda: None)  # stand-in (see docstring)
    _record_collectives()


def _record_collectives() -> None:
    """Wrap megatron-core's bucket-group calls to record where each collective was launched."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as G

    grad, param = G.start_grad_sync, G.start_param_sync

    def start_grad_sync(self):
        in_backward = torch._C._current_graph_task_id() != -1
        grad(self)
        EVENTS.append({"op": "grad_reduce", "phase": PHASE["now"], "in_backward": in_backward,
                       "async": self.grad_reduce_handle is not None})

    def start_param_sync(self, force_sync: bool = False):
        param(self, force_sync=force_sync)
        EVENTS.append({"op": "param_gather", "phase": PHASE["now"], "force_sync": force_sync,
                       "async": self.param_gather_handle is not None})

    G.start_grad_sync, G.start_param_sync = start_grad_sync, start_param_sync


def _build(overlap: dict[str, bool], use_distributed_optimizer: bool = True):
    """verl's get_model (patched) inside the actor's build wrapper, then verl's optimizer factory."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig
    from verl.utils import megatron_utils as mu
    from verl.utils.megatron.optimizer import get_megatron_optimizer

    from verl_patches.patches.verl.patch_workers_megatron_workers_ddp_overlap import wrap_build_model_optimizer

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    tc = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                           params_dtype=torch.bfloat16, bf16=True, add_bias_linear=False)

    def provider(pre_process, post_process):
        return GPTModel(tc, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                        pre_process=pre_process, post_process=post_process)

    worker = types.SimpleNamespace(_is_actor=True, config={"rollout": {"recipe": dict(overlap)}})
    build = wrap_build_model_optimizer(lambda self: mu.get_model(
        provider, wrap_with_ddp=True, use_distributed_optimizer=use_distributed_optimizer, transformer_config=tc))
    chunks = build(worker)
    opt = get_megatron_optimizer(model=chunks, config=OptimizerConfig(
        optimizer="adam", lr=1e-2, bf16=True, params_dtype=torch.bfloat16, clip_grad=1.0,
        use_distributed_optimizer=use_distributed_optimizer))
    mu.get_model_config(chunks[0]).finalize_model_grads_func = finalize_model_grads  # as MegatronPPOActor does
    return chunks, opt


def _tokens(rank: int, update: int, mini: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * update + mini)
    return torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)


def _own_range(chunk, rank: int, world: int) -> list[tuple[torch.Tensor, slice]]:
    out = []
    for buf in chunk.buffers:
        n = buf.param_data.numel() // world
        out.append((buf.param_data, slice(rank * n, (rank + 1) * n)))
    return out


def _others(chunks, rank: int, world: int) -> torch.Tensor:
    """This rank's parameter buffer outside its own distributed-optimizer shard."""
    parts = []
    for chunk in chunks:
        for data, own in _own_range(chunk, rank, world):
            parts += [data[:own.start], data[own.stop:]]
    return torch.cat([p.detach().clone().float() for p in parts])


def _actor(chunks, opt, rank: int, world: int, log: dict) -> Any:
    """verl's update_policy ``self`` (see the module docstring)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from verl_patches.train.ddp_overlap import pending_communication

    def forward_backward_batch(data, **_kw):
        toks = data.tokens
        before = _others(chunks, rank, world)
        log["due_before_forward"].append(bool(pending_communication(chunks)))

        def step(batch_iter, model):
            t = next(batch_iter)
            inp, labels = t[:-1].unsqueeze(0), t[1:].unsqueeze(0)
            pos = torch.arange(SEQ).unsqueeze(0)
            out = model(inp, pos, None, labels=labels)

            def loss_func(output):
                loss = output.float().mean()
                return loss, {"loss": loss.detach().clone()}

            return out, loss_func

        PHASE["now"] = "forward_backward"
        try:
            losses = get_forward_backward_func()(forward_step_func=step, data_iterator=iter(list(toks)),
                                                 model=chunks, num_microbatches=len(toks), seq_length=SEQ,
                                                 micro_batch_size=1, forward_only=False)
        finally:
            PHASE["now"] = "idle"
        log["forward_gathered_others"].append(not torch.equal(before, _others(chunks, rank, world)))
        log["losses"] += [float(d["loss"]) for d in losses]
        log["grads"].append(torch.cat([b.grad_data.detach().clone() for c in chunks for b in c.buffers]))
        return {"output": [({"loss": d["loss"]}, None) for d in losses]}

    config = types.SimpleNamespace(entropy_coeff=0, ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False,
                                   ppo_mini_batch_size=MICRO)
    noop = lambda *a, **k: None  # noqa: E731
    return types.SimpleNamespace(actor_module=chunks, actor_optimizer=opt, config=config,
                                 prof=types.SimpleNamespace(start=noop, step=noop, stop_and_save=noop, stop_trace=noop),
                                 forward_backward_batch=forward_backward_batch)


def _round_trip(chunks, opt) -> dict[str, Any]:
    """The switch's moves of the actor's memory between updates: params and optimizer to host and
    back, grads released and re-allocated zeroed; the buckets must still be views of the buffers."""
    from verl_patches.offload import OffloadEngine
    from verl_patches.offload.megatron_memory import ActorMemory

    def views() -> list[tuple]:
        out = []
        for c in chunks:
            for g in c.bucket_groups:
                for b in g.buckets:
                    out.append((id(b.param_data), id(b.grad_data), b.param_data.untyped_storage().data_ptr(),
                                b.grad_data.untyped_storage().data_ptr()))
        return out

    def aliased() -> bool:
        ok = True
        for c in chunks:
            for buf in c.buffers:
                for b in buf.buckets:
                    ok &= b.param_data.untyped_storage().data_ptr() == buf.param_data.untyped_storage().data_ptr()
                    ok &= b.grad_data.untyped_storage().data_ptr() == buf.grad_data.untyped_storage().data_ptr()
                for p in buf.params:
                    ok &= p.main_grad.untyped_storage().data_ptr() == buf.grad_data.untyped_storage().data_ptr()
                    ok &= p.untyped_storage().data_ptr() == buf.param_data.untyped_storage().data_ptr()
        return ok

    ids_before = [v[:2] for v in views()]
    params_before = [p.detach().clone() for c in chunks for p in c.parameters()]
    memory = ActorMemory(chunks, opt, engine=OffloadEngine())
    groups = memory.groups()
    groups["train_params"].offload()
    groups["grads"].release()
    groups["optimizer"].offload()
    freed = all(p.untyped_storage().nbytes() == 0 for c in chunks for p in c.parameters())
    groups["optimizer"].onload()
    groups["grads"].allocate()
    groups["train_params"].onload()
    out = {"freed": freed, "same_bucket_objects": [v[:2] for v in views()] == ids_before, "aliased": aliased(),
           "params_back": all(torch.equal(a, p) for a, p in zip(params_before, (p for c in chunks for p in c.parameters()))),
           "hooked": type(groups["train_params"]).__name__}
    memory.close()  # on device already: gives back the host buffers
    return out


def train(rank: int, world: int, overlap: dict[str, bool], offload_between: bool) -> dict[str, Any]:
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    from verl_patches.core.apply import apply_all, undo
    from verl_patches.patches import get_patch

    applied = apply_all([get_patch(i) for i in OVERLAP_IDS])
    try:
        EVENTS.clear()
        chunks, opt = _build(overlap)
        ddp = chunks[0].ddp_config
        config = chunks[0].config
        log: dict[str, Any] = {"losses": [], "grads": [], "due_before_forward": [], "forward_gathered_others": [],
                               "round_trips": []}
        actor = _actor(chunks, opt, rank, world, log)
        params = []
        for u in range(UPDATES):
            data = [types.SimpleNamespace(to=lambda *_: None, meta_info={}, tokens=_tokens(rank, u, m))
                    for m in range(MINI)]
            MegatronPPOActor.update_policy(actor, iter(data))
            params.append(torch.cat([p.detach().clone().float().flatten() for c in chunks for p in c.parameters()]))
            if offload_between:
                log["round_trips"].append(_round_trip(chunks, opt))
        return {"ddp": {k: getattr(ddp, k) for k in ("overlap_grad_reduce", "overlap_param_gather",
                                                       "align_param_gather", "use_distributed_optimizer")},
                "hooks": {k: getattr(config, k) is not None for k in ("no_sync_func", "grad_sync_func", "param_sync_func")},
                "forward_pre_hooks": len(chunks[0].remove_forward_pre_hook_handles),
                "buckets": sum(len(c.bucket_groups) for c in chunks),
                "events": list(EVENTS), "params": params, **log}
    finally:
        undo(applied)


def guards(rank: int, world: int) -> dict[str, Any]:
    """The offload of the params refuses an in-flight gather and parameters not gathered since a step."""
    from verl_patches.core.apply import apply_all, undo
    from verl_patches.patches import get_patch
    from verl_patches.train.ddp_overlap import DdpOverlapError, complete_param_gather
    from verl_patches.offload import OffloadEngine
    from verl_patches.offload.megatron_memory import ActorMemory

    applied = apply_all([get_patch(i) for i in OVERLAP_IDS])
    out: dict[str, Any] = {}
    try:
        chunks, opt = _build({"overlap_grad_reduce": True, "overlap_param_gather": True})
        memory = ActorMemory(chunks, opt, engine=OffloadEngine())
        group = chunks[0].bucket_groups[0]
        # An update's step without the wrapper's completion: the others' shards are stale.
        log = {"losses": [], "grads": [], "due_before_forward": [], "forward_gathered_others": []}
        actor = _actor(chunks, opt, rank, world, log)
        opt.zero_grad()
        for c in chunks:
            c.zero_grad_buffer()
        actor.forward_backward_batch(types.SimpleNamespace(tokens=_tokens(rank, 0, 0)))
        opt.step()
        for key in ("stale", "in_flight"):
            if key == "in_flight":
                complete_param_gather(chunks)
                group.param_gather_dispatched = False
                group.start_param_sync()  # asynchronous
            try:
                memory.groups()["train_params"].offload()
                out[key] = "not refused"
            except DdpOverlapError as e:
                out[key] = str(e)
        out["grads_release"] = None
        try:
            memory.groups()["grads"].release()
        except DdpOverlapError as e:
            out["grads_release"] = str(e)
        complete_param_gather(chunks)
        memory.groups()["train_params"].offload()
        memory.groups()["train_params"].onload()
        out["after_completion"] = "moved"
        # overlap_param_gather without the distributed optimizer: refused by name at build time.
        try:
            _build({"overlap_param_gather": True}, use_distributed_optimizer=False)
            out["no_distopt"] = "built"
        except DdpOverlapError as e:
            out["no_distopt"] = str(e)
    finally:
        undo(applied)
    return out


def run_all(rank: int, world: int) -> dict[str, Any]:
    _setup()
    off = {"overlap_grad_reduce": False, "overlap_param_gather": False}
    on = {"overlap_grad_reduce": True, "overlap_param_gather": True}
    return {"off": train(rank, world, off, False), "on": train(rank, world, on, False),
            "on_offload": train(rank, world, on, True), "guards": guards(rank, world)}
