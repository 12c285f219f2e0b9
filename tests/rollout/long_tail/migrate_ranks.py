"""Per-rank body for test_migrate.py (next to it): spawned processes import it by name."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[3]


def tiny_model(layers: int = 2):
    """The tiny run's DeepSeek-V3 config (configs/model/tiny_deepseek_v3.json) with ``layers`` layers,
    seeded weights (the same on every rank), bf16 as in the tiny run."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = json.loads((REPO / "configs" / "model" / "tiny_deepseek_v3.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version", "torch_dtype")}
    cfg["num_hidden_layers"] = layers
    config = DeepseekV3Config(**cfg)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16).eval()
        with torch.no_grad():  # sharper distributions than the initialisation's near-uniform ones
            model.lm_head.weight.mul_(20)
    return model


def workload(rank: int):
    """The forced imbalance: rank 0 holds 10 requests, the others 2, 1 and 1; response lengths vary
    (ignore_eos, max_tokens 2..9) so ranks empty at different steps; per-request seeds (vLLM's
    SamplingParams.seed) on ranks 0 and 1, drawn from the rank's stream on ranks 2 and 3."""
    from vllm import SamplingParams

    counts = [10, 2, 1, 1]
    g = torch.Generator().manual_seed(100 + rank)
    prompts, params = [], []
    for i in range(counts[rank]):
        length = int(torch.randint(3, 9, (1,), generator=g))
        prompts.append(torch.randint(5, 990, (length,), generator=g).tolist())
        seed = 1000 * rank + i if rank < 2 else None
        params.append(SamplingParams(n=1, temperature=0.8, top_k=50, top_p=0.95, max_tokens=2 + (3 * i + rank) % 8,
                                     ignore_eos=True, logprobs=0, seed=seed))
    return prompts, params


def rebalance_rank(rank: int, world: int) -> dict:
    """The same workload three times: without rebalance, with it, and with it but a move that drops the
    sampling generator's state (the negative control). Tokens and log-probs per request, and the stats."""
    from verl_patches.rigs.cpu import engine
    from verl_patches.rollout.long_tail import rebalance as rb
    from verl_patches.rollout.long_tail.migrate import Lockstep

    model = tiny_model()
    prompts, params = workload(rank)
    group = dist.new_group(list(range(world)), backend="gloo")
    out: dict = {}
    for mode in ("off", "on", "no_generator_state"):
        torch.manual_seed(7 + rank)  # the rank's generation stream (verl sets it per DP group)
        seeds = engine.request_seeds(params, [0] * len(params))
        lockstep = None
        if mode != "off":
            lockstep = Lockstep(group, rb.RebalancePolicy(enabled=True), (1, 2, 4, 8, 16), 16)
        unpack = engine.RequestState.unpack
        if mode == "no_generator_state":
            def unpack_fresh(d, _unpack=unpack):
                return _unpack({**d, "generator": torch.Generator().manual_seed(0).get_state()})
            engine.RequestState.unpack = classmethod(lambda cls, d: unpack_fresh(d))
        try:
            seqs = engine._sample(model, prompts, params, eos=1, pad=0, seeds=seeds, lockstep=lockstep, capacity=16)
        finally:
            engine.RequestState.unpack = unpack
        out[mode] = {
            "tokens": [list(s[0]) for s in seqs],
            "logprobs": [[next(iter(d.values())).logprob for d in s[2]] for s in seqs],
            "reasons": [s[1] for s in seqs],
            "stats": None if lockstep is None else vars(lockstep.stats),
        }
    out["lengths"] = [len(p) for p in prompts]
    out["max_tokens"] = [int(p.max_tokens) for p in params]
    return out


def thread_check_rank(rank: int, world: int) -> str:
    """The stand-in's lockstep over a DP group whose ranks run at different torch thread counts (rank r
    at r + 1): refused by name. The DP group is a gloo group standing in for vLLM's (its cpu_group,
    world_size and rank_in_group are what the lockstep reads)."""
    from types import SimpleNamespace

    from vllm.distributed import parallel_state as ps

    from verl_patches.rigs.cpu import engine
    from verl_patches.rollout.long_tail import rebalance as rb

    group = dist.new_group(list(range(world)), backend="gloo")
    coord = SimpleNamespace(cpu_group=group, world_size=world, rank_in_group=rank)
    generator = engine._Generator(SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4)), None)
    setup = SimpleNamespace(policy=rb.RebalancePolicy(enabled=True), stagger=0)
    original = ps.get_dp_group
    ps.get_dp_group = lambda: coord
    try:
        torch.set_num_threads(1)
        generator._lockstep(setup)  # the same count everywhere: accepted
        torch.set_num_threads(rank + 1)
        try:
            generator._lockstep(setup)
        except engine.CpuEngineError as e:
            return str(e)
        return "accepted"
    finally:
        ps.get_dp_group = original
