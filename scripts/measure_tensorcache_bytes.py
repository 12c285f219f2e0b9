"""Bytes the driver serialises to its workers per GRPO training step, with and without the TensorCache,
on a local CPU Ray cluster through verl 0.4.1's real RayWorkerGroup, dispatch modes and DataProto.

Ray actors, TP x PP x DP2 of them (--tp/--pp, default TP2 PP2: eight), form one torch.distributed (gloo)
world with real megatron-core parallel_state. They stand in for ActorRolloutRefWorker only in what their methods compute (no
model: responses and log-probs are deterministic functions of the tokens); the methods carry verl's
dispatch modes and are wrapped by the overlay's own worker-side TensorCache wrappers, and the driver
uses the overlay's driver-side wrappers. One step runs the calls of RayPPOTrainer.fit in its order
(generate, repeat/union, response mask, batch balancing, reward, old log-prob skipped as the recipe
does, reference, GRPO advantages, update). Bytes are counted where Ray serialises: every argument of
every remote call and every ray.put (verl's Megatron dispatch puts each DP chunk once), measured
with Ray's own serializer. The update reports a digest of the tensors it received, so the cached path
is checked to feed the update bit-identical inputs.

    python scripts/measure_tensorcache_bytes.py [--prompts 8 --n 8 --prompt-len 1024 --response-len 3072]
    [--json OUT] [--markdown]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from verl.single_controller.base.decorator import Dispatch, register  # noqa: E402
from verl.single_controller.base.megatron.worker import MegatronWorker  # noqa: E402

from verl_patches.patches.verl import patch_workers_megatron_workers_tensor_cache as worker_side  # noqa: E402

DP = 2  # the data-parallel ranks: the TensorCache's saving is per DP chunk


def _digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        h.update(k.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())
    return h.hexdigest()


class StageWorker(MegatronWorker):
    """What ActorRolloutRefWorker's four step methods compute, without a model."""

    def __init__(self, n: int, response_len: int, tp: int, pp: int):
        super().__init__()
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        self.n, self.response_len = n, response_len

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts):
        from verl.protocol import DataProto

        ids = prompts.batch["input_ids"].repeat_interleave(self.n, 0)
        mask = prompts.batch["attention_mask"].repeat_interleave(self.n, 0)
        rows = ids.shape[0]
        # Responses: a deterministic function of the prompt and the sample index (vLLM's job).
        seed = (ids[:, -1] * 1_000_003 + torch.arange(rows) % self.n).to(torch.int64)
        resp = (seed[:, None] * 6_364_136_223 + torch.arange(self.response_len)[None] * 1_442_695) % 32000
        resp_mask = torch.ones_like(resp)
        resp_mask[:, -(seed % 7)[0] - 1:] = 0  # varying valid lengths
        full_mask = torch.cat([mask, resp_mask], 1)
        out = DataProto.from_dict(tensors={
            "prompts": ids, "responses": resp, "input_ids": torch.cat([ids, resp], 1),
            "attention_mask": full_mask, "position_ids": torch.clamp(torch.cumsum(full_mask, 1) - 1, min=0),
        }, meta_info={"timing": {}})
        return out.to("cpu")

    def _log_probs(self, data, scale: float):
        x = data.batch["input_ids"][:, -self.response_len:].to(torch.float32)
        return -(torch.remainder(x * scale, 97.0) / 97.0) - 0.01

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_log_prob(self, data):
        from verl.protocol import DataProto

        lp = self._log_probs(data, 1.3)
        return DataProto.from_dict(tensors={"old_log_probs": lp, "entropys": -lp}).to("cpu")

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data):
        from verl.protocol import DataProto

        return DataProto.from_dict(tensors={"ref_log_prob": self._log_probs(data, 0.7)}).to("cpu")

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def update_actor(self, data):
        from verl.protocol import DataProto

        keys = ["input_ids", "attention_mask", "position_ids", "responses", "advantages", "ref_log_prob",
                "old_log_probs"]
        import torch.distributed as dist

        seen = {k: data.batch[k] for k in keys if k in data.batch.keys()}
        # Every rank's digest (TP/PP replicas included): the collect step keeps only one rank's reply.
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, _digest(seen))
        return DataProto(meta_info={"metrics": {"digest": digests, "keys": sorted(seen)}})


# The overlay's worker-side TensorCache wrappers, exactly as the patches install them on
# ActorRolloutRefWorker (they act only on requests the cache-aware driver marks).
StageWorker.generate_sequences = worker_side.wrap_generate_sequences(StageWorker.generate_sequences)
StageWorker.compute_log_prob = worker_side.wrap_compute_log_prob(StageWorker.compute_log_prob)
StageWorker.compute_ref_log_prob = worker_side.wrap_compute_ref_log_prob(StageWorker.compute_ref_log_prob)
StageWorker.update_actor = worker_side.wrap_update_actor(StageWorker.update_actor)


class ByteCounter:
    """Counts the bytes Ray serialises for remote-call arguments and ray.put, per stage."""

    def __init__(self):
        import ray

        self.ray = ray
        self.by_stage: dict[str, int] = {}
        self.stage = "?"
        self._orig_put = ray.put

    def size(self, obj) -> int:
        ctx = self.ray._private.worker.global_worker.get_serialization_context()
        return int(ctx.serialize(obj).total_bytes)

    def add(self, n: int) -> None:
        self.by_stage[self.stage] = self.by_stage.get(self.stage, 0) + n

    def install(self, wg) -> None:
        counter = self
        orig_put = self._orig_put

        def put(value, *a, **kw):
            counter.add(counter.size(value))
            return orig_put(value, *a, **kw)

        self.ray.put = put
        orig_exec = wg._execute_remote_single_worker

        def execute(worker, method_name, *args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                if not isinstance(a, self.ray.ObjectRef):  # refs were counted at ray.put
                    counter.add(counter.size(a))
            return orig_exec(worker, method_name, *args, **kwargs)

        wg._execute_remote_single_worker = execute

    def uninstall(self) -> None:
        self.ray.put = self._orig_put


def _host_batch(prompts: int, prompt_len: int, seed: int):
    from verl.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 32000, (prompts, prompt_len), generator=g)
    mask = torch.ones(prompts, prompt_len, dtype=torch.int64)
    for i in range(prompts):
        mask[i, : int(torch.randint(0, prompt_len // 2, (1,), generator=g))] = 0  # left padding
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": torch.clamp(torch.cumsum(mask, 1) - 1, min=0)},
        non_tensors={"raw_prompt_ids": np.array([list(map(int, r[:4])) for r in ids], dtype=object),
                     "data_source": np.array(["deepscaler"] * prompts, dtype=object),
                     "reward_model": np.array([{"ground_truth": str(i)} for i in range(prompts)], dtype=object)},
    )


def one_step(wg, counter: ByteCounter, args, seed: int) -> dict:
    """The calls of RayPPOTrainer.fit for one GRPO step, in its order, with its host computations."""
    import types
    import uuid

    from verl.trainer.ppo.core_algos import agg_loss
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage, compute_response_mask

    from verl_patches.patches.verl.patch_trainer_ppo_ray_trainer import skipped_compute_log_prob

    batch = _host_batch(args.prompts, args.prompt_len, seed)
    gen_batch = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"], non_tensor_batch_keys=["raw_prompt_ids"])
    counter.stage = "generate"
    out = wg.generate_sequences(gen_batch)
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
    batch = batch.repeat(repeat_times=args.n, interleave=True).union(out)
    batch.batch["response_mask"] = compute_response_mask(batch)
    # verl's own balancing (balance_batch=True by default): reorders the batch on the host.
    RayPPOTrainer._balance_batch(types.SimpleNamespace(actor_rollout_wg=wg), batch, metrics={})
    batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
    # Rule reward on the host (decodes prompts and responses; here: a deterministic score).
    scores = torch.zeros_like(batch.batch["responses"], dtype=torch.float32)
    valid = batch.batch["response_mask"].sum(-1)
    scores[torch.arange(len(batch)), valid - 1] = (batch.batch["responses"][:, 0] % 2).float()
    # old log-prob: recompute_old_log_prob=False (the recipe) -> no worker call.
    old = skipped_compute_log_prob(batch)
    agg_loss(loss_mat=old.batch["entropys"], loss_mask=batch.batch["response_mask"], loss_agg_mode="token-mean")
    old.batch.pop("entropys")
    batch = batch.union(old)
    counter.stage = "ref"
    batch = batch.union(wg.compute_ref_log_prob(batch))
    batch.batch["token_level_scores"] = scores
    batch.batch["token_level_rewards"] = scores
    batch = compute_advantage(batch, adv_estimator="grpo", num_repeat=args.n)
    counter.stage = "update"
    res = wg.update_actor(batch)
    return {"digest": res.meta_info["metrics"]["digest"], "keys": res.meta_info["metrics"]["keys"],
            "bytes": dict(counter.by_stage)}


def measure(args) -> dict:
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool
    from verl.single_controller.ray.megatron import NVMegatronRayWorkerGroup

    from verl_patches.patches.verl import patch_trainer_ppo_ray_trainer as driver_side

    t0 = time.time()
    # Logical CPUs for the single-CPU bundles verl's resource pool asks for, one a worker (the actors idle mostly).
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    try:
        pool = RayResourcePool(process_on_nodes=[args.workers], use_gpu=False, max_colocate_count=1)
        cls = RayClassWithInitArgs(cls=ray.remote(StageWorker), n=args.n, response_len=args.response_len,
                                   tp=args.tp, pp=args.pp)
        wg = NVMegatronRayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu")
        started = time.time() - t0
        import types

        from omegaconf import OmegaConf

        results = {}
        counter = ByteCounter()
        counter.install(wg)
        try:
            for mode in ("upstream", "tensor_cache"):
                if mode == "tensor_cache":
                    # What the patched RayPPOTrainer.init_workers does after building the worker groups.
                    trainer = types.SimpleNamespace(
                        config=OmegaConf.create({"algorithm": {"use_kl_in_reward": False}}),
                        actor_rollout_wg=wg, use_reference_policy=True, ref_in_actor=True)
                    driver_side.install_tensor_cache(trainer)
                counter.by_stage = {}
                results[mode] = one_step(wg, counter, args, seed=args.seed)
        finally:
            counter.uninstall()
        results["startup_s"] = round(started, 1)
        results["total_s"] = round(time.time() - t0, 1)
        return results
    finally:
        ray.shutdown()


def markdown(res: dict, args) -> str:
    up, tc = res["upstream"]["bytes"], res["tensor_cache"]["bytes"]
    stages = ["generate", "ref", "update"]
    mb = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    lines = ["| stage | upstream verl (MiB) | TensorCache (MiB) | ratio |", "|---|---|---|---|"]
    for s in stages:
        a, b = up.get(s, 0), tc.get(s, 0)
        lines.append(f"| {s} | {mb(a)} | {mb(b)} | {a / b:.1f}x |" if b else f"| {s} | {mb(a)} | {mb(b)} | - |")
    ta, tb = sum(up.values()), sum(tc.values())
    lines.append(f"| **step** | **{mb(ta)}** | **{mb(tb)}** | **{ta / tb:.1f}x** |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from verl_patches.base.schema import Integer, PathArg
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=Integer(low=1), default=8)
    p.add_argument("--n", type=Integer(low=1), default=8, help="samples per prompt (sequences = prompts x n)")
    p.add_argument("--prompt-len", type=Integer(low=1), default=1024)
    p.add_argument("--response-len", type=Integer(low=1), default=3072)
    p.add_argument("--tp", type=Integer(low=1), default=2, help="tensor-parallel size of the workers' megatron groups")
    p.add_argument("--pp", type=Integer(low=1), default=2, help="pipeline-parallel size (workers = TP x PP x DP2)")
    p.add_argument("--seed", type=Integer(low=0), default=0)
    p.add_argument("--json", type=PathArg("output file"), default=None)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    args.workers = args.tp * args.pp * DP
    for name in ("prompts", "n", "prompt_len", "response_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prompts % args.workers:
        # verl's dispatch splits the prompts into one equal chunk per worker before they are repeated.
        p.error(f"--prompts {args.prompts} must be a multiple of the workers, TP{args.tp} x PP{args.pp} x DP{DP} = "
                f"{args.workers}")
    res = measure(args)
    same = res["upstream"]["digest"] == res["tensor_cache"]["digest"]
    up, tc = sum(res["upstream"]["bytes"].values()), sum(res["tensor_cache"]["bytes"].values())
    res.update(identical_update_inputs=same, ratio=up / max(tc, 1), sequences=args.prompts * args.n,
               tokens=args.prompt_len + args.response_len, machine=f"{platform.node()} {platform.processor() or platform.machine()}, "
               f"{os.cpu_count()} cores", python=platform.python_version())
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("upstream", "tensor_cache")}
                     | {"bytes_upstream": res["upstream"]["bytes"], "bytes_tensor_cache": res["tensor_cache"]["bytes"]}))
    if args.markdown:
        print(markdown(res, args))
    if not same:
        print("ERROR: the update received different inputs with the TensorCache", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
