"""Rank function for the TensorCache binding test: verl 0.4.1's real ActorRolloutRefWorker
generate_sequences / compute_ref_log_prob / update_actor bodies on 2 gloo ranks, driven through the
overlay's driver wrappers. Stand-ins: the model parts (rollout, reference forward, actor update),
which need a device, and Ray (each rank plays the driver identically and keeps its own chunk, as
verl's DP_COMPUTE_PROTO / MEGATRON_COMPUTE_PROTO dispatch would give it).
"""

from __future__ import annotations

import hashlib
import types

import numpy as np
import torch
import torch.distributed as dist

N, PROMPTS, P, R = 2, 4, 3, 5


def _digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode() + tensors[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _cpu_device_stubs():
    import verl.utils.debug.performance as perf
    import verl.workers.megatron_workers as mw

    dev = types.SimpleNamespace(empty_cache=lambda: None, memory_allocated=lambda: 0, memory_reserved=lambda: 0,
                                mem_get_info=lambda: (0, 0), current_device=lambda: "cpu")
    mw.get_torch_device = lambda: dev  # torch.cpu has no empty_cache / memory stats in torch 2.5
    mw.get_device_id = lambda: "cpu"
    perf.get_torch_device = lambda: dev
    mw.reduce_timing = lambda timing: timing  # all_reduce(AVG) of timings: gloo has no AVG


def _worker(seen: dict):
    from omegaconf import OmegaConf
    from verl.protocol import DataProto

    def generate(prompts):
        ids = prompts.batch["input_ids"].repeat_interleave(N, 0)
        resp = (ids[:, -1:] * 31 + torch.arange(R)) % 101
        mask = torch.cat([prompts.batch["attention_mask"].repeat_interleave(N, 0), torch.ones_like(resp)], 1)
        # rollout_log_probs: what verl's vLLM rollout adds with rollout.calculate_log_probs=True (the recipe).
        return DataProto.from_dict(tensors={"prompts": ids, "responses": resp, "input_ids": torch.cat([ids, resp], 1),
                                            "attention_mask": mask, "position_ids": torch.cumsum(mask, 1) - 1,
                                            "rollout_log_probs": -(resp.float() % 11) / 11 - 0.05})

    def ref_log_prob(data, calculate_entropy=False):
        return -(data.batch["input_ids"][:, -R:].float() % 7) / 7 - 0.1, None

    def actor_log_prob(data, calculate_entropy=False):
        lp = -(data.batch["input_ids"][:, -R:].float() % 5) / 5 - 0.2
        return lp, -lp

    def make_minibatch_iterator(data):
        seen["update"] = {k: data.batch[k].clone() for k in data.batch.keys()}
        return iter([data])

    class SM:
        timing = {}

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        preprocess_data = staticmethod(lambda d: d)
        postprocess_data = staticmethod(lambda d: d)

    cfg = OmegaConf.create({"ref": {"log_prob_micro_batch_size_per_gpu": 2, "log_prob_max_token_len_per_gpu": 64,
                                    "log_prob_use_dynamic_bsz": False},
                            "rollout": {"temperature": 1.0, "log_prob_micro_batch_size_per_gpu": 2,
                                        "log_prob_max_token_len_per_gpu": 64, "log_prob_use_dynamic_bsz": False},
                            "actor": {"ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": 1}})
    return types.SimpleNamespace(
        config=cfg, _is_rollout=True, _is_ref=True, _is_actor=True, _is_offload_param=False,
        _is_offload_optimizer=False, _ref_is_offload_param=False, generation_config=None,
        tokenizer=types.SimpleNamespace(eos_token_id=0, pad_token_id=0), sharding_manager=SM(),
        rollout=types.SimpleNamespace(generate_sequences=generate),
        ref_policy=types.SimpleNamespace(compute_log_prob=ref_log_prob),
        actor=types.SimpleNamespace(make_minibatch_iterator=make_minibatch_iterator, update_policy=lambda dataloader: {},
                                    compute_log_prob=actor_log_prob),
        flops_counter=types.SimpleNamespace(estimate_flops=lambda *a: (1.0, 1.0)), world_size=dist.get_world_size(),
        actor_optimizer=types.SimpleNamespace(param_groups=[{"lr": 1e-6}]),
        actor_optimizer_scheduler=types.SimpleNamespace(step=lambda n: None),
    )


class _Group:
    """The driver's worker group on this rank: the chunk verl's dispatch gives this rank, the real
    worker body, and the outputs of all ranks gathered (Ray's role) and collected as verl does."""

    def __init__(self, worker, sent: dict):
        from verl.workers.megatron_workers import ActorRolloutRefWorker

        self.W, self.worker, self.sent = ActorRolloutRefWorker, worker, sent
        self.world_size = dist.get_world_size()

    def _gather(self, out):

        outs = [None] * self.world_size
        dist.all_gather_object(outs, out)
        return outs

    def generate_sequences(self, data):  # DP_COMPUTE_PROTO: rank r gets chunk r, outputs concatenated
        from verl.protocol import DataProto

        self.sent["generate_sequences"] = sorted(data.batch.keys())
        out = self.W.generate_sequences(self.worker, data.chunk(self.world_size)[dist.get_rank()])
        return DataProto.concat(self._gather(out))

    def _megatron(self, name, data):  # MEGATRON_COMPUTE_PROTO with DP 1 (TP2): both ranks get the batch
        self.sent[name] = sorted(data.batch.keys())
        out = getattr(self.W, name)(self.worker, data.chunk(1)[0])
        return self._gather(out)[0]  # collect: the tp-rank-0 output

    def compute_ref_log_prob(self, data):
        return self._megatron("compute_ref_log_prob", data)

    def compute_log_prob(self, data):
        return self._megatron("compute_log_prob", data)

    def update_actor(self, data):
        return self._megatron("update_actor", data)


def all_modes(rank: int, world: int) -> dict:
    """Each mode of the step, in one spawn: upstream and cached, with the old log-prob skipped (the
    recipe) or recomputed, and cached with each worker patch left out in turn (or all of them)."""
    from verl_patches.core.apply import apply_all, undo
    from verl_patches.patches.verl import patch_workers_megatron_workers_tensor_cache as workers

    _cpu_device_stubs()
    # The module's other patches (the switch schedule, torch.compile) are tested in test_megatron_worker_memory.py.
    cache_patches = [p for p in workers.PATCHES if p.id.startswith("verl.tensor_cache.")]
    res = {"off": step(False, False), "off_recompute": step(False, True), "unpatched": step(True, False)}
    for left_out in [None] + [p.id for p in cache_patches]:
        apply_all([p for p in cache_patches if p.id != left_out])
        try:
            if left_out is None:
                res["on"], res["on_recompute"] = step(True, False), step(True, True)
            else:
                res[f"without {left_out}"] = step(True, True)
        finally:
            undo()
    return res


def step(cache_on: bool, recompute: bool) -> dict:
    try:
        return _step(cache_on, recompute)
    except Exception as e:  # noqa: BLE001 - a mode that cannot run is a result (every rank fails alike)
        return {"error": f"{type(e).__name__}: {e}"}


def _step(cache_on: bool, recompute: bool) -> dict:
    from omegaconf import OmegaConf
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage, compute_response_mask

    from verl_patches.patches.verl import patch_trainer_ppo_ray_trainer as driver

    seen, sent = {}, {}
    wg = _Group(_worker(seen), sent)
    if not recompute:
        wg.compute_log_prob = driver.skipped_compute_log_prob  # the recipe: old log-prob reuse
    if cache_on:
        trainer = types.SimpleNamespace(config=OmegaConf.create({"algorithm": {"use_kl_in_reward": False}}),
                                        actor_rollout_wg=wg, use_reference_policy=True, ref_in_actor=True)
        driver.install_tensor_cache(trainer)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (PROMPTS, P), generator=g)
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                         "position_ids": torch.arange(P).expand(PROMPTS, -1).clone()},
                                non_tensors={"uid": np.array([str(i) for i in range(PROMPTS)], dtype=object)})
    gen = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
    out = wg.generate_sequences(gen)
    batch = batch.repeat(N, interleave=True).union(out)
    batch.batch["response_mask"] = compute_response_mask(batch)
    batch.reorder(torch.randperm(len(batch), generator=torch.Generator().manual_seed(1)))  # as batch balancing does
    batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()
    old = wg.compute_log_prob(batch)  # fit(): entropy metric from entropys, then union
    entropy = float(old.batch["entropys"].mean())
    old.batch.pop("entropys")
    batch = batch.union(old)
    batch = batch.union(wg.compute_ref_log_prob(batch))
    scores = torch.zeros(len(batch), R)
    scores[:, -1] = (batch.batch["responses"][:, 0] % 2).float()
    batch.batch["token_level_scores"] = batch.batch["token_level_rewards"] = scores
    batch = compute_advantage(batch, adv_estimator="grpo", num_repeat=N)
    wg.update_actor(batch)
    keys = ["input_ids", "attention_mask", "position_ids", "responses", "advantages", "ref_log_prob", "rollout_log_probs"]
    keys += ["old_log_probs"] if recompute else []
    return {"digest": _digest({k: seen["update"][k] for k in keys}), "sent": sent, "entropy": entropy,
            "update_keys": sorted(seen["update"]), "host_keys": sorted(out.batch.keys())}
