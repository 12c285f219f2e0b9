"""vllm.LLM on the CPU platform: vLLM's real model receives the reshard, transformers generates from it.

vLLM 0.9.1 built for no device has no attention, MoE or sampling kernels, so its engine cannot run
a forward pass here. Everything around the forward stays vLLM's: its engine arguments and configs
(the recipe's data-parallel domain included), its distributed groups on the training ranks' gloo
world, its DeepseekV3ForCausalLM with expert parallelism built by its own model loader (so the
parameters the reshard writes have vLLM's names, shards and expert placement), its MLA post-load
step, and a KV cache per attention layer bound by vLLM's ``bind_kv_cache`` and freed / re-created by
the recipe's offload engine. ``generate`` then gathers the rollout shards of every rank, assembles
them into the full model with the reshard plan's own placements, loads transformers' DeepseekV3
with exactly those tensors, and samples; it returns vLLM's RequestOutput objects, with the sampled
tokens' log-probs as vLLM's V1 sampler computes them (log-softmax of the raw logits, before
temperature and top-k / top-p) when the sampling parameters ask for them, as verl's always do.

Each request samples with its own generator: vLLM's per-request seed where SamplingParams.seed
is set, else a seed drawn per request, in the original order, from torch's default generator, which
verl's sharding manager has set to the generation state of the rank's data-parallel group (so the
tensor-parallel ranks of a group agree, as vLLM's do). Each request keeps its own KV cache and a
step runs one forward per running request (``_forward``), so a request's result does not depend on
the others by construction, on any CPU (tests/rollout/long_tail/test_migrate.py): a request's tokens
depend neither on its batch nor on its DP rank, which is what lets recipe.rebalance move requests
between DP ranks during the generation (verl_patches/rollout/long_tail/migrate.py; the ranks then
step in lockstep).

Stand-in limits, stated: no prefix cache, no chunked prefill, no graph capture (``enforce_eager``
must be True), the KV cache is allocated and bound but transformers uses its own cache for the
forward.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import torch

from verl_patches.core import stash
from verl_patches.reshard.hf_check import assemble, to_hf
from verl_patches.reshard.binding import derive_rollout_layout, vllm_params
from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
from verl_patches.reshard.model import ModelConfig
from verl_patches.reshard.placements import build_placements
from verl_patches.rollout.kv_cache import KEPT_ATTR
from verl_patches.rollout.long_tail.migrate import RebalanceSetup, Lockstep, eager_graph_sizes
from verl_patches.rollout.long_tail.rebalance import RebalancePolicy
from verl_patches.rollout.settings import STASH_KEY
import torch.distributed as dist

logger = logging.getLogger(__name__)

STAND_IN = "transformers DeepseekV3ForCausalLM over the vLLM parameters written by the reshard (CPU platform)"
BLOCK_SIZE = 16


class CpuEngineError(RuntimeError):
    """The CPU engine cannot serve this configuration; the message names the setting."""


class _Worker:
    """What the recipe's engine memory and verl's sharding manager reach on vLLM's worker: the model
    runner (model, kv_caches), the config, and ``initialize_from_config`` for the KV cache."""

    def __init__(self, vllm_config: Any, model: torch.nn.Module) -> None:
        self.vllm_config = vllm_config
        self.model_runner = SimpleNamespace(model=model, kv_caches=[])

    def kv_cache_shapes(self, num_blocks: int) -> dict[str, tuple[int, ...]]:
        """One latent cache per MLA layer: [blocks, block size, kv_lora_rank + rope dim] (vLLM's MLA layout)."""
        # Lazy: vLLM and transformers load when the CPU stand-in builds or runs its engine, after vLLM's platform and
        # the patches are in place.
        from vllm.attention import Attention

        hf = self.vllm_config.model_config.hf_config
        width = hf.kv_lora_rank + hf.qk_rope_head_dim
        # The forward context also holds vLLM's FusedMoE layers; only attention layers have a cache.
        return {name: (num_blocks, BLOCK_SIZE, width)
                for name, layer in self.vllm_config.compilation_config.static_forward_context.items()
                if isinstance(layer, Attention)}

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        cfg = kv_cache_configs[0] if isinstance(kv_cache_configs, (list, tuple)) else kv_cache_configs
        # Lazy: vLLM and transformers load when the CPU stand-in builds or runs its engine, after vLLM's platform and
        # the patches are in place.
        from vllm.v1.utils import bind_kv_cache

        dtype = self.vllm_config.model_config.dtype
        caches = {name: torch.zeros(shape, dtype=dtype) for name, shape in cfg["shapes"].items()}
        bind_kv_cache(caches, self.vllm_config.compilation_config.static_forward_context,
                      self.model_runner.kv_caches)


class _EngineCore:
    """The in-process engine core as the recipe's KV-cache functions see it (one worker)."""

    def __init__(self, worker: _Worker, kv_cache_config: dict) -> None:
        self.vllm_config = worker.vllm_config
        self.model_executor = SimpleNamespace(driver_worker=SimpleNamespace(worker=worker),
                                              collective_rpc=self._collective_rpc)
        self.scheduler = SimpleNamespace(reset_prefix_cache=lambda: True)  # no request outlives generate()
        self._worker = worker
        setattr(self, KEPT_ATTR, [kv_cache_config])

    def _collective_rpc(self, method: Any, timeout: Optional[float] = None, args: tuple = (),
                        kwargs: Optional[dict] = None) -> list:
        fn = getattr(self._worker, method) if isinstance(method, str) else (lambda *a, **k: method(self._worker, *a, **k))
        return [fn(*args, **(kwargs or {}))]


def llm_init(self, model: str, *, tensor_parallel_size: int = 1, dtype: str = "auto", seed: Optional[int] = None,
             enforce_eager: bool = False, max_model_len: Optional[int] = None, trust_remote_code: bool = False,
             **kwargs: Any) -> None:
    """Stand-in for vllm.LLM.__init__ (CPU platform): vLLM's engine config and model, no scheduler."""
    # Lazy: vLLM and transformers load when the CPU stand-in builds or runs its engine, after vLLM's platform and the
    # patches are in place.
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    if not enforce_eager:
        raise CpuEngineError("the CPU engine has no graph capture: set actor_rollout_ref.rollout.enforce_eager=True "
                             "on the CPU platform")
    if not dist.is_initialized():
        raise CpuEngineError("the CPU engine joins the training ranks' process group (vLLM's external launcher): "
                             "torch.distributed must be initialised first")
    for unsupported in ("enable_sleep_mode", "enable_lora"):
        if kwargs.get(unsupported):
            raise CpuEngineError(f"the CPU engine does not implement {unsupported}")
    known = {f for f in EngineArgs.__dataclass_fields__}
    engine_kwargs = {k: v for k, v in kwargs.items() if k in known}
    ignored = sorted(set(kwargs) - known - {"additional_config"})
    if ignored:
        logger.info("CPU engine: vLLM engine arguments without meaning here: %s", ignored)
    args = EngineArgs(model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
                      enforce_eager=True, max_model_len=max_model_len, trust_remote_code=trust_remote_code,
                      **engine_kwargs)
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        # What vLLM's worker does under the external launcher: its groups over the existing world.
        init_worker_distributed_environment(vllm_config, dist.get_rank(), "env://", -1, backend="gloo")
        vllm_model = get_model(vllm_config=vllm_config)
    self.llm_engine = None  # set below; vLLM's own attribute name, read by verl
    worker = _Worker(vllm_config, vllm_model)
    seqs = vllm_config.scheduler_config.max_num_seqs
    blocks = seqs * math.ceil(vllm_config.model_config.max_model_len / BLOCK_SIZE)
    kv_cache_config = {"num_blocks": blocks, "shapes": worker.kv_cache_shapes(blocks)}
    core = _EngineCore(worker, kv_cache_config)
    worker.initialize_from_config([kv_cache_config])  # vLLM allocates its cache while building the engine
    self.llm_engine = SimpleNamespace(model_executor=core.model_executor,
                                      engine_core=SimpleNamespace(engine_core=core))
    self._cpu_generator = _Generator(vllm_config, vllm_model)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"verl_patches: vLLM engine on the CPU platform: generation by the stand-in, {STAND_IN}", flush=True)


def llm_generate(self, prompts: Any = None, sampling_params: Any = None, prompt_token_ids: Any = None,
                 use_tqdm: Any = True, lora_request: Any = None, prompt_adapter_request: Any = None,
                 guided_options_request: Any = None, priority: Any = None) -> list:
    """Stand-in for vllm.LLM.generate (CPU platform): token-id prompts in, vLLM RequestOutputs out."""
    if lora_request is not None and any(lora_request if isinstance(lora_request, list) else [lora_request]):
        raise CpuEngineError("the CPU engine does not implement LoRA")
    if prompt_token_ids is not None:
        prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids]
    if not isinstance(prompts, (list, tuple)):
        prompts = [prompts]
    token_ids = []
    for p in prompts:
        if not isinstance(p, dict) or "prompt_token_ids" not in p:
            raise CpuEngineError("the CPU engine takes token-id prompts ({'prompt_token_ids': [...]}), as verl sends")
        token_ids.append([int(t) for t in p["prompt_token_ids"]])
    params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(token_ids)

    outputs = self._cpu_generator.generate(token_ids, params, rebalance=rebalance_setup(self))
    # Into the sharding manager's timing dict (verl's channel from the generation workers to the
    # driver's metrics), which patch verl.sharding_manager.reshard leaves on the engine.
    timing = stash.get(self, "timing")
    if timing is not None:
        for key, value in self._cpu_generator.last_figures.items():
            timing[key] = timing.get(key, 0.0) + value
    return outputs


def rebalance_setup(llm: Any) -> Any:
    """The rebalance the generation runs (a ``RebalanceSetup``), or None when it is off: from the rollout
    settings the rollout patch left on vLLM's LLM (recipe.rebalance*; verl_patches/rollout/settings.py)."""
    rollout = stash.get(llm, STASH_KEY)
    if rollout is None or not rollout.recipe.rebalance:
        return None

    return RebalanceSetup(RebalancePolicy.from_settings(rollout.recipe), rollout.recipe.rebalance_cpu_stagger)


class _Generator:
    def __init__(self, vllm_config: Any, vllm_model: torch.nn.Module) -> None:
        self.vllm_config, self.vllm_model = vllm_config, vllm_model
        self._hf: Optional[torch.nn.Module] = None
        self._placements = None
        self.last_figures: dict[str, float] = {}  # the last generate's rebalance figures (rollout/...)

    def _placements_for_rollout(self) -> Any:
        if self._placements is None:
            cfg = ModelConfig.from_hf(self.vllm_config.model_config.hf_config.to_dict())
            par = self.vllm_config.parallel_config
            tp, dp = par.tensor_parallel_size, par.data_parallel_size
            rollout = derive_rollout_layout(cfg, RolloutLayout(tp, dp, dist.get_world_size() // (tp * dp)),
                                            vllm_params(self.vllm_model))
            # Only the rollout side is read here; any valid training layout will do.
            self._placements = build_placements(cfg, TrainLayout(1, 1, 1, ()), rollout)
        return self._placements

    def _load_hf(self) -> torch.nn.Module:
        """transformers' DeepseekV3 holding exactly the rollout shards of every rank (gathered)."""
        local = {n: t.detach().clone() for n, t in vllm_params(self.vllm_model).items()}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        placements = self._placements_for_rollout()
        dtype = self.vllm_config.model_config.dtype
        state = to_hf(placements, assemble(placements, "rollout", dict(enumerate(everyone)), dtype))
        if self._hf is None:
            # Lazy: vLLM and transformers load when the CPU stand-in builds or runs its engine, after vLLM's platform
            # and the patches are in place.
            from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

            cfg = {k: v for k, v in self.vllm_config.model_config.hf_config.to_dict().items()
                   if k not in ("architectures", "transformers_version", "torch_dtype")}
            config = DeepseekV3Config(**cfg)
            config._attn_implementation = "eager"
            # Its random initialisation (overwritten right away) must not draw from the generation's
            # random stream, or the first generation after a resume would sample differently.
            with torch.random.fork_rng(devices=[]):
                self._hf = DeepseekV3ForCausalLM(config).to(dtype).eval()
        missing = sorted(set(dict(self._hf.named_parameters())) - set(state))
        if missing:
            raise CpuEngineError(f"the rollout shards do not cover transformers' parameters {missing[:4]}")
        self._hf.load_state_dict(state, strict=False)
        return self._hf

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: Sequence[Any], rebalance: Any = None) -> list:
        """vLLM's RequestOutputs for ``prompts``. ``rebalance`` (a ``RebalanceSetup``, patch
        verl.vllm_rollout.recipe_engine; None: off): decode in lockstep with the other ranks of vLLM's
        DP group and move unfinished requests between them (verl_patches/rollout/long_tail/migrate.py)."""
        # Lazy: vLLM and transformers load when the CPU stand-in builds or runs its engine, after vLLM's platform and
        # the patches are in place.
        from vllm.outputs import CompletionOutput, RequestOutput

        model = self._load_hf()
        hf_cfg = self.vllm_config.model_config.hf_config
        eos = getattr(hf_cfg, "eos_token_id", None)
        rows = [(i, s) for i, p in enumerate(params) for s in range(int(p.n))]
        seeds = request_seeds([params[i] for i, _ in rows], [s for _, s in rows])
        lockstep, arrival = None, 0
        if rebalance is not None and rebalance.policy.enabled:
            lockstep, arrival = self._lockstep(rebalance)
        sequences = _sample(model, [prompts[i] for i, _ in rows], [params[i] for i, _ in rows], eos,
                            pad=int(getattr(hf_cfg, "pad_token_id", None) or 0), seeds=seeds, lockstep=lockstep,
                            arrival=arrival, capacity=int(self.vllm_config.scheduler_config.max_num_seqs))
        self.last_figures = lockstep.stats.figures() if lockstep is not None else {}
        outputs = []
        for i, ids in enumerate(prompts):
            samples = []
            for (j, s), (seq, reason, lps) in zip(rows, sequences):
                if j != i:
                    continue
                # vLLM returns the sampled tokens' log-probs when SamplingParams.logprobs is set (verl
                # always sets 0): one {token: Logprob} per position, their sum as cumulative_logprob.
                wanted = getattr(params[i], "logprobs", None) is not None
                samples.append(CompletionOutput(index=s, text="", token_ids=seq,
                                                cumulative_logprob=sum(lp.logprob for d in lps for lp in d.values())
                                                if wanted else None,
                                                logprobs=lps if wanted else None, finish_reason=reason))
            outputs.append(RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=ids, prompt_logprobs=None,
                                         outputs=samples, finished=True))
        return outputs

    def _lockstep(self, setup: Any) -> tuple[Any, int]:
        """The lockstep over vLLM's DP group (its gloo group), and this rank's arrival step under the
        test-only stagger (recipe.rebalance_cpu_stagger)."""
        # Lazy: vLLM and transformers load when the CPU stand-in builds or runs its engine, after vLLM's platform and
        # the patches are in place.
        from vllm.distributed import parallel_state as ps

        coord = ps.get_dp_group()
        # A moved request goes on computing on another rank: the same arithmetic only at the same
        # thread count (a kernel may split a reduction by threads), so the group must agree on it.
        threads: list[Any] = [None] * coord.world_size
        torch.distributed.all_gather_object(threads, torch.get_num_threads(), group=coord.cpu_group)
        if len(set(threads)) > 1:
            raise CpuEngineError(f"recipe.rebalance moves requests between the DP ranks, whose torch thread counts "
                                 f"differ ({threads}, by rank of vLLM's DP group): set one OMP_NUM_THREADS for "
                                 f"every worker, or turn rebalance off")
        seqs = int(self.vllm_config.scheduler_config.max_num_seqs)
        # The CPU engine is eager (no graph is captured, whatever torchair_graph_config says): the group
        # steps at its fullest rank's batch, so every batch size is a graph size.
        lockstep = Lockstep(coord.cpu_group, setup.policy, eager_graph_sizes(seqs), seqs)
        return lockstep, int(setup.stagger) * coord.rank_in_group


def request_seeds(params: Sequence[Any], sample_index: Sequence[int]) -> list[int]:
    """One sampling seed per request (row), so that a request samples the same tokens on any rank and in
    any batch: vLLM's own per-request seed where SamplingParams.seed is set (seed + index for the n
    samples of a prompt, as vLLM 0.9.1's parallel sampling gives its children), else drawn from the
    rank's generation stream (torch's default generator, which verl sets per DP group), one per row in
    the original request order."""
    drawn = torch.randint(0, 2**62, (len(params),), dtype=torch.int64).tolist() if params else []
    return [int(p.seed) + int(s) if getattr(p, "seed", None) is not None else d
            for p, s, d in zip(params, sample_index, drawn)]


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop = probs.cumsum(-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM 0.9.1's V1 sampler returns for the sampled token with logprobs=0: the log-softmax
    in float32 of the model's raw logits (before temperature, top-k / top-p and penalties; its
    Sampler.compute_logprobs) and the token's rank in the vocabulary (1 = most likely).
    logits [n, vocab], tokens [n] -> (log-probs [n], ranks [n])."""
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1))
    ranks = (logprobs > chosen).sum(-1) + 1
    return chosen.squeeze(-1), ranks


class RequestState:
    """One request of the stand-in's decode: what it needs to go on generating on any rank, and what
    a move sends (``pack``): prompt, generated tokens, their log-probs, its sampling generator's state
    and its KV cache (transformers' per-layer key and value tensors of the request's own positions,
    no padding)."""

    def __init__(self, prompt: list[int], params: Any, seed: int) -> None:
        self.prompt, self.params = list(prompt), params
        self.out: list[int] = []
        self.lps: list[tuple[float, int]] = []
        self.generator = torch.Generator().manual_seed(int(seed))
        self.kv: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None  # None: not prefilled yet
        self.reason: Optional[str] = None

    def weight(self) -> int:
        """Tokens whose KV a move carries."""
        return len(self.prompt) + len(self.out)

    def pack(self) -> dict:
        return {"prompt": self.prompt, "params": self.params, "out": self.out, "lps": self.lps,
                "generator": self.generator.get_state(), "kv": self.kv}

    @classmethod
    def unpack(cls, d: dict) -> "RequestState":
        state = cls(d["prompt"], d["params"], 0)
        state.out, state.lps, state.kv = list(d["out"]), list(d["lps"]), d["kv"]
        state.generator.set_state(d["generator"])
        return state

    def kv_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv or ())


def _forward(model: torch.nn.Module, batch: list[RequestState]) -> torch.Tensor:
    """One step over ``batch``: prefill for requests without KV (all of the batch) or one decode step
    for requests with KV (all of it); returns each request's last-position logits [len(batch), vocab].

    Batch-invariant by construction: every request gets a forward of its own (``_forward_one``, one
    row, no padding), so the arithmetic a request's logits and KV come from is a function of that
    request alone: the same operators on the same shapes with the same inputs, whichever requests
    share the step, how many there are, and on which DP rank it runs. A batched, left-padded forward
    would not be: BLAS and oneDNN choose their blocking, and with it the order of a reduction, by
    the matrix's shape (rows in the batch, padded width), and which order they choose differs
    between CPU models (it held on one AMD EPYC and broke on an AVX-512 Intel Xeon). What is left
    is the process's thread count, which the rebalance's lockstep requires to be the same on every
    rank of the DP group (``_lockstep``). tests/rollout/long_tail/test_migrate.py checks the
    invariance at 1 and 2 threads, for batches of 1, 3, 8 and 17 requests.

    The cost is one forward per request instead of one per step, and the tiny model's forward is
    mostly per-call overhead (transformers' MoE loops over its experts in Python): the tiny run's
    generation takes several times as long as batched (``bash scripts/train_tiny.sh`` prints it per
    step; docs/TINY_RUN.md gives the measured range)."""
    prefill = batch[0].kv is None
    if any((s.kv is None) != prefill for s in batch):
        raise CpuEngineError("a forward mixes prefill and decode requests")
    return torch.cat([_forward_one(model, s) for s in batch])


def _forward_one(model: torch.nn.Module, state: RequestState) -> torch.Tensor:
    """One request's forward, alone: its prompt (prefill) or its last token over its own KV (decode).
    Its KV becomes the request's own positions again; returns the last position's logits [1, vocab]."""
    # Lazy: vLLM and transformers load when the CPU stand-in builds or runs its engine, after vLLM's platform and the
    # patches are in place.
    from transformers import DynamicCache

    if state.kv is None:
        ids = torch.tensor([state.prompt], dtype=torch.long)
        past, start = None, 0
    else:
        past = DynamicCache()
        for layer, (keys, values) in enumerate(state.kv):
            past.update(keys.unsqueeze(0), values.unsqueeze(0), layer)
        ids = torch.tensor([[state.out[-1]]], dtype=torch.long)
        start = state.kv[0][0].shape[-2]
    positions = torch.arange(start, start + ids.shape[1], dtype=torch.long).unsqueeze(0)
    mask = torch.ones((1, start + ids.shape[1]), dtype=torch.long)
    res = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
    cache = res.past_key_values
    state.kv = [(cache[layer][0][0].clone(), cache[layer][1][0].clone()) for layer in range(len(cache))]
    return res.logits[:, -1]


def _sample_next(state: RequestState, logits: torch.Tensor, eos: Optional[int]) -> None:
    """Sample the request's next token from its row of logits with its own generator; record the
    token's log-prob as vLLM returns it (``sampled_logprobs``) and whether the request finished."""
    p = state.params
    if p.temperature <= 0:
        tok = int(torch.argmax(logits))
    else:
        filtered = _filter(logits.float() / p.temperature, int(p.top_k), float(p.top_p))
        tok = int(torch.multinomial(torch.softmax(filtered, -1), 1, generator=state.generator))
    lp, rank = sampled_logprobs(logits.unsqueeze(0), torch.tensor([tok]))
    state.out.append(tok)
    state.lps.append((float(lp[0]), int(rank[0])))
    if eos is not None and tok == eos and not p.ignore_eos:
        state.reason = "stop"
    elif len(state.out) >= int(p.max_tokens):
        state.reason = "length"


def _sample(model: torch.nn.Module, prompts: list[list[int]], params: list[Any], eos: Optional[int],
            pad: int, seeds: Sequence[int], lockstep: Any = None, arrival: int = 0,
            capacity: Optional[int] = None) -> list[tuple[list[int], str, list[dict[int, Any]]]]:
    """Sampling with a KV cache per request: each step, one forward per running request (``_forward``:
    a request's logits do not depend on its neighbours, by construction),
    each request sampling with its own generator (``seeds``, ``request_seeds``): per-row temperature /
    top-k / top-p / max_tokens / ignore_eos, temperature 0 greedy. Each row also gets its sampled
    tokens' log-probs as vLLM returns them (``sampled_logprobs``): one {token_id: Logprob} per position.

    At most ``capacity`` requests run at once (vLLM's max_num_seqs), admitted in order from step
    ``arrival`` (0; the test-only stagger delays a DP rank's). With ``lockstep``
    (verl_patches/rollout/long_tail/migrate.py), every step ends with the DP group's check and the moves it
    plans, and the outputs come back to their original rank and order at the end. ``pad`` is
    unused: no request is padded (kept for the callers' signature)."""
    # Lazy: vLLM and transformers load when the CPU stand-in builds or runs its engine, after vLLM's platform and the
    # patches are in place.
    from vllm.sequence import Logprob

    del pad
    states = [RequestState(p, sp, seed) for p, sp, seed in zip(prompts, params, seeds)]
    ids = lockstep.begin(len(states)) if lockstep is not None else list(range(len(states)))
    waiting = deque(zip(ids, states))
    running: dict[int, RequestState] = {}
    finished: dict[int, RequestState] = {}
    capacity = capacity or max(1, len(states))
    step = 0
    while True:
        if step >= arrival:
            while waiting and len(running) < capacity:
                rid, state = waiting.popleft()
                running[rid] = state
        for group in ([s for s in running.values() if s.kv is None], [s for s in running.values() if s.kv is not None]):
            if group:
                # Both lists are taken before either forward: a request prefilled now decodes next step.
                logits = _forward(model, group)
                for s, row in zip(group, logits):
                    _sample_next(s, row, eos)
        for rid in [rid for rid, s in running.items() if s.reason is not None]:
            finished[rid] = running.pop(rid)
        step += 1
        if lockstep is None:
            if not running and not waiting:
                break
            continue
        busy, moves = lockstep.check({rid: s.weight() for rid, s in running.items()}, len(waiting))
        if not busy:
            break
        if moves:
            me = lockstep.rank
            outgoing = {m.request: running.pop(m.request).pack() for m in moves if m.src == me}
            for rid, packed in lockstep.move(moves, outgoing).items():
                running[rid] = RequestState.unpack(packed)
    if lockstep is not None:
        done = lockstep.restore({rid: (s.out, s.reason, s.lps) for rid, s in finished.items()})
    else:
        done = [(finished[rid].out, finished[rid].reason, finished[rid].lps) for rid in ids]
    return [(list(out), reason, [{t: Logprob(logprob=lp, rank=rk)} for t, (lp, rk) in zip(out, lps)])
            for out, reason, lps in done]
