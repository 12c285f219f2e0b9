"""The rebalance mechanism (verl_patches/rollout/long_tail/migrate.py) with the CPU generation stand-in
(verl_patches/rigs/cpu/engine.py): moving unfinished requests between DP ranks mid-generation changes no
token and no log-prob of any request.

Stand-ins, declared: the model is transformers' DeepseekV3 (the CPU stand-in's generator) built
directly with the tiny run's config and seeded weights, not loaded from vLLM's parameters; the DP
group is a gloo group over 4 spawned processes, not vLLM's. The policy, the transfer and the restore
are the overlay's own code; vLLM's SamplingParams and Logprob are the real classes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from verl_patches.launch.local_ranks import run_distributed
from verl_patches.rollout.long_tail import rebalance as rb
from verl_patches.rollout.long_tail.migrate import MigrateError, eager_graph_sizes

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import the body by name
from migrate_ranks import rebalance_rank, thread_check_rank, tiny_model, workload  # noqa: E402

WORLD = 4
GRAPH_SIZES = (1, 2, 4, 8, 16)


# ---------- single process: what exactness rests on ----------

def _params(**kw):
    from vllm import SamplingParams

    base = dict(n=1, temperature=0.8, top_k=50, top_p=0.95, max_tokens=5, ignore_eos=True, logprobs=0)
    base.update(kw)
    return SamplingParams(**base)


WIDTHS = (1, 3, 8, 17)  # batch rows: a GEMM's blocking (and reduction order) changes with them
THREADS = (1, 2)


@pytest.mark.parametrize("threads", THREADS)
def test_a_rows_logits_do_not_depend_on_its_batch(threads):
    """Batch invariance of the stand-in's forward, bit for bit: a request's logits at prefill and at
    every decode step, and its KV, are the same alone and in batches of 1, 3, 8 and 17 requests of
    other lengths, at 1 and 2 threads. It holds by construction (one forward per request,
    ``engine._forward``); a batched, left-padded forward fails it on CPUs whose BLAS blocks by the
    batch's shape (an AVX-512 Intel Xeon does, at the first decode step)."""
    from verl_patches.rigs.cpu import engine

    model = tiny_model()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 990, (int(torch.randint(2, 13, (1,), generator=g)),), generator=g).tolist()
               for _ in range(max(WIDTHS))]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            for width in WIDTHS:
                alone = [engine.RequestState(p, _params(), 0) for p in prompts[:width]]
                together = [engine.RequestState(p, _params(), 0) for p in prompts[:width]]
                for step in range(4):
                    rows = [engine._forward(model, [s])[0] for s in alone]
                    batch = engine._forward(model, together)
                    assert batch.shape[0] == width
                    for r, s in enumerate(alone):
                        assert torch.equal(rows[r], batch[r]), (width, step, r)
                        tok = int(torch.argmax(rows[r]))
                        s.out.append(tok)
                        together[r].out.append(tok)
                    for r, (a, b) in enumerate(zip(alone, together)):
                        assert all(torch.equal(x, y) for la, lb in zip(a.kv, b.kv) for x, y in zip(la, lb)), \
                            (width, step, r)
    finally:
        torch.set_num_threads(before)


def test_a_forward_refuses_a_mix_of_prefill_and_decode():
    from verl_patches.rigs.cpu import engine

    model = tiny_model()
    done, fresh = engine.RequestState([5, 6, 7], _params(), 0), engine.RequestState([8, 9], _params(), 0)
    with torch.no_grad():
        engine._forward(model, [done])
        done.out.append(3)
        with pytest.raises(engine.CpuEngineError, match="mixes prefill and decode"):
            engine._forward(model, [done, fresh])


def test_per_request_sampling_does_not_depend_on_the_other_requests():
    from verl_patches.rigs.cpu import engine

    model = tiny_model()
    prompts, params = workload(0)
    seeds = [11 * i for i in range(len(prompts))]
    whole = engine._sample(model, prompts, params, eos=1, pad=0, seeds=seeds)
    for i in (0, 3, 7):
        alone = engine._sample(model, [prompts[i]], [params[i]], eos=1, pad=0, seeds=[seeds[i]])
        assert alone[0][0] == whole[i][0] and alone[0][2] == whole[i][2], i


def test_seeds_follow_vllm_per_request_seed_or_the_ranks_stream_in_order():
    from verl_patches.rigs.cpu import engine

    params = [_params(seed=5, n=3)] * 3 + [_params(), _params()]
    torch.manual_seed(1)
    a = engine.request_seeds(params, [0, 1, 2, 0, 0])
    torch.manual_seed(1)
    b = engine.request_seeds(params, [0, 1, 2, 0, 0])
    assert a[:3] == [5, 6, 7]  # vLLM 0.9.1's parallel sampling: child seed = seed + index
    assert a == b and a[3] != a[4]
    assert torch.randint(0, 2**62, (1,)).item() != 0  # the stream moved on by the draws


def test_bad_graph_sizes_and_capacities_are_named():
    from verl_patches.rollout.long_tail.migrate import Lockstep

    assert eager_graph_sizes(4) == (1, 2, 3, 4)
    with pytest.raises(MigrateError, match="max_num_seqs must be a positive integer"):
        eager_graph_sizes(0)
    with pytest.raises(MigrateError, match="exceeds the largest graph batch size"):
        Lockstep(None, rb.RebalancePolicy(enabled=True), (1, 2, 4), 8)


# ---------- 4 DP ranks, forced imbalance ----------

def _replayed_moves(lengths: list[list[int]], max_tokens: list[list[int]]) -> int:
    """The moves the policy plans for this workload, replayed without any model: with ignore_eos each
    request generates exactly max_tokens tokens, one per step wherever it runs, so the unfinished set
    after each step is known; its layout follows the plans (rebalance.decide, weights = prompt +
    generated tokens, as the engine gives them)."""
    layout, start = {}, 0
    info = {}
    for r, (ls, ms) in enumerate(zip(lengths, max_tokens)):
        layout[r] = list(range(start, start + len(ls)))
        info.update({start + i: (ls[i], ms[i]) for i in range(len(ls))})
        start += len(ls)
    policy, moves, step = rb.RebalancePolicy(enabled=True), 0, 0
    while any(layout.values()):
        step += 1
        layout = {r: [q for q in ids if info[q][1] > step] for r, ids in layout.items()}
        if not any(layout.values()):
            break
        weights = {q: info[q][0] + step for ids in layout.values() for q in ids}
        d = rb.decide(layout, GRAPH_SIZES, policy, 16, weights)
        moves += len(d.moves)
        layout = rb.apply_moves(layout, d.moves)
    return moves


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(rebalance_rank, WORLD, env={"VLLM_PLUGINS": "verl_patches"}, timeout=240)


@pytest.mark.slow
def test_rebalance_returns_the_same_tokens_and_logprobs_per_request(ranks):
    for rank, out in enumerate(ranks):
        off, on = out["off"], out["on"]
        assert len(on["tokens"]) == len(off["tokens"]) == len(out["max_tokens"])
        assert [len(t) for t in on["tokens"]] == out["max_tokens"]  # every output back, in order
        for i, (a, b) in enumerate(zip(off["tokens"], on["tokens"])):
            assert a == b, (rank, i)
            assert off["logprobs"][i] == on["logprobs"][i], (rank, i)  # floats, bit for bit
        assert off["reasons"] == on["reasons"]


@pytest.mark.slow
def test_requests_did_move_as_the_policy_planned(ranks):
    stats = [out["on"]["stats"] for out in ranks]
    want = _replayed_moves([out["lengths"] for out in ranks], [out["max_tokens"] for out in ranks])
    assert want > 0
    assert all(s["moves"] == want for s in stats), (want, stats)
    assert all(s["checks"] == stats[0]["checks"] > 0 and s["rebalances"] == stats[0]["rebalances"] for s in stats)
    assert sum(s["returned"] for s in stats) > 0  # some outputs finished away from home
    assert stats[0]["sent_bytes"] > 0  # rank 0, the fullest, sent KV


@pytest.mark.slow
def test_negative_control_a_move_without_the_generator_state_changes_tokens(ranks):
    """The exactness test can fail: moving a request without its sampling generator's state (a fresh
    generator on arrival) changes its tokens."""
    differ = sum(a != b for out in ranks for a, b in zip(out["off"]["tokens"], out["no_generator_state"]["tokens"]))
    assert differ > 0
    assert ranks[0]["no_generator_state"]["stats"]["moves"] == ranks[0]["on"]["stats"]["moves"]


@pytest.mark.slow
def test_ranks_at_different_thread_counts_are_refused():
    """A moved request is computed on another rank: bit for bit only at the same thread count, so the
    stand-in's lockstep refuses a DP group whose ranks disagree, naming the counts."""
    messages = run_distributed(thread_check_rank, 2, env={"VLLM_PLUGINS": "verl_patches"}, timeout=240)
    for message in messages:
        assert "torch thread counts differ ([1, 2]" in message and "OMP_NUM_THREADS" in message, message


def test_the_setting_reaches_the_engine_on_the_cpu_platform_and_is_refused_on_a_device(monkeypatch):
    """recipe.rebalance is run by the CPU stand-in only: on a device vLLM's engine cannot move a
    request yet, so True is refused at the rollout's construction instead of doing nothing. On the CPU
    platform the generation takes it from the rollout settings the rollout leaves on vLLM's LLM (one
    stash key)."""
    from types import SimpleNamespace

    from verl_patches.core import stash
    from verl_patches.rigs.cpu.engine import rebalance_setup
    from verl_patches.patches.verl.patch_workers_rollout_vllm_rollout_spmd import _check_rebalance
    from verl_patches.rollout.settings import STASH_KEY, RolloutSettings

    def engine_with(recipe):
        engine = SimpleNamespace()
        rollout = RolloutSettings.from_config({"recipe": recipe, "tensor_model_parallel_size": 1}, 2)
        _check_rebalance(rollout.recipe)
        stash.put(engine, STASH_KEY, rollout)
        return engine

    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")
    setup = rebalance_setup(engine_with({"rebalance": True, "rebalance_cpu_stagger": 3}))
    assert setup.policy.enabled and setup.stagger == 3
    assert rebalance_setup(engine_with({})) is None  # off by default
    assert rebalance_setup(SimpleNamespace()) is None  # a rollout the recipe did not build
    with pytest.raises(ValueError, match="needs rebalance: True"):
        engine_with({"rebalance_cpu_stagger": 3})
    for device in ("npu", "cuda"):
        monkeypatch.setenv("VERL_PATCHES_DEVICE", device)
        with pytest.raises(ValueError, match=f"CPU generation stand-in only; vLLM's engine on {device} .*"
                                             "device path .* has not run anywhere"):
            engine_with({"rebalance": True})
        engine_with({"rebalance": False})  # off is fine everywhere
