"""Per-rank body of the 8-process DP-domain test: real vLLM groups on gloo, patched and unpatched.

Run by test_dp_domain_dist.py (next to it) through run_distributed; one spawn of 8
processes serves every check (importing vLLM 8 times on 2 cores is the expensive part).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any


class _Recorder:
    """Wraps torch.distributed.all_reduce to name the group each call used."""

    def __init__(self, dist, names: dict[int, str]):
        self.dist, self.names, self.calls = dist, names, []
        self.inner = dist.all_reduce

    def __enter__(self):
        def all_reduce(tensor, op=self.dist.ReduceOp.SUM, group=None, async_op=False):
            self.calls.append(self.names.get(id(group), "other"))
            return self.inner(tensor, op=op, group=group, async_op=async_op)

        self.dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        self.dist.all_reduce = self.inner

    def take(self) -> list[str]:
        out, self.calls = list(self.calls), []
        return out


def dp_domain_rank(rank: int, world: int, spec_fields: dict[str, int]) -> dict[str, Any]:
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"
    from verl_patches.rigs.testing.upstream_env import prepare_cpu_upstream

    prepare_cpu_upstream()
    import torch.distributed as dist
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as vps
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group
    from vllm.forward_context import DPMetadata
    from vllm.utils import get_ip

    from verl_patches.core.apply import apply_all, undo
    from verl_patches.patches.vllm import patch_config, patch_distributed_parallel_state, patch_forward_context
    from verl_patches.patches.vllm_ascend.patch_worker_model_runner_v1 import wrap_get_forward_metadata_across_dp
    from verl_patches.rollout.dp_domain import DPDomainError, DPSpec, setup_dp_domain
    from verl_patches.rollout.dp_sync import FLAG_ENV

    spec = DPSpec(**spec_fields)
    out: dict[str, Any] = {}
    dom = setup_dp_domain(spec, get_ip())  # the rollout patch's call: a collective over the job's world
    out["domain"] = {"group_index": dom.group_index, "dp_rank": dom.dp_rank, "dp_group": list(dom.dp_group),
                     "ep_group": list(dom.ep_group), "port": dom.master_port}

    patches = patch_distributed_parallel_state.PATCHES + patch_config.PATCHES + patch_forward_context.PATCHES
    out["applied"] = apply_all(patches)
    cfg = VllmConfig(device_config=DeviceConfig("cpu"))  # ParallelConfig reads VLLM_DP_* here
    cfg.parallel_config.enable_expert_parallel = True
    pc = cfg.parallel_config
    out["config"] = {"dp_size": pc.data_parallel_size, "dp_rank": pc.data_parallel_rank,
                     "master_ip": pc.data_parallel_master_ip, "master_port": pc.data_parallel_master_port}
    with set_current_vllm_config(cfg):
        # What vLLM's worker does in verl's external-launcher mode: world = TP x PP of one engine.
        vps.init_distributed_environment(spec.tp_size, rank, "env://", rank, "gloo")
        vps.initialize_model_parallel(spec.tp_size, 1, backend="gloo")
        dpc = vps.get_dp_group()
        out["groups"] = {"dp": list(dpc.ranks), "ep": list(vps.get_ep_group().ranks),
                         "tp": list(vps.get_tp_group().ranks), "dp_rank_in_group": dpc.rank_in_group}
        # The engine's stateless DP group, as LLMEngine makes it: a rendezvous on this group's port.
        stateless = pc.stateless_init_dp_group()
        out["stateless"] = {"size": stateless.size(), "rank": stateless.rank()}
        names = {id(dpc.device_group): "device", id(dpc.cpu_group): "cpu", id(stateless): "stateless"}

        # Only DP rank 0 of DP group 0 is unfinished: every member of group 0 must see True, others False.
        mine = dom.group_index == 0 and dom.dp_rank == 0
        with _Recorder(dist, names) as rec:
            out["unfinished"] = ParallelConfig.has_unfinished_dp(stateless, mine)
            out["unfinished_groups"] = rec.take()
            out["tokens"] = DPMetadata.num_tokens_across_dp(100 + rank, spec.dp_size, dom.dp_rank).tolist()
            out["tokens_groups"] = rec.take()
            # vLLM-Ascend's agreement through our wrapper; the runner is a stand-in (the real
            # NPUModelRunner needs torch_npu), the groups and the collective are vLLM's real ones.
            def must_not_run(*a, **k):
                raise AssertionError("the upstream gloo agreement ran")

            agree = wrap_get_forward_metadata_across_dp(must_not_run)
            for torchair in (False, True):
                runner = SimpleNamespace(dp_size=spec.dp_size, dp_rank=dom.dp_rank, is_kv_producer=False,
                                         is_kv_consumer=False, torchair_graph_enabled=torchair)
                # Group 0 prefills on DP rank 1 only; graph decode pads to 16 where a rank decodes.
                prefill = dom.group_index == 0 and dom.dp_rank == 1
                padded = rank + 1 if prefill else 16
                local, counts, wp, dbo = agree(runner, padded, rank + 1, prefill, rank != 2)
                out[f"agree_torchair_{torchair}"] = {"local": local, "counts": counts.tolist(), "prefill": wp,
                                                     "dbo": dbo, "device": str(counts.device)}
            out["agree_groups"] = rec.take()
            os.environ[FLAG_ENV] = "0"
            out["unfinished_flag_off"] = ParallelConfig.has_unfinished_dp(stateless, mine)
            out["flag_off_groups"] = rec.take()
            os.environ.pop(FLAG_ENV)
            undo()
            out["unfinished_unpatched"] = ParallelConfig.has_unfinished_dp(stateless, mine)
            out["unpatched_groups"] = rec.take()
            out["tokens_unpatched"] = DPMetadata.num_tokens_across_dp(100 + rank, spec.dp_size, dom.dp_rank).tolist()
            out["tokens_unpatched_groups"] = rec.take()
        stateless_destroy_torch_distributed_process_group(stateless)
        vps.destroy_model_parallel()

    # A vLLM config made before VLLM_DP_* was published: DP 1. Every rank sees the same config,
    # so every rank refuses before any group is created (no rank is left waiting in new_group).
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("VLLM_DP_")}
    stale = VllmConfig(device_config=DeviceConfig("cpu"))
    os.environ.update(saved)
    apply_all(patch_distributed_parallel_state.PATCHES)
    with set_current_vllm_config(stale):
        try:
            vps.initialize_model_parallel(spec.tp_size, 1, backend="gloo")
            out["stale_patched"] = "built"
        except DPDomainError as e:
            out["stale_patched"] = str(e)
        undo()
        vps.initialize_model_parallel(spec.tp_size, 1, backend="gloo")
        out["stale_unpatched_ep"] = list(vps.get_ep_group().ranks)
        vps.destroy_model_parallel()
    dist.barrier()
    return out
