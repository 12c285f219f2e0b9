"""A running request moved between two vLLM 0.9.1 V1 engines between two steps
(verl_patches/rollout/long_tail/vllm_move.py), against vLLM's real Scheduler, KVCacheManager, Request,
InputBatch / CachedRequestState (updated by the real GPUModelRunner._update_states), Sampler and
OutputProcessor: with the rebalance every request's tokens and log-probs equal the run without it,
every output returns to its original rank and order, the KV arrives bit for bit and the source's
pool gets its blocks back; malformed moves are errors naming the problem.

Stand-ins, declared (tests/rollout/long_tail/vllm_move_ranks.py says exactly what): the forward (no kernels on
CPU: deterministic KV rows per token written into the request's real blocks, logits from all of its
rows read back), the model runner's shell around the real ``_update_states``, and the step and
request fan-out of EngineCore / LLMEngine written out; the DP group is a gloo group of 4 processes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verl_patches.launch.local_ranks import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import the body by name
from vllm_move_ranks import SCHEDULERS, Engine, model_dir, move_rank, params, summary  # noqa: E402

WORLD = 4


@pytest.fixture(autouse=True)
def _inspect_in_process(monkeypatch):
    """The overlay's CPU-platform patch cpu.vllm.inspect_model_in_process (the prelude applies it in a
    run): vLLM's ModelConfig reads the model class here instead of in a fresh interpreter (13 s)."""
    from vllm.model_executor.models import registry

    from verl_patches.patches import get_patch

    monkeypatch.setattr(registry._LazyRegisteredModel, "inspect_model_cls",
                        get_patch("cpu.vllm.inspect_model_in_process").load_replacement())


def _two_steps(tmp_path, kind):
    d = model_dir(tmp_path)
    a = Engine(d, scheduler=kind)
    for i, (prompt, n_tok) in enumerate([([5, 6, 7, 8, 9], 6), ([10, 11, 12], 5), ([13, 14, 15, 16], 4)]):
        a.add(str(i), prompt, params(n_tok, 7 + i))
    a.step()
    a.step()  # prefill, then one decode: every request between two steps with 2 outputs
    return d, a


def _baseline(tmp_path, kind):
    d = model_dir(tmp_path)
    e = Engine(d, scheduler=kind)
    for i, (prompt, n_tok) in enumerate([([5, 6, 7, 8, 9], 6), ([10, 11, 12], 5), ([13, 14, 15, 16], 4)]):
        e.add(str(i), prompt, params(n_tok, 7 + i))
    return summary(e.run())


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_a_request_moved_between_two_engines_generates_what_it_would_have(tmp_path, kind):
    from verl_patches.rollout.long_tail import vllm_move as vm

    d, a = _two_steps(tmp_path, kind)
    b = Engine(d, scheduler=kind)
    b.add("0", [20, 21, 22], params(3, 99))  # the destination runs its own request "0" too
    b.step()
    pool = a.scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    held = len(a.scheduler.kv_cache_manager.get_block_ids("1")[0])
    payload = vm.take_out(a.parts, "1")
    assert pool.get_num_free_blocks() == free + held
    assert "1" in a.scheduler.finished_req_ids and "1" not in a.output_processor.request_states
    moved = vm.put_in(b.parts, payload, vm.moved_id(7))
    assert moved.num_computed_tokens == moved.num_tokens - 1
    so = b.scheduler.schedule()  # exactly its next decode token, as a cached (not new) request
    assert so.num_scheduled_tokens[vm.moved_id(7)] == 1
    assert [r.req_id for r in so.scheduled_cached_reqs if r.req_id == vm.moved_id(7)]
    eco = b.scheduler.update_from_output(so, b.runner.execute(so))
    assert vm.moved_id(7) in b.runner.input_batch.req_id_to_index  # re-added as a resumed request is
    done_b = b.output_processor.process_outputs(eco[0].outputs).request_outputs
    while b.scheduler.has_requests():
        done_b += b.step()
    done_a = a.run()
    assert not a.runner.requests.get("1")  # the source's runner dropped it at its next step
    away = [o for o in done_b if o.request_id == vm.moved_id(7)]
    back = vm.restore_output(a.output_processor, payload["home"], away[0])
    got = summary(sorted(done_a + [back], key=lambda o: int(o.request_id)))
    assert got == _baseline(tmp_path, kind)


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_negative_control_without_the_generator_state_the_tokens_change(tmp_path, kind):
    from verl_patches.rollout.long_tail import vllm_move as vm

    d, a = _two_steps(tmp_path, kind)
    b = Engine(d, scheduler=kind)
    payload = vm.take_out(a.parts, "1")
    payload["generator"] = torch.Generator().manual_seed(0).get_state()
    vm.put_in(b.parts, payload, "77")
    done = b.run()
    back = vm.restore_output(a.output_processor, payload["home"], done[0])
    want = [s for s in _baseline(tmp_path, kind) if s[0] == "1"]
    assert summary([back])[0][1][0][1] != want[0][1][0][1]


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_malformed_moves_are_named_and_change_nothing(tmp_path, kind):
    from verl_patches.rollout.long_tail import vllm_move as vm

    d, a = _two_steps(tmp_path, kind)
    with pytest.raises(vm.MoveError, match="request 'nope' is unknown to this rank's scheduler"):
        vm.take_out(a.parts, "nope")
    a.add("9", [30, 31], params(3, 1))  # waiting, not running
    with pytest.raises(vm.MoveError, match="request '9' cannot move: it is WAITING, not running"):
        vm.take_out(a.parts, "9")
    full = Engine(d, blocks=2, scheduler=kind)  # 1 usable block (the other is vLLM's null block)
    from vllm.v1.request import Request

    hog = Request("hog", list(range(2, 10)), None, None, None, params(2, 3), 1)
    assert full.scheduler.kv_cache_manager.allocate_slots(hog, 8) is not None  # another request holds it
    payload = vm.take_out(a.parts, "0")  # 6 KV rows: one block, none left
    before = (full.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(), dict(full.scheduler.requests))
    with pytest.raises(vm.MoveError, match="cannot join this rank: .*no free KV blocks for 6 tokens"):
        vm.put_in(full.parts, payload, "m")
    assert (full.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(), dict(full.scheduler.requests)) == before
    assert "m" not in full.runner.requests and "m" not in full.output_processor.request_states
    with pytest.raises(vm.MoveError, match="request '2' is already on this rank"):
        vm.put_in(a.parts, payload, "2")
    room = Engine(d, scheduler=kind)
    room.scheduler.max_num_running_reqs = 0  # a destination already running max_num_seqs requests
    with pytest.raises(vm.MoveError, match="already runs max_num_seqs=0 requests"):
        vm.put_in(room.parts, payload, "m")
    assert not room.scheduler.requests and not room.runner.requests
    out = SimpleNamespace(finished=True, outputs=[None])
    with pytest.raises(vm.MoveError, match="its parent 'p' is not waiting for it on this rank"):
        vm.restore_output(a.output_processor, {"request_id": "0_p", "parent": "p"}, out)
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    a.add("5", [17, 18], SamplingParams(max_tokens=4, seed=2, output_kind=RequestOutputKind.FINAL_ONLY))
    a.step()  # "5" prefilled, detokenized by the output processor's real tokenizer
    with pytest.raises(vm.MoveError, match="request '5' cannot move: its output is detokenized"):
        vm.take_out(a.parts, "5")
    assert "5" in a.scheduler.requests and "5" in a.output_processor.request_states


def test_a_multiprocess_engine_core_is_named():
    from verl_patches.rollout.long_tail import vllm_move as vm

    with pytest.raises(vm.MoveError, match="engine core is not in this process"):
        vm.EngineParts.of_llm_engine(SimpleNamespace(engine_core=SimpleNamespace(), output_processor=None))


# ---------- 4 DP ranks, forced imbalance, through run_engine ----------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("vllm_move"))
    return run_distributed(move_rank, WORLD, root, env={"VLLM_PLUGINS": "verl_patches"}, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("kind", SCHEDULERS)
def test_rebalance_inside_vllm_changes_no_token_and_returns_every_output_home(ranks, kind):
    runs = [r[kind] for r in ranks]
    for rank, out in enumerate(runs):
        assert out["on"] == out["off"], rank  # ids, order, samples, tokens, log-probs (floats, bit for bit)
        assert out["off_pool_back"] and out["on_pool_back"], rank
    assert runs[0]["stats"]["moves"] > 0
    assert all(r["stats"] == {**runs[0]["stats"], "sent_bytes": r["stats"]["sent_bytes"],
                              "returned": r["stats"]["returned"]} for r in runs)
    assert sum(r["stats"]["returned"] for r in runs) > 0  # outputs finished away and came home
    assert sum(r["moved_samples"] for r in runs) > 0  # samples of n = 2 prompts moved: their parents waited
    from test_migrate import _replayed_moves  # the policy's plan replayed without a model

    assert runs[0]["stats"]["moves"] == _replayed_moves([r["lengths"] for r in runs], [r["max_tokens"] for r in runs])


@pytest.mark.slow
@pytest.mark.parametrize("kind", SCHEDULERS)
def test_every_request_finished_in_both_runs(ranks, kind):
    """The comparison above is not vacuous: every prompt came back with all its samples at full length."""
    from vllm_move_ranks import workload

    for rank, r in enumerate(ranks):
        out = r[kind]
        want = [(rid, p.n, p.max_tokens) for rid, _, p in workload(rank)]
        got = [(rid, len(samples), len(samples[0][1])) for rid, samples in out["on"]]
        assert got == want, rank
        assert all(len(s[1]) == p.max_tokens and len(s[2]) == p.max_tokens
                   for (_, samples), (_, _, p) in zip(out["on"], workload(rank)) for s in samples)


@pytest.mark.slow
@pytest.mark.parametrize("kind", SCHEDULERS)
def test_moved_kv_arrives_bit_for_bit_and_the_source_pool_gets_its_blocks_back(ranks, kind):
    checks = [c for r in ranks for c in r[kind]["kv_checks"]]
    assert {side for side, _ in checks} == {"source", "destination"}
    assert all(ok for _, ok in checks)
    pools = [c for r in ranks for c in r[kind]["pool_checks"]]
    assert pools and all(pools)
