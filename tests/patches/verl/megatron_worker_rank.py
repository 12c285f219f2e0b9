"""Rank function for the Megatron worker memory tests: verl 0.4.1's real ActorRolloutRefWorker bodies
(init_model, update_actor, generate_sequences, compute_ref_log_prob, compute_log_prob, save_checkpoint,
_build_rollout) on one gloo rank, with a real megatron-core 0.12.1 GPTModel wrapped in megatron-core's
DDP (param_data / grad_data buffers), run with and without the overlay's patches.

Stand-ins, where CPU cannot run the real thing or it is not what is tested:
- torch.cuda.current_device answers "cpu" (megatron-core's DDP asks it for the buffer device);
- the Megatron optimizer: megatron-core's optimizers create CUDA tensors in their constructors, so the
  actor's optimizer is a real torch Adam over fp32 master copies held as ``.optimizer`` (the shape of
  a MegatronOptimizer); the update step (update_policy) writes grads into main_grad and steps it;
- the rollout engine, the sharding manager (with the contract it reaches the switch loop's reshard
  and offload_train_params steps, as ours does; without it, it only reads the params), the reference forward, MegatronPPOActor / FlopsCounter / MegatronCheckpointManager
  constructors, vLLM's rollout class in _build_rollout;
- torch.compile replaced by a call-through, as MindSpeed's dummy_compile does (MindSpeed needs torch_npu).
"""

from __future__ import annotations

import os
import types
from typing import Any, Callable

from verl_patches.core import stash
import torch



def mindspeed_dummy_compile(*args, **kwargs):
    if args and callable(args[0]):
        return args[0]
    return lambda fn: fn


class FreedStorage(RuntimeError):
    """A stand-in was about to touch a tensor whose storage is offloaded (on CPU that is a segfault;
    on a device, garbage): what a missing onload does to the real code."""


def _resident(tensors, what: str) -> list:
    tensors = list(tensors)
    for t in tensors:
        if t.numel() and t.untyped_storage().nbytes() == 0:
            raise FreedStorage(f"{what}: a tensor of shape {tuple(t.shape)} is offloaded")
    return tensors


def _snap(tensors, what: str = "snapshot") -> bytes:
    # A clone: .numpy() on the tensor itself would pin its storage (non-resizable).
    return b"".join(t.detach().clone().view(torch.uint8).numpy().tobytes() for t in _resident(tensors, what))


def _setup() -> None:
    from verl_patches.rigs.testing.upstream_env import prepare_cpu_upstream

    prepare_cpu_upstream()
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(1, 1)
    import verl.utils.debug.performance as perf
    import verl.workers.megatron_workers as mw

    dev = types.SimpleNamespace(empty_cache=lambda: None, memory_allocated=lambda: 0, memory_reserved=lambda: 0,
                                mem_get_info=lambda: (0, 0), current_device=lambda: "cpu", device_count=lambda: 0)
    mw.get_torch_device = lambda: dev  # torch.cpu has no empty_cache / memory stats in torch 2.5
    mw.get_device_id = lambda: "cpu"
    perf.get_torch_device = lambda: dev
    mw.reduce_timing = lambda timing: timing  # all_reduce(AVG) of timings: gloo has no AVG
    mw.MegatronPPOActor = lambda **kw: types.SimpleNamespace(**kw)
    mw.FlopsCounter = lambda cfg: types.SimpleNamespace(estimate_flops=lambda *a: (1.0, 1.0))
    mw.MegatronCheckpointManager = lambda **kw: types.SimpleNamespace(**kw)

    from verl_patches.rollout import compile_context

    compile_context.save_real_compile()  # the prelude's order: before MindSpeed replaces it
    torch.compile = mindspeed_dummy_compile


def _gpt(seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    tc = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                           params_dtype=torch.bfloat16, bf16=True, add_bias_linear=False)
    return tc, GPTModel(tc, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8)


def _actor(seed: int = 0):
    """verl's actor_module (one DDP chunk, as verl.utils.megatron_utils.get_model wraps it) and a
    MegatronOptimizer-shaped stand-in over fp32 masters."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig

    tc, model = _gpt(seed)
    ddp = DDP(config=tc, module=model, ddp_config=DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=True, grad_reduce_in_fp32=True))
    params = list(ddp.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    inner = torch.optim.Adam(masters, lr=1e-2)
    optimizer = types.SimpleNamespace(optimizer=inner, param_groups=inner.param_groups, params=params, masters=masters)
    return tc, [ddp], optimizer


def _train_step(modules, optimizer, step: int) -> None:
    """What an update does to memory: grads accumulate into main_grad, the optimizer steps the fp32
    masters (creating Adam's state) and copies them into the bf16 params."""
    g = torch.Generator().manual_seed(100 + step)
    state = [v for st in optimizer.optimizer.state.values() for v in st.values() if v.dim() > 0]
    _resident(optimizer.params + [p.main_grad for p in optimizer.params] + optimizer.masters + state, "update")
    for p, m in zip(optimizer.params, optimizer.masters):
        p.main_grad.add_(torch.randn(p.shape, generator=g))
        m.grad = p.main_grad.float().clone()
    optimizer.optimizer.step()
    with torch.no_grad():
        for p, m in zip(optimizer.params, optimizer.masters):
            p.copy_(m)
            m.grad = None


def _config(**over):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({
        "model": {"path": "unused", "override_config": {}, "trust_remote_code": False},
        "actor": {"megatron": {"override_transformer_config": {}, "use_distributed_optimizer": True,
                               "tensor_model_parallel_size": 1},
                  "optim": {"use_checkpoint_opt_param_scheduler": False}, "checkpoint": {},
                  "ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": 1},
        "ref": {"megatron": {"override_transformer_config": {}, "tensor_model_parallel_size": 1,
                             "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1,
                             "context_parallel_size": 1, "virtual_pipeline_model_parallel_size": None},
                "log_prob_micro_batch_size_per_gpu": 2, "log_prob_max_token_len_per_gpu": 64,
                "log_prob_use_dynamic_bsz": False},
        "rollout": {"name": "vllm", "mode": "sync", "tensor_model_parallel_size": 1, "temperature": 1.0,
                    "log_prob_micro_batch_size_per_gpu": 2, "log_prob_max_token_len_per_gpu": 64,
                    "log_prob_use_dynamic_bsz": False,
                    "recipe": {"offload": True, "rollout_torch_compile": True, "megatron": {"swap_optimizer": False}}},
    })
    for key, value in over.items():
        OmegaConf.update(cfg, key, value)
    return cfg


class SM:
    """The sharding manager's part in the contract: reshard from the resident params (the switch
    loop's reshard step), then reach offload_train_params."""

    timing: dict = {}

    def __init__(self, log: dict, contract: bool = True) -> None:
        self.log, self.contract = log, contract

    def __enter__(self):
        from verl_patches.offload.live import live_switch

        def reshard():
            params = self.actor_module_params()
            self.log["params_bytes_at_reshard"] = sum(p.untyped_storage().nbytes() for p in params)

        if self.contract and stash.get(self, "actor_memory") is not None:
            live_switch().call("reshard", reshard, "the sharding manager stand-in")
            live_switch().reach("offload_train_params", "the sharding manager stand-in")
        else:
            reshard()
        return self

    def __exit__(self, *exc):
        return False

    preprocess_data = staticmethod(lambda d: d)
    postprocess_data = staticmethod(lambda d: d)


def _prompts():
    from verl.protocol import DataProto

    return DataProto.from_dict(tensors={"input_ids": torch.ones(2, 3, dtype=torch.long)})


def _actor_worker(cfg=None, *, contract: bool = True, log: dict | None = None):
    """An actor_rollout worker as verl's __init__ leaves it, with stand-ins for the heavy parts."""
    from verl.protocol import DataProto

    log = {} if log is None else log
    tc, modules, optimizer = _actor()
    sm = SM(log, contract)
    sm.actor_module_params = lambda: [p for m in modules for p in m.parameters()]

    def generate(prompts):
        log["compile_in_generate"] = torch.compile
        log["params_bytes_in_generate"] = sum(p.untyped_storage().nbytes() for m in modules for p in m.parameters())
        return DataProto.from_dict(tensors={"responses": prompts.batch["input_ids"] + 1})

    def update_policy(dataloader):
        list(dataloader)
        log.setdefault("params_at_update", []).append(_snap(optimizer.params, "update"))
        log.setdefault("grads_zero_at_update", []).append(
            all(torch.count_nonzero(g) == 0 for g in _resident([p.main_grad for p in optimizer.params], "update")))
        _train_step(modules, optimizer, len(log["params_at_update"]))
        return {}

    def actor_log_prob(data, calculate_entropy=False):
        log["params_bytes_in_log_prob"] = sum(p.untyped_storage().nbytes() for p in optimizer.params)
        n = data.batch.batch_size[0]
        return torch.zeros(n, 1), torch.zeros(n, 1)

    def build(model_path, optim_config, override_model_config, override_transformer_config):
        return modules, optimizer, types.SimpleNamespace(step=lambda n: None), types.SimpleNamespace(), None

    def build_rollout(trust_remote_code=False):
        return types.SimpleNamespace(generate_sequences=generate), sm

    w = types.SimpleNamespace(
        config=cfg if cfg is not None else _config(), role="actor_rollout", _is_actor=True, _is_rollout=True,
        _is_ref=False, _is_offload_param=False, _is_offload_grad=False, _is_offload_optimizer=False,
        rank=0, world_size=1, tf_config=tc, hf_config=None, architectures=["GPT"], processor=None,
        tokenizer=types.SimpleNamespace(eos_token_id=0, pad_token_id=0), generation_config=None,
        share_embeddings_and_output_weights=False, _build_model_optimizer=build, _build_rollout=build_rollout,
    )
    w.log, w.modules, w.optimizer, w.generate_fn = log, modules, optimizer, generate
    # init_model builds MegatronPPOActor (a stand-in constructor); tests put this one in after it.
    w.actor_standin = types.SimpleNamespace(make_minibatch_iterator=lambda data: iter([data]),
                                            update_policy=update_policy, compute_log_prob=actor_log_prob)
    return w


def _ref_worker(cfg=None, log: dict | None = None):
    log = {} if log is None else log
    _, model = _gpt(7)
    modules = [model]

    def build(model_path, optim_config, override_model_config, override_transformer_config):
        return modules, types.SimpleNamespace()

    def ref_forward(data, calculate_entropy=False):
        params = list(modules[0].parameters())
        resident = all(p.untyped_storage().nbytes() for p in params)
        log.setdefault("ref_bytes_in_forward", []).append(_snap(params) if resident else None)
        return torch.zeros(data.batch.batch_size[0], 1), None

    w = types.SimpleNamespace(
        config=cfg if cfg is not None else _config(), role="ref", _is_actor=False, _is_rollout=False, _is_ref=True,
        _is_offload_param=False, _is_offload_grad=False, _is_offload_optimizer=False, _ref_is_offload_param=False,
        rank=0, world_size=1, tf_config=None, hf_config=None, processor=None, tokenizer=None,
        _build_model_optimizer=build)
    w.log, w.modules, w.ref_forward = log, modules, ref_forward
    return w


def _data(n: int = 2):
    from verl.protocol import DataProto

    return DataProto.from_dict(tensors={"input_ids": torch.ones(n, 3, dtype=torch.long)},
                               meta_info={"global_token_num": [3] * n})


def _apply(ids: list[str]) -> None:
    from verl_patches.core import apply as ap
    from verl_patches.patches import load_catalogue

    reg = {p.id: p for p in load_catalogue()}
    ap.apply_all([reg[i] for i in ids])


OFFLOAD_IDS = ["verl.megatron_worker.offload_init", "verl.megatron_worker.update_offload",
               "verl.megatron_worker.generate_offload", "verl.megatron_worker.log_prob_onload",
               "verl.megatron_worker.ref_offload", "verl.megatron_worker.save_checkpoint_onload",
               "verl.megatron_worker.load_checkpoint_onload"]


def _grad_bytes(modules) -> int:
    from verl_patches.offload.megatron_memory import megatron_buffers

    return sum(b.grad_data.untyped_storage().nbytes() for m in modules for b in megatron_buffers(m))


def _param_bytes(modules) -> int:
    """Device bytes of the params' distinct storages (params are views of DDP's param_data)."""
    storages = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for m in modules for p in m.parameters()}
    return sum(storages.values())


# -- scenarios -------------------------------------------------------------------------------------

def _opt_bytes(optimizer) -> int:
    """Device bytes of the optimizer's fp32 masters and Adam state."""
    state = [v for s in optimizer.optimizer.state.values() for v in s.values() if v.dim() > 0]
    return sum(t.untyped_storage().nbytes() for t in state + optimizer.masters)


def actor_cycle(ids: list[str]) -> dict:
    """init_model -> load_checkpoint -> (generate -> old log-prob -> save -> update) x 2 through the real
    worker bodies, with the patches ``ids``. The first generation's sharding manager keeps the contract
    (offloads the params after its reshard), the second's does not (upstream's)."""
    from verl.workers.megatron_workers import ActorRolloutRefWorker as W

    from verl_patches.offload.live import live_switch

    _apply(ids)
    w = _actor_worker()
    # verl's own offload on where our init patch takes it over (on CPU it could not run: it pins memory).
    w._is_offload_param = w._is_offload_grad = w._is_offload_optimizer = "verl.megatron_worker.offload_init" in ids
    out: dict[str, Any] = {"steps": []}
    W.init_model(w)
    w.actor = w.actor_standin
    memory = stash.get(w, "actor_memory")
    out["attached"] = memory is not None and stash.get(w.sharding_manager, "actor_memory") is memory
    out["verl_flags_after_init"] = [w._is_offload_param, w._is_offload_grad, w._is_offload_optimizer]
    out["after_init"] = {"params": _param_bytes(w.modules), "grads": _grad_bytes(w.modules)}
    seen: dict[str, int] = {}
    w.checkpoint_mananager = types.SimpleNamespace(
        save_checkpoint=lambda **kw: seen.__setitem__("save", _opt_bytes(w.optimizer)),
        load_checkpoint=lambda **kw: seen.__setitem__("load", _opt_bytes(w.optimizer)))
    W.load_checkpoint(w, "unused")
    out["opt_bytes_at_load"] = seen["load"]
    out["opt_bytes_after_load"] = _opt_bytes(w.optimizer)
    for step in range(2):
        w.sharding_manager.contract = step == 0
        ledger = live_switch().ledger
        before = len(ledger.entries)
        trained = _snap(w.optimizer.params)  # what the update left, before generation offloads it
        W.generate_sequences(w, _prompts())
        moved_in_generate = [(e.step, e.h2d_bytes) for e in list(ledger.entries)[before:]]
        after_gen = {"params": _param_bytes(w.modules), "grads": _grad_bytes(w.modules),
                     "reshard_saw": w.log["params_bytes_at_reshard"], "h2d_in_generate": moved_in_generate}
        W.compute_log_prob(w, _data())
        after_lp = {"params": _param_bytes(w.modules), "in_log_prob": w.log["params_bytes_in_log_prob"]}
        W.save_checkpoint(w, "unused")
        W.update_actor(w, _data())
        out["steps"].append({
            "after_generate": after_gen, "after_log_prob": after_lp,
            "update_saw_trained_params_exactly": w.log["params_at_update"][-1] == trained,
            "grads_zero_at_update": w.log["grads_zero_at_update"][-1],
            "opt_bytes_at_save": seen["save"],
            "after_update": {"params": _param_bytes(w.modules), "grads": _grad_bytes(w.modules),
                             "opt": _opt_bytes(w.optimizer)},
        })
    out["ledger_steps"] = [e.step for e in live_switch().ledger.entries]
    if memory:
        memory.close()
    return out


def ddp_round_trip() -> dict:
    """ActorMemory on a real DDP chunk under a switch loop that keeps (copies) the grads too: bytes
    and the views DDP holds."""
    from verl_patches.offload.live import LiveSwitch, live_switch
    from verl_patches.offload.megatron_memory import ActorMemory, megatron_buffers

    _, modules, optimizer = _actor(3)
    _train_step(modules, optimizer, 1)
    for b in megatron_buffers(modules[0]):
        b.grad_data.copy_(torch.randn(b.grad_data.shape, generator=torch.Generator().manual_seed(5)))
    memory = ActorMemory(modules, optimizer, engine=live_switch().offload_engine(), keep_grads=True)
    buffers = megatron_buffers(modules[0])
    state = [v for st in optimizer.optimizer.state.values() for v in st.values() if v.dim() > 0]
    want = (_snap(b.param_data for b in buffers), _snap(b.grad_data for b in buffers), _snap(state),
            _snap(optimizer.masters))
    out: dict[str, Any] = {"cycles": []}
    switch = LiveSwitch(keep_grads=True)
    switch.attach(memory)  # where an update ends: grads and optimizer state copied out
    for _ in range(3):
        switch.reach("offload_train_params")
        resident = memory.resident()
        switch.reach("update_onload")
        got = (_snap(b.param_data for b in buffers), _snap(b.grad_data for b in buffers), _snap(state),
               _snap(optimizer.masters))
        views = all(p.main_grad.untyped_storage().data_ptr() == b.grad_data.untyped_storage().data_ptr()
                    and p.untyped_storage().data_ptr() == b.param_data.untyped_storage().data_ptr()
                    for b in buffers for p in b.params)
        buckets = all(k.grad_data.untyped_storage().data_ptr() == b.grad_data.untyped_storage().data_ptr()
                      for b in buffers for k in b.buckets)
        out["cycles"].append({"resident_offloaded": resident, "exact": [g == x for g, x in zip(got, want)],
                              "views": views, "buckets": buckets})
        switch.call("update", lambda: None)
        switch.reach("update_end")
    out["steps"] = [e.step for e in switch.ledger.entries]
    out["groups"] = {k: g.num_storages for k, g in memory.groups().items()}
    out["nbytes"] = {k: g.nbytes for k, g in memory.groups().items()}
    switch.detach(memory)
    memory.close()
    return out


def generate_without_contract() -> dict:
    """A sharding manager that does not offload: the worker's wrap does it at the end of generate."""
    from verl.workers.megatron_workers import ActorRolloutRefWorker as W

    _apply(OFFLOAD_IDS)
    w = _actor_worker(contract=False)
    W.init_model(w)
    w.actor = w.actor_standin
    W.generate_sequences(w, _prompts())
    out = {"reshard_saw": w.log["params_bytes_at_reshard"], "after": _param_bytes(w.modules)}
    stash.get(w, "actor_memory").close()
    return out


def swap_optimizer(mindspeed_loaded: bool) -> dict:
    """recipe.megatron.swap_optimizer: MindSpeed's swap optimizer (present only where MindSpeed is
    loaded; an empty module stands for it) moves the optimizer state itself, so ours leaves it."""
    import sys

    from verl.workers.megatron_workers import ActorRolloutRefWorker as W

    _apply(OFFLOAD_IDS)
    if mindspeed_loaded:
        sys.modules["mindspeed"] = types.ModuleType("mindspeed")
    try:
        w = _actor_worker(_config(**{"rollout.recipe.megatron.swap_optimizer": True}))
        W.init_model(w)
    finally:
        sys.modules.pop("mindspeed", None)
    w.actor = w.actor_standin
    W.update_actor(w, _data())
    out = {"opt_group": stash.get(w, "actor_memory").opt is not None, "grads": _grad_bytes(w.modules),
           "opt": sum(v.untyped_storage().nbytes() for s in w.optimizer.optimizer.state.values()
                      for v in s.values() if v.dim() > 0)}
    stash.get(w, "actor_memory").close()
    return out


def offload_off() -> dict:
    from verl.workers.megatron_workers import ActorRolloutRefWorker as W

    _apply(OFFLOAD_IDS)
    w = _actor_worker(_config(**{"rollout.recipe.offload": False}))
    W.init_model(w)
    w.actor = w.actor_standin
    W.update_actor(w, _data())
    return {"memory": (stash.get(w, "actor_memory") is not None), "grads": _grad_bytes(w.modules)}


def reference(ids: list[str]) -> dict:
    from verl.workers.megatron_workers import ActorRolloutRefWorker as W

    from verl_patches.offload.live import live_switch

    _apply(ids)
    w = _ref_worker()
    # verl's own (param.data.to('cpu')), on where our init patch takes it over.
    w._ref_is_offload_param = "verl.megatron_worker.offload_init" in ids
    original = _snap(w.modules[0].parameters())
    W.init_model(w)
    w.ref_policy.compute_log_prob = w.ref_forward  # MegatronPPOActor stand-in built by init_model
    out: dict[str, Any] = {"after_init": _param_bytes(w.modules), "d2h": []}
    for _ in range(2):
        ledger = live_switch().ledger
        before = len(ledger.entries)
        W.compute_ref_log_prob(w, _data())
        out["d2h"].append(sum(e.d2h_bytes for e in list(ledger.entries)[before:])
                          if stash.get(w, "ref_memory") is not None else None)
    out["forward_saw_exact"] = [b == original for b in w.log["ref_bytes_in_forward"]]
    out["verl_ref_flag"] = w._ref_is_offload_param
    out["after"] = _param_bytes(w.modules)
    return out


def reference_layout(patched: bool, role: str = "ref", tp: int = 2) -> dict:
    from verl.workers.megatron_workers import ActorRolloutRefWorker as W

    if patched:
        _apply(["verl.megatron_worker.ref_shares_actor_groups"])
    w = _ref_worker(_config(**{"ref.megatron.tensor_model_parallel_size": tp}))
    if role == "actor_rollout_ref":  # as verl 0.4.1's __init__ leaves this role: no _ref_is_offload_param
        w = _actor_worker()
        w.role, w._is_ref = role, True
    try:
        W.init_model(w)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def compile_scopes(ids: list[str]) -> dict:
    """torch.compile seen while the rollout is built (real _build_rollout body) and while it generates."""
    import verl.models.mcore as mcore
    import verl.workers.megatron_workers as mw
    import verl.workers.rollout.vllm_rollout as vr
    import verl.workers.sharding_manager.megatron_vllm as smv

    seen: dict[str, Any] = {}

    class Rollout:  # vLLM's rollout: builds the engine, where vLLM calls torch.compile
        def __init__(self, **kw):
            seen["build"] = torch.compile
            self.inference_engine = None

    vr.vLLMRollout = Rollout
    smv.MegatronVLLMShardingManager = lambda **kw: SM({}, contract=False)
    mcore.get_mcore_weight_converter = lambda *a: None
    mw.copy_to_local = lambda path, use_shm=False: path
    _apply(ids)
    w = _actor_worker()
    w.actor_module, w.actor_model_config, w.dtype = w.modules, types.SimpleNamespace(), torch.bfloat16
    w.actor = types.SimpleNamespace(actor_module=w.modules)
    mw.ActorRolloutRefWorker._build_rollout(w)
    seen["after_build"] = torch.compile
    w.rollout = types.SimpleNamespace(generate_sequences=w.generate_fn)
    w.sharding_manager = SM(w.log, contract=False)
    w.sharding_manager.actor_module_params = lambda: []
    mw.ActorRolloutRefWorker.generate_sequences(w, _prompts())
    seen["generate"] = w.log["compile_in_generate"]
    seen["after_generate"] = torch.compile
    real = __import__("verl_patches.rollout.compile_context", fromlist=["x"]).saved_real_compile()
    return {k: ("real" if v is real else "mindspeed" if v is mindspeed_dummy_compile else repr(v)) for k, v in seen.items()}


def _without(pid: str) -> list[str]:
    return [i for i in OFFLOAD_IDS if i != pid]


SCENARIOS: dict[str, Callable[[], Any]] = {
    "ddp_round_trip": ddp_round_trip,
    "actor:all": lambda: actor_cycle(OFFLOAD_IDS),
    "actor:none": lambda: actor_cycle([]),
    **{f"actor:-{pid}": (lambda pid=pid: actor_cycle(_without(pid))) for pid in OFFLOAD_IDS},
    "generate_without_contract": generate_without_contract,
    "swap_optimizer": lambda: swap_optimizer(True),
    "swap_optimizer_without_mindspeed": lambda: swap_optimizer(False),
    "offload_off": offload_off,
    "ref:all": lambda: reference(OFFLOAD_IDS),
    "ref:none": lambda: reference([]),
    **{f"ref:-{pid}": (lambda pid=pid: reference(_without(pid))) for pid in OFFLOAD_IDS},
    "layout_patched": lambda: reference_layout(True),
    "layout_unpatched": lambda: reference_layout(False),
    "layout_same_patched": lambda: reference_layout(True, tp=1),
    "role_arr_patched": lambda: reference_layout(True, role="actor_rollout_ref", tp=1),
    "role_arr_unpatched": lambda: reference_layout(False, role="actor_rollout_ref", tp=1),
    "compile_patched": lambda: compile_scopes(["verl.megatron_worker.build_rollout_compile",
                                               "verl.megatron_worker.generate_compile"]),
    "compile_unpatched": lambda: compile_scopes([]),
    "compile_-build": lambda: compile_scopes(["verl.megatron_worker.generate_compile"]),
    "compile_-generate": lambda: compile_scopes(["verl.megatron_worker.build_rollout_compile"]),
}


def run_all(rank: int, world: int) -> dict:
    os.environ["VERL_PATCHES_DEVICE"] = "cpu"
    _setup()
    from verl_patches.core import apply as ap
    from verl_patches.offload.live import reset_live_switch

    results = {}
    for name, fn in SCENARIOS.items():
        reset_live_switch()  # a fresh switch loop, with a fresh process engine (each builds its own models)
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - reported to the test, which names the scenario
            import traceback

            results[name] = {"exception": traceback.format_exc()}
        finally:
            ap.undo()
    return results


# -- on a GPU: megatron-core's own optimizer -------------------------------------------------------

def real_optimizer_continuation(rank: int, world: int, steps: int = 3) -> dict:
    """An actor trained with megatron-core's real DistributedOptimizer (bf16 params, fp32 masters, Adam),
    going through the switch schedule's offloads between steps (grads, optimizer state and params
    copied out and back over pinned buffers on a side stream). Every byte the next step reads must come
    back exactly, the offloads must free device memory for real, and training must go on."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from verl_patches.base import accelerator
    from verl_patches.offload import OffloadEngine
    from verl_patches.offload.live import LiveSwitch
    from verl_patches.offload.megatron_memory import ActorMemory, inner_optimizers

    import megatron.core.optimizer.distrib_optimizer as dopt

    # megatron-core 0.12.1's DistributedOptimizer calls Transformer Engine's FP8 cast on every step and
    # raises without TE; with no FP8 params there is nothing to cast, so a no-op stands for it.
    dopt.quantize_param_shard = lambda *a, **k: None
    mpu.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    tc = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, params_dtype=torch.bfloat16,
                           bf16=True, add_bias_linear=False)
    # As verl.utils.megatron_utils.get_model wraps it: bf16 module (Float16Module), then DDP.
    model = Float16Module(tc, GPTModel(tc, get_gpt_layer_local_spec(), vocab_size=512, max_sequence_length=64).cuda())
    ddp = DDP(config=tc, module=model, ddp_config=DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=True, grad_reduce_in_fp32=True))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16,
                                                 use_distributed_optimizer=True, clip_grad=1.0), [ddp])
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    pos = torch.arange(64, device="cuda").unsqueeze(0).expand(2, -1)

    def train() -> float:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(tokens, pos, None).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok
        return float(loss.detach())

    def state() -> list[torch.Tensor]:
        inner = inner_optimizers(opt)
        return ([p.detach().clone() for p in ddp.parameters()]
                + [p.main_grad.detach().clone() for p in ddp.parameters()]
                + [t.detach().clone() for o in inner for g in o.param_groups for t in g["params"]]
                + [v.detach().clone() for o in inner for st in o.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor)])

    memory = ActorMemory([ddp], opt, engine=OffloadEngine(), keep_grads=True)
    out: dict[str, Any] = {"optimizer": type(opt).__name__, "inner": [type(o).__name__ for o in inner_optimizers(opt)],
                           "freed": [], "round_trip_exact": [], "losses": []}
    switch = LiveSwitch(keep_grads=True)
    for k in range(steps):
        # The first step before the memory joins the loop (Adam's state exists after it), the others as
        # the loop's update step.
        out["losses"].append(switch.call("update", train) if k else train())
        accelerator.synchronize()
        held = state()
        before = torch.cuda.memory_allocated()
        if k:
            switch.reach("update_end")
        else:
            switch.attach(memory)  # put where an update ends
        switch.reach("offload_train_params")  # empties the cache
        out["freed"].append({"allocator_bytes": before - torch.cuda.memory_allocated(),
                             "groups_bytes": sum(g.nbytes for g in memory.groups().values()),
                             "resident_after": memory.resident()})
        switch.reach("update_onload")
        out["round_trip_exact"].append(len(held) > 0 and all(torch.equal(x, y) for x, y in zip(held, state())))
    out["losses"].append(switch.call("update", train))
    switch.reach("update_end")
    out["ledger"] = switch.ledger.format_table()
    switch.detach(memory)
    memory.close()
    return out
