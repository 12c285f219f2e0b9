"""Moving one running request between the DP ranks' vLLM V1 engines, between two engine steps: the
scheduler, worker and output side of a rebalance move (verl_patches/rollout/long_tail/migrate.py decides and
carries; verl_patches/rollout/long_tail/kv_blocks.py moves the KV rows). Written against vLLM 0.9.1's own
classes, which it reads and writes by their fields:

- scheduler (``vllm/v1/core/sched/scheduler.py:Scheduler``): ``requests``, ``running``,
  ``finished_req_ids`` (what the next ``schedule()`` hands the worker as
  ``SchedulerOutput.finished_req_ids``, so ``GPUModelRunner._update_states`` drops the request's
  ``CachedRequestState`` and its ``InputBatch`` row), ``_cached_reqs_data`` (the reused
  ``CachedRequestData``; ``Scheduler._free_request`` drops it the same way), ``kv_cache_manager``
  (``KVCacheManager.free`` / ``free_block_hashes`` / ``allocate_slots`` / ``get_block_ids``),
  ``max_num_running_reqs``, ``connector``;
  vLLM-Ascend 0.9.1's ``vllm_ascend/core/scheduler.py:AscendScheduler`` (the recipe's) subclasses
  it with the same fields plus ``scheduled_req_ids``, which its ``update_from_output`` empties of
  the scheduled requests (so it is empty between two steps);
- request (``vllm/v1/request.py:Request``): built by its constructor, ``append_output_token_ids``,
  ``num_computed_tokens``, ``status`` (``RequestStatus.RUNNING``), ``num_cached_tokens``;
- worker (``vllm/v1/worker/gpu_model_runner.py:GPUModelRunner``): ``requests`` (req id ->
  ``vllm/v1/worker/gpu_input_batch.py:CachedRequestState``) and ``device``. Between two steps a
  runner's state lags the scheduler by one token: ``_update_states`` appends the token sampled in
  the previous step (``CachedRequestData.new_token_ids``) at the start of the next step. A moved
  request's state is therefore rebuilt with the outputs but the last, and the block ids it holds on
  the destination; the destination's next ``schedule()`` lists it in ``scheduled_cached_reqs``
  (``resumed_from_preemption`` False: new blocks are appended), and since it is absent from the
  persistent ``InputBatch``, ``_update_states`` adds it through ``InputBatch.add_request``, the path
  a resumed or unscheduled-then-scheduled request takes; ``add_request`` takes the state's
  ``generator`` into ``InputBatch.generators`` for a seeded request (``SamplingType.RANDOM_SEED``).
  vLLM-Ascend 0.9.1's ``NPUModelRunner._update_states`` (``vllm_ascend/worker/model_runner_v1.py``)
  takes the same path (read; it needs torch_npu to run).
- output side (``vllm/v1/engine/output_processor.py:OutputProcessor``): ``request_states`` (req id
  -> ``RequestState``: ``request_index``, ``output_kind``, ``prompt``, ``prompt_token_ids``,
  ``max_tokens_param``, ``is_prefilling``, ``stats``, its ``logprobs_processor``
  (``vllm/v1/engine/logprobs.py:LogprobsProcessor``: ``logprobs``, ``prompt_logprobs``,
  ``cumulative_logprob``, ``num_logprobs``, ``num_prompt_logprobs``) and its ``detokenizer``
  (``vllm/v1/engine/detokenizer.py:IncrementalDetokenizer``, ``token_ids``)) and
  ``parent_requests`` (``vllm/v1/engine/parallel_sampling.py:ParentRequest.get_outputs``, which
  gathers the n samples of one prompt).

The source drops the request without finishing it: no ``EngineCoreOutput`` ends it and the output
processor forgets it without producing an output; the request's parent (n > 1) stays at home,
waiting for its child. The destination gives the moved request a fresh engine id (ids are per engine
and collide across ranks) and produces a child-level ``RequestOutput`` when it finishes; that output
goes back home (``Lockstep.restore``) and ``restore_output`` hands it to the parent there, or renames
it to the home id. ``run_engine`` is the loop of ``LLM._run_engine`` with the lockstep's check and
the moves between two steps.

Refused, each with an error naming it: a request that is waiting, preempted, mid-prefill, carrying
speculative tokens, multimodal inputs, LoRA, structured output or a KV connector, and one whose text
is detokenized (``SamplingParams.detokenize``: the detokenizer's stream state does not move; verl's
rollout sets it False). The payload's ``"kv"`` entry travels as device tensors over the lockstep's
KV group (verl_patches/rollout/long_tail/kv_transfer.py), the rest pickled on the host. Limits: a device
generator's state is carried by ``get_state`` / ``set_state``, and nothing here has run on a device
(docs/ROLLOUT.md, "What remains for vLLM on a device").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from verl_patches.rollout.long_tail import kv_blocks


class MoveError(RuntimeError):
    """A request cannot move (or was moved inconsistently); the message names the request and why."""


@dataclass
class EngineParts:
    """The objects of one DP rank's in-process vLLM V1 engine a move reads and writes.

    ``arrived``: engine request id -> its home (``{"gid", "request_id", "parent"}``) for the requests
    that moved onto this rank, so a request moved twice still knows its home."""

    scheduler: Any  # vllm.v1.core.sched.scheduler.Scheduler
    runner: Any  # the model runner: .requests (CachedRequestState by id), .device
    output_processor: Any  # vllm.v1.engine.output_processor.OutputProcessor
    kv_caches: Sequence[torch.Tensor]  # the runner's bound per-layer caches, MLA layout
    arrived: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def of_llm_engine(cls, llm_engine: Any) -> "EngineParts":
        """From ``vllm.v1.engine.llm_engine.LLMEngine`` with an in-process engine core (verl's SPMD
        rollout: ``InprocClient.engine_core`` is the ``EngineCore``; its executor's driver worker
        holds the model runner)."""
        core = getattr(llm_engine.engine_core, "engine_core", None)
        if core is None:
            raise MoveError("the vLLM engine core is not in this process (VLLM_ENABLE_V1_MULTIPROCESSING must be 0, "
                            "as verl's SPMD rollout sets it): a move must reach the scheduler and the model runner")
        worker = core.model_executor.driver_worker
        worker = getattr(worker, "worker", worker)
        runner = worker.model_runner
        return cls(core.scheduler, runner, llm_engine.output_processor, runner.kv_caches)


def _refuse(rid: str, why: str) -> MoveError:
    return MoveError(f"request {rid!r} cannot move: {why}")


def _check_movable(parts: EngineParts, rid: str) -> tuple[Any, Any, Any]:
    # Lazy: vLLM V1's engine modules inside vLLM's processes; the move's bookkeeping imports without vLLM.
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer
    from vllm.v1.request import RequestStatus

    sched = parts.scheduler
    if sched.connector is not None:
        raise _refuse(rid, "the engine has a KV connector (kv_transfer_config); moves manage the KV themselves")
    request = sched.requests.get(rid)
    if request is None:
        raise MoveError(f"request {rid!r} is unknown to this rank's scheduler")
    if request.status != RequestStatus.RUNNING or request not in sched.running:
        raise _refuse(rid, f"it is {request.status.name}, not running (only running requests move)")
    if request.num_computed_tokens != request.num_tokens - 1 or request.num_output_tokens < 1:
        raise _refuse(rid, f"{request.num_computed_tokens} of {request.num_tokens} tokens computed; a move runs "
                           "between two steps, after a step that sampled its last token")
    if rid in getattr(sched, "scheduled_req_ids", ()):
        raise _refuse(rid, "vLLM-Ascend's AscendScheduler still counts it scheduled (between schedule() and "
                           "update_from_output())")
    if request.spec_token_ids:
        raise _refuse(rid, "it carries speculative tokens")
    if request.has_encoder_inputs or request.lora_request is not None or request.use_structured_output:
        raise _refuse(rid, "multimodal inputs, LoRA and structured output are not moved")
    state = parts.runner.requests.get(rid)
    if state is None:
        raise MoveError(f"request {rid!r} is running in the scheduler but the model runner holds no state for it")
    if list(state.output_token_ids) != list(request.output_token_ids[:-1]):
        raise MoveError(f"request {rid!r}: the model runner's output tokens are not the scheduler's but the last "
                        "(not between two steps?)")
    out = parts.output_processor.request_states.get(rid)
    if out is None:
        raise MoveError(f"request {rid!r} has no state in the output processor")
    if type(out.detokenizer) is not IncrementalDetokenizer or out.lora_name is not None:
        raise _refuse(rid, "its output is detokenized (SamplingParams.detokenize=True); the detokenizer's stream "
                           "does not move: generate token ids (detokenize=False), as verl's rollout does")
    return request, state, out


def take_out(parts: EngineParts, rid: str, home: Optional[Mapping[str, Any]] = None) -> dict:
    """Remove running request ``rid`` from this rank's engine without finishing it and return its
    picklable move payload (scheduler, runner and output state, and its KV rows; its blocks go back
    to this rank's pool). Every check runs before anything changes. ``home``: where its output goes
    in the end (default: here, under ``rid`` and its parent; a request that arrived keeps its own)."""
    request, state, out = _check_movable(parts, rid)
    if home is None:
        home = parts.arrived.get(rid) or {"request_id": rid, "parent": (None if out.parent_req is None
                                                                        else out.parent_req.request_id)}
    generator = None
    if state.generator is not None:
        generator = state.generator.get_state().to("cpu")
    lp = out.logprobs_processor
    payload = {
        "home": dict(home),
        "prompt_token_ids": list(request.prompt_token_ids),
        "output_token_ids": list(request.output_token_ids),
        "sampling_params": request.sampling_params,
        "eos_token_id": request.eos_token_id,
        "client_index": request.client_index,
        "num_cached_tokens": request.num_cached_tokens,
        "generator": generator,
        "output": {
            "request_index": out.request_index, "output_kind": out.output_kind, "prompt": out.prompt,
            "prompt_token_ids": list(out.prompt_token_ids), "max_tokens_param": out.max_tokens_param,
            "is_prefilling": out.is_prefilling, "stats": out.stats,
            "token_ids": list(out.detokenizer.token_ids),
            "logprobs": lp.logprobs, "prompt_logprobs": lp.prompt_logprobs,
            "cumulative_logprob": lp.cumulative_logprob, "num_logprobs": lp.num_logprobs,
            "num_prompt_logprobs": lp.num_prompt_logprobs,
        },
    }
    sched = parts.scheduler
    payload["kv"] = kv_blocks.export_request(sched.kv_cache_manager, request, parts.kv_caches)  # frees its blocks
    sched.kv_cache_manager.free_block_hashes(request)
    sched.running.remove(request)
    del sched.requests[rid]
    sched._cached_reqs_data.pop(rid, None)
    sched.finished_req_ids.add(rid)  # the runner drops its state at the next step; no output ends it
    parts.output_processor.request_states.pop(rid)
    parts.arrived.pop(rid, None)
    return payload


def put_in(parts: EngineParts, payload: Mapping[str, Any], rid: str) -> Any:
    """Add a moved request to this rank's engine as ``rid`` (a fresh engine id): the scheduler's
    ``Request`` with its tokens and KV (blocks from this rank's pool), the runner's
    ``CachedRequestState`` with its generator, the output processor's ``RequestState``. The next
    ``schedule()`` schedules exactly its next token. A full running list or pool is an error and
    leaves this rank unchanged. Returns the ``Request``."""
    # Lazy: vLLM V1's engine modules inside vLLM's processes; the move's bookkeeping imports without vLLM.
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.engine.output_processor import RequestState
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    sched, runner, proc = parts.scheduler, parts.runner, parts.output_processor
    if rid in sched.requests or rid in runner.requests or rid in proc.request_states:
        raise MoveError(f"request {rid!r} is already on this rank")
    if len(sched.running) >= sched.max_num_running_reqs:
        raise MoveError(f"request {rid!r}: this rank already runs max_num_seqs={sched.max_num_running_reqs} requests "
                        "(the plan's capacity must be max_num_seqs)")
    outputs = list(payload["output_token_ids"])
    request = Request(rid, list(payload["prompt_token_ids"]), None, None, None, payload["sampling_params"],
                      payload["eos_token_id"], client_index=payload["client_index"])
    request.append_output_token_ids(outputs)
    try:
        block_ids = kv_blocks.import_request(sched.kv_cache_manager, request, payload["kv"], parts.kv_caches)
    except kv_blocks.KVBlocksError as e:
        raise MoveError(f"request {rid!r} cannot join this rank: {e}") from e
    if request.num_computed_tokens != request.num_tokens - 1:
        sched.kv_cache_manager.free(request)
        raise MoveError(f"request {rid!r}: {request.num_computed_tokens} KV rows moved for {request.num_tokens} "
                        "tokens; a move carries all but the last sampled token")
    request.status = RequestStatus.RUNNING
    request.num_cached_tokens = payload["num_cached_tokens"]
    generator = None
    if payload["generator"] is not None:
        generator = torch.Generator(device=runner.device)
        generator.set_state(payload["generator"])
    o = payload["output"]
    logprobs = LogprobsProcessor(tokenizer=None, logprobs=o["logprobs"], prompt_logprobs=o["prompt_logprobs"],
                                 cumulative_logprob=o["cumulative_logprob"], num_logprobs=o["num_logprobs"],
                                 num_prompt_logprobs=o["num_prompt_logprobs"])
    detok = IncrementalDetokenizer()
    detok.token_ids = list(o["token_ids"])
    state = RequestState(request_id=rid, parent_req=None, request_index=o["request_index"], lora_name=None,
                         output_kind=o["output_kind"], prompt=o["prompt"], prompt_token_ids=o["prompt_token_ids"],
                         logprobs_processor=logprobs, detokenizer=detok, max_tokens_param=o["max_tokens_param"],
                         arrival_time=0.0, queue=None, log_stats=False)
    state.is_prefilling = o["is_prefilling"]
    state.stats = o["stats"]
    sched.requests[rid] = request
    sched.running.append(request)
    runner.requests[rid] = CachedRequestState(
        req_id=rid, prompt_token_ids=list(payload["prompt_token_ids"]), mm_inputs=[], mm_positions=[],
        sampling_params=payload["sampling_params"], generator=generator, block_ids=(list(block_ids),),
        num_computed_tokens=request.num_computed_tokens, output_token_ids=outputs[:-1], lora_request=None)
    proc.request_states[rid] = state
    parts.arrived[rid] = dict(payload["home"])
    return request


def restore_output(output_processor: Any, home: Mapping[str, Any], output: Any) -> Optional[Any]:
    """On the home rank, a moved request's final ``RequestOutput`` (produced under its engine id on
    the rank it finished on) as the home engine would have produced it: renamed to its home id, or
    handed to its parent (n > 1) there. Returns the output to report, or None while the parent still
    waits for other samples."""
    # Lazy: vLLM V1's engine modules inside vLLM's processes; the move's bookkeeping imports without vLLM.
    from vllm.outputs import RequestOutput

    if not output.finished or len(output.outputs) != 1:
        raise MoveError(f"moved request {home['request_id']!r}: expected one finished sample, got "
                        f"{len(output.outputs)} (finished={output.finished})")
    if home["parent"] is None:
        output.request_id = home["request_id"]
        return output
    parent = output_processor.parent_requests.get(home["parent"])
    if parent is None or home["request_id"] not in parent.child_requests:
        raise MoveError(f"moved request {home['request_id']!r}: its parent {home['parent']!r} is not waiting for it "
                        "on this rank")
    pid, outputs, finished = parent.get_outputs(home["request_id"], output.outputs[0])
    if not outputs:
        return None
    if finished:
        output_processor.parent_requests.pop(pid, None)
    return RequestOutput(request_id=pid, prompt=output.prompt, prompt_token_ids=output.prompt_token_ids,
                         prompt_logprobs=output.prompt_logprobs, outputs=list(outputs), finished=finished,
                         num_cached_tokens=output.num_cached_tokens)


MOVED_PREFIX = "rebalance-"


def moved_id(gid: int) -> str:
    """A moved request's engine id on the rank it joins: unique over the DP group (engine ids are not)."""
    return f"{MOVED_PREFIX}{gid}"


def run_engine(step: Callable[[], list], parts: EngineParts, lockstep: Any) -> list:
    """``LLM._run_engine`` with the rebalance: the loop of engine steps (``step``: ``LLMEngine.step``)
    with, between two steps, the lockstep's check over the DP group and the moves it plans; at the end
    every moved request's output goes home. Every rank of the lockstep's group calls it together,
    after adding its requests (all waiting, in order). Returns the finished outputs sorted by request
    id as ``LLM._run_engine`` does; a rank whose requests are all away keeps stepping in the
    lockstep (its engine steps only while its scheduler holds requests)."""
    sched = parts.scheduler
    if sched.running or not sched.waiting:
        raise MoveError("run_engine starts with this rank's requests added and none scheduled yet")
    local = [r.request_id for r in sched.waiting]
    gids = lockstep.begin(len(local))
    gid_of = dict(zip(local, gids))
    homes: dict[int, dict] = {}
    for rid, gid in gid_of.items():
        st = parts.output_processor.request_states.get(rid)
        if st is None:
            raise MoveError(f"request {rid!r} is in the scheduler but not in the output processor")
        homes[gid] = {"gid": gid, "request_id": rid, "parent": None if st.parent_req is None else st.parent_req.request_id}
    left: set[int] = set()  # home requests taken out of this rank (they finish elsewhere, or here as moved ones)
    finished_here: dict[int, Any] = {}  # gid -> a moved request's output, or None: reported by the home engine
    outputs: list = []
    while True:
        running = {_gid(parts, gid_of, r.request_id): r.request_id for r in sched.running}
        more, moves = lockstep.check({gid: sched.requests[rid].num_tokens for gid, rid in running.items()},
                                     len(sched.waiting))
        if not more:
            break
        if moves:
            mine = [m.request for m in moves if m.src == lockstep.rank]
            left.update(gid for gid in mine if running[gid] in gid_of)
            payloads = {gid: take_out(parts, running[gid], homes.get(gid) if gid in left else None) for gid in mine}
            for gid, payload in sorted(lockstep.move(moves, payloads).items()):
                put_in(parts, payload, moved_id(gid))
        for out in step():
            if out.finished and out.request_id.startswith(MOVED_PREFIX):
                finished_here[int(out.request_id[len(MOVED_PREFIX):])] = out
            elif out.finished:
                outputs.append(out)
    if sched.requests:
        raise MoveError(f"the DP group ended the generation with requests left here: {sorted(sched.requests)[:3]}")
    finished_here.update({gid: None for gid in gids if gid not in left})
    for gid, out in zip(lockstep.original[lockstep.rank], lockstep.restore(finished_here)):
        if out is not None:
            restored = restore_output(parts.output_processor, homes[gid], out)
            if restored is not None:
                outputs.append(restored)
    return sorted(outputs, key=lambda o: int(o.request_id))


def _gid(parts: EngineParts, gid_of: Mapping[str, int], rid: str) -> int:
    if rid in gid_of:
        return gid_of[rid]
    if rid not in parts.arrived:
        raise MoveError(f"request {rid!r} runs here but neither started here nor moved here")
    return parts.arrived[rid]["gid"]
