"""Per-rank body and engine for test_vllm_move.py (next to it; spawned processes import it by name).

``Engine`` is one DP rank's vLLM 0.9.1 V1 engine on CPU made of the real classes: ``Scheduler``
(real ``VllmConfig`` / ``KVCacheConfig``, real ``KVCacheManager``), the model runner's real
``InputBatch`` and ``CachedRequestState``s updated by the real ``GPUModelRunner._update_states`` (and
the MLA backend's real ``reorder_batch``), vLLM's real ``Sampler`` over the batch's real
``SamplingMetadata`` (per-request seeded generators), and the real ``OutputProcessor`` (with a real
``TokenizerGroup`` over a tiny word-level tokenizer; the requests are not detokenized).

Stand-ins, declared:
- the forward (no attention or MoE kernels run on CPU): for every scheduled token a deterministic KV
  row per layer, a function of (layer, token, position), written into the request's real blocks
  through the InputBatch's block table; the logits of a request's last position are a function of
  ALL of its rows read back from its blocks (so KV placed wrongly changes its tokens);
- the runner shell: a plain object carrying the fields ``_update_states`` reads (``requests``,
  ``input_batch``, ``device``, ``encoder_cache``, ``uses_mrope``, ``kv_cache_config``,
  ``attn_metadata_builders``), since ``GPUModelRunner`` itself needs a device and a model;
- the step: the three calls of ``EngineCore.step`` (``schedule``, execute, ``update_from_output``)
  and ``LLMEngine.step``'s ``process_outputs``, written out (EngineCore needs an executor), and the
  request fan-out of ``LLMEngine.add_request`` (n > 1 through ``ParentRequest``) written out.
"""

from __future__ import annotations

import json
import math
from copy import copy
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

VOCAB, LAYERS, WIDTH, BLOCK, BLOCKS, MAX_SEQS, MAX_LEN, EOS = 48, 2, 8, 16, 40, 16, 64, 1  # block 16: the CPU platform's only size
GRAPH_SIZES = (1, 2, 4, 8, 16)


def model_dir(root: Path) -> Path:
    """A tiny model directory: what vLLM's ModelConfig reads (config.json) and a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = root / "tiny_llama"
    if (d / "config.json").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
        "max_position_embeddings": 512, "torch_dtype": "float32"}))
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<unk>").save_pretrained(d)
    return d


_CONFIGS: dict = {}
# vLLM's Scheduler; vLLM-Ascend's AscendScheduler as the recipe runs it (ascend_scheduler_config with
# chunked prefill: vLLM's schedule() under Ascend's update_from_output) and with its own prefill-first
# schedule() (chunked prefill off, vLLM-Ascend's default).
SCHEDULERS = ("vllm", "ascend_chunked", "ascend_prefill_first")


def vllm_config(d: Path, blocks: int = BLOCKS, scheduler: str = "vllm"):
    """One VllmConfig per model dir, pool size and scheduler (the engines of a process share it)."""
    key = (str(d), blocks, scheduler)
    if key not in _CONFIGS:
        _CONFIGS[key] = _build_config(d, blocks)
        if scheduler != "vllm":
            from vllm_ascend.core.schedule_config import AscendSchedulerConfig

            _CONFIGS[key].scheduler_config = AscendSchedulerConfig.initialize_from_config(
                _CONFIGS[key].scheduler_config, SimpleNamespace(enable_chunked_prefill=scheduler == "ascend_chunked"))
    return _CONFIGS[key]


def _build_config(d: Path, blocks: int):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    mc = ModelConfig(model=str(d), tokenizer=str(d), dtype="float32", max_model_len=MAX_LEN, enforce_eager=True)
    mc.use_async_output_proc = False
    cfg = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"),
                     cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.5, swap_space=0,
                                              cache_dtype="auto", enable_prefix_caching=False),
                     scheduler_config=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=MAX_SEQS,
                                                      max_model_len=MAX_LEN))
    cfg.cache_config.num_gpu_blocks = blocks
    return cfg


def kv_cache_config(blocks: int = BLOCKS):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=WIDTH, dtype=torch.float32, use_mla=True)
    return KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[KVCacheTensor(size=blocks * spec.page_size_bytes,
                                                                            shared_by=[n]) for n in names],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)])


def _tables():
    g = torch.Generator().manual_seed(1234)
    emb = torch.randn(LAYERS, VOCAB, WIDTH, generator=g)
    pos = torch.randn(LAYERS, MAX_LEN, WIDTH, generator=g) * 0.5
    head = torch.randn(WIDTH, VOCAB, generator=g)
    return emb, pos, head


EMB, POS, HEAD = _tables()


def kv_row(layer: int, token: int, position: int) -> torch.Tensor:
    """The stand-in forward's KV row of one token (what a real layer would write into the cache)."""
    return EMB[layer, token] + POS[layer, position]


def logits_from_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """The stand-in forward's logits of a request's last position, from all of its KV rows."""
    n = rows[0].shape[0]
    w = 0.8 ** torch.arange(n - 1, -1, -1, dtype=torch.float32)
    h = sum((w[:, None] * r).sum(0) for r in rows)
    return (h @ HEAD) * 0.1  # logits of spread about 1: the seeded draws decide the tokens


class Runner:
    """The model runner shell (declared above): vLLM's real ``_update_states`` over a real InputBatch."""

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as _G

    _update_states = _G._update_states
    _may_reorder_batch = _G._may_reorder_batch
    del _G

    def __init__(self, kv_caches, kv_cfg) -> None:
        from vllm.v1.attention.backends.mla.common import MLACommonMetadataBuilder
        from vllm.v1.sample.sampler import Sampler
        from vllm.v1.worker.gpu_input_batch import InputBatch

        self.device = torch.device("cpu")
        self.requests: dict = {}
        self.encoder_cache: dict = {}
        self.uses_mrope = False
        self.kv_cache_config = kv_cfg
        self.kv_caches = kv_caches
        self.input_batch = InputBatch(max_num_reqs=MAX_SEQS, max_model_len=MAX_LEN, max_num_batched_tokens=256,
                                      device=self.device, pin_memory=False, vocab_size=VOCAB, block_sizes=[BLOCK])
        builder = SimpleNamespace()
        builder.reorder_batch = lambda ib, so: MLACommonMetadataBuilder.reorder_batch(builder, ib, so)
        self.attn_metadata_builders = [builder]
        self.sampler = Sampler()

    def execute(self, so):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        self._update_states(so)
        if not so.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        ib = self.input_batch
        logits = []
        for i, rid in enumerate(ib.req_ids):
            start = int(ib.num_computed_tokens_cpu[i])
            end = start + so.num_scheduled_tokens[rid]
            assert end == self.requests[rid].num_tokens, "the stand-in runs whole prefills only"
            blocks = ib.block_table[0].block_table_np[i, :math.ceil(end / BLOCK)].tolist()
            for p in range(start, end):
                tok = int(ib.token_ids_cpu[i, p])
                for layer, c in enumerate(self.kv_caches):
                    c[blocks[p // BLOCK], p % BLOCK] = kv_row(layer, tok, p)
            from verl_patches.rollout.long_tail.kv_blocks import read_rows

            logits.append(logits_from_rows(read_rows(self.kv_caches, blocks, end)))
        out = self.sampler(torch.stack(logits), ib.sampling_metadata)
        lp = out.logprobs_tensors.tolists() if out.logprobs_tensors is not None else None
        return ModelRunnerOutput(req_ids=list(ib.req_ids), req_id_to_index=dict(ib.req_id_to_index),
                                 sampled_token_ids=out.sampled_token_ids.tolist(), spec_token_ids=None, logprobs=lp,
                                 prompt_logprobs_dict={})


class Engine:
    """One DP rank's engine (see the module docstring for what is real)."""

    def __init__(self, d: Path, blocks: int = BLOCKS, scheduler: str = "vllm") -> None:
        from vllm.transformers_utils.tokenizer_group import TokenizerGroup
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.output_processor import OutputProcessor
        from vllm.v1.structured_output import StructuredOutputManager

        from verl_patches.rollout.long_tail.vllm_move import EngineParts

        cfg = vllm_config(d, blocks, scheduler)
        kv_cfg = kv_cache_config(blocks)
        if scheduler != "vllm":
            from vllm_ascend.core.scheduler import AscendScheduler as Scheduler  # noqa: F811
        self.scheduler = Scheduler(cfg, kv_cfg, StructuredOutputManager(cfg), log_stats=False)
        if scheduler != "vllm":
            assert self.scheduler.scheduler_config.chunked_prefill_enabled == (scheduler == "ascend_chunked")
        self.kv_caches = [torch.zeros(blocks, BLOCK, WIDTH) for _ in range(LAYERS)]
        self.runner = Runner(self.kv_caches, kv_cfg)
        self.output_processor = OutputProcessor(TokenizerGroup(str(d), enable_lora=False, max_num_seqs=MAX_SEQS,
                                                               max_input_length=None), log_stats=False)
        self.parts = EngineParts(self.scheduler, self.runner, self.output_processor, self.kv_caches)

    def add(self, rid: str, prompt: list[int], params) -> None:
        """LLMEngine.add_request's fan-out, written out (n > 1: one child per sample, vLLM's ParentRequest)."""
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.parallel_sampling import ParentRequest
        from vllm.v1.request import Request

        req = EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt), mm_inputs=None, mm_hashes=None,
                                mm_placeholders=None, sampling_params=params, eos_token_id=EOS, arrival_time=0.0,
                                lora_request=None, cache_salt=None, data_parallel_rank=None)
        if params.n == 1:
            self.output_processor.add_request(req, None, None, 0)
            self.scheduler.add_request(Request.from_engine_core_request(req))
            return
        parent = ParentRequest(rid, params)
        for idx in range(params.n):
            cid, cparams = parent.get_child_info(idx)
            child = copy(req)
            child.request_id, child.sampling_params = cid, cparams
            self.output_processor.add_request(child, None, parent, idx)
            self.scheduler.add_request(Request.from_engine_core_request(child))

    def step(self) -> list:
        if not self.scheduler.has_requests():
            return []
        so = self.scheduler.schedule()
        eco = self.scheduler.update_from_output(so, self.runner.execute(so))
        outs = eco.get(0)
        return [] if outs is None else self.output_processor.process_outputs(outs.outputs).request_outputs

    def run(self) -> list:
        """LLM._run_engine without rebalance."""
        done = []
        while self.output_processor.has_unfinished_requests() or self.scheduler.has_requests():
            done += [o for o in self.step() if o.finished]
        return sorted(done, key=lambda o: int(o.request_id))


def params(max_tokens: int, seed: int, n: int = 1):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(n=n, temperature=0.9, top_k=20, top_p=0.95, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=0, seed=seed, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)


def workload(rank: int) -> list[tuple[str, list[int], object]]:
    """The forced imbalance: rank 0 holds 7 prompts (two of them n=2: 9 engine requests), ranks 1-3 hold
    2, 1 and 1; lengths 2..9 tokens (ignore_eos) so ranks empty at different steps; every request seeded."""
    counts = [7, 2, 1, 1]
    g = torch.Generator().manual_seed(50 + rank)
    out = []
    for i in range(counts[rank]):
        prompt = torch.randint(2, VOCAB, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        out.append((str(i), prompt, params(2 + (3 * i + rank) % 8, 100 * rank + i, n=2 if rank == 0 and i in (1, 4) else 1)))
    return out


def summary(outputs: list) -> list:
    return [(o.request_id, [(c.index, list(c.token_ids), [next(iter(d.values())).logprob for d in c.logprobs],
                             c.cumulative_logprob, c.finish_reason) for c in o.outputs]) for o in outputs]


def move_rank(rank: int, world: int, root: str) -> dict:
    """Per scheduler: the workload without and with the rebalance (run_engine over a Lockstep on a
    gloo group), with the KV and the pools checked at every move."""
    from verl_patches.rollout.long_tail import vllm_move

    d = model_dir(Path(root) / f"rank{rank}")
    from verl_patches.core.apply import apply_all
    from verl_patches.patches import get_patch

    # The overlay's CPU-platform patch (a run's prelude applies it): the model class is inspected here.
    apply_all([get_patch("cpu.vllm.inspect_model_in_process")])
    group = dist.new_group(list(range(world)), backend="gloo")
    out: dict = {}

    take_out, put_in = vllm_move.take_out, vllm_move.put_in
    for kind in SCHEDULERS:
        out[kind] = _runs(d, rank, group, kind, take_out, put_in)
    return out


def _runs(d, rank, group, kind, take_out, put_in) -> dict:
    """The workload on ``kind`` of scheduler: without, then with the rebalance (KV and pools checked at every move)."""
    from verl_patches.rollout.long_tail import rebalance as rb
    from verl_patches.rollout.long_tail import vllm_move
    from verl_patches.rollout.long_tail.kv_blocks import read_rows
    from verl_patches.rollout.long_tail.migrate import Lockstep

    out: dict = {"kv_checks": [], "pool_checks": [], "moved_samples": 0}
    off = Engine(d, scheduler=kind)
    free0 = off.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    for rid, prompt, p in workload(rank):
        off.add(rid, prompt, p)
    out["off"] = summary(off.run())
    out["off_pool_back"] = off.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free0

    on = Engine(d, scheduler=kind)
    for rid, prompt, p in workload(rank):
        on.add(rid, prompt, p)

    def checked_take_out(parts, rid, home=None):
        pool = parts.scheduler.kv_cache_manager.block_pool
        held = len(parts.scheduler.kv_cache_manager.get_block_ids(rid)[0])
        before = pool.get_num_free_blocks()
        req = parts.scheduler.requests[rid]
        tokens = list(req.all_token_ids)
        payload = take_out(parts, rid, home)
        n = payload["kv"]["num_tokens"]
        want = [torch.stack([kv_row(layer, tokens[p], p) for p in range(n)]) for layer in range(LAYERS)]
        out["kv_checks"].append(("source", all(torch.equal(a, b) for a, b in zip(payload["kv"]["rows"], want))))
        out["pool_checks"].append(pool.get_num_free_blocks() == before + held and rid not in parts.scheduler.requests)
        out["moved_samples"] += payload["home"]["parent"] is not None  # one of the n samples of a prompt
        return payload

    def checked_put_in(parts, payload, rid):
        req = put_in(parts, payload, rid)
        got = read_rows(parts.kv_caches, parts.runner.requests[rid].block_ids[0], payload["kv"]["num_tokens"])
        out["kv_checks"].append(("destination", all(torch.equal(a, b) for a, b in zip(got, payload["kv"]["rows"]))))
        return req

    vllm_move.take_out, vllm_move.put_in = checked_take_out, checked_put_in
    try:
        lockstep = Lockstep(group, rb.RebalancePolicy(enabled=True), GRAPH_SIZES, MAX_SEQS)
        out["on"] = summary(vllm_move.run_engine(on.step, on.parts, lockstep))
    finally:
        vllm_move.take_out, vllm_move.put_in = take_out, put_in
    out["on_pool_back"] = on.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    out["stats"] = vars(lockstep.stats)
    engine_requests = [(len(prompt), p.max_tokens) for _, prompt, p in workload(rank) for _ in range(p.n)]
    out["lengths"] = [n for n, _ in engine_requests]  # per engine request, in the order they were added
    out["max_tokens"] = [m for _, m in engine_requests]
    return out
