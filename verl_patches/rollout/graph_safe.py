"""Graph-safe rollout memory: vLLM's weights and KV cache built inside address-stable regions, so the
graphs captured at engine build stay valid while recipe.offload releases and re-maps them each step.

The rollout constructor calls ``arm_for_build`` before building the engine (graph mode without a
backend is refused there); the worker patches (vllm.worker.stable_regions,
vllm_ascend.worker.stable_regions) run load_model and initialize_from_config inside the regions
and leave the result on the worker; verl_patches.rollout.engine_memory then makes address-stable
offload groups of them. Eager mode (enforce_eager=True) keeps the resize path untouched.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any, Callable, Mapping, Optional

import torch

from verl_patches.base import accelerator
from verl_patches.core import stash
from verl_patches.offload.stable import (Region, StableBackend, StableMemoryError, describe, inside, install_hint,
                                         live_tensors_in, stable_memory, storage_key, storage_span)
from verl_patches.rollout.kv_cache import _tensors
from verl_patches.rollout.mla import derived_tensors

logger = logging.getLogger(__name__)

WEIGHTS, KV_CACHE = "rollout_weights", "rollout_kv_cache"
# Set on vLLM's worker by the patched load_model (read back by engine_memory through collective_rpc).
BUILD_ATTR = stash.attr("stable_build")
PATCH_IDS = ("vllm.worker.stable_regions", "vllm_ascend.worker.stable_regions")  # + their *_kv_cache_region twins
_ARMED: Optional["StableBuild"] = None


class GraphModeError(StableMemoryError):
    """Graph mode asked for where the rollout's memory cannot come back at its captured addresses."""


def armed() -> Optional["StableBuild"]:
    return _ARMED


NPU_ALLOC_CONF = "PYTORCH_NPU_ALLOC_CONF"
NPU_BACKEND = "vllm_ascend_camem"


def expandable_segments(conf: str) -> bool:
    """Whether an allocator setting (``key:value`` pairs separated by commas, as torch_npu's caching
    allocator reads PYTORCH_NPU_ALLOC_CONF) turns expandable segments on."""
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments" and value.strip() == "True":
            return True
    return False


def alloc_conf_conflict(environ: Mapping[str, str] | None = None) -> str | None:
    """Why graph mode's address-stable regions cannot work on NPU with this environment's allocator
    setting, naming the fix; None when they can.

    Expandable segments and the memory pool of vLLM-Ascend's CaMem allocator, which holds the rollout's
    weights and KV-cache regions, do not work together (PyTorch issue 147851, cited by the allocator's
    own assertion); reported publicly for vLLM-Ascend's sleep mode, the same pool, as a release that
    frees nothing (ms-swift issue 6636, fixed there with expandable_segments:False; vllm-ascend pull
    request 9242 proposes turning them off inside the pool). That assertion reads only
    PYTORCH_CUDA_ALLOC_CONF, so nothing upstream stops the NPU variable (docs/RECIPE.md, Expandable segments)."""
    conf = (os.environ if environ is None else environ).get(NPU_ALLOC_CONF, "")
    if not expandable_segments(conf):
        return None
    return (f"{NPU_ALLOC_CONF}={conf!r} turns on expandable segments, and graph mode "
            "(actor_rollout_ref.rollout.enforce_eager=False) with recipe.offload builds the rollout weights and KV "
            "cache in vLLM-Ascend's CaMem pool (address-stable regions), and expandable segments do not work with "
            "such a pool (vLLM-Ascend's sleep mode, the same pool, is reported to free nothing with them). "
            "Unset it or set expandable_segments:False (the launcher's "
            "default, scripts/cluster/recipe_env.sh), or run the rollout eager "
            "(actor_rollout_ref.rollout.enforce_eager=True)")


def arm_for_build(*, enforce_eager: bool, offload: bool, backend: StableBackend | None = None) -> Optional["StableBuild"]:
    """Before the rollout builds its vLLM engine: with graph mode and recipe.offload, choose the
    address-stable backend (GraphModeError naming the fix if there is none, or if on NPU the
    environment turns on expandable segments: :func:`alloc_conf_conflict`) and arm the worker
    patches for this build; otherwise disarm them (eager mode, or vLLM's own sleep mode)."""
    global _ARMED
    _ARMED = None
    if enforce_eager or not offload:
        return None
    # Before the backend is chosen: choosing it makes vLLM-Ascend's CaMemAllocator, whose own check reads
    # only PYTORCH_CUDA_ALLOC_CONF.
    on_npu = backend.name == NPU_BACKEND if backend is not None else accelerator.device_type() == "npu"
    conflict = alloc_conf_conflict() if on_npu else None
    if conflict:
        raise GraphModeError(conflict)
    reason = "given"
    if backend is None:
        backend, reason = stable_memory()
    if backend is None:
        dev = accelerator.device_type()
        raise GraphModeError(
            "actor_rollout_ref.rollout.enforce_eager=False (graph mode) with recipe.offload: the rollout weights and "
            "KV cache are released every step and must come back at the addresses the captured graphs read, which "
            f"needs an address-stable allocator, and there is none on {dev!r} here ({reason}). Set "
            f"actor_rollout_ref.rollout.enforce_eager=True, or install {install_hint(dev)}.")
    logger.info("graph-safe rollout memory: %s", reason)
    _ARMED = StableBuild(backend)
    return _ARMED


def _tensor_slots(obj: Any, depth: int, seen: set[int]):
    """(container, key, tensor) for tensors held by a module or a plain object, a few levels deep
    (impl and quant_method objects, lists, tuples, dicts); the setter rebinds the slot."""
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        for k, b in list(obj._buffers.items()):
            if isinstance(b, torch.Tensor):
                yield obj._buffers, k, b
        items = [(k, v) for k, v in vars(obj).items() if k not in ("_parameters", "_buffers", "_modules")]
        holder: Any = obj
    elif isinstance(obj, dict):
        items, holder = list(obj.items()), obj
    elif isinstance(obj, (list, tuple)):
        items, holder = list(enumerate(obj)), obj
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.Tensor)):
        items, holder = list(vars(obj).items()), obj
    else:
        return
    for k, v in items:
        if isinstance(v, torch.nn.Parameter):
            continue
        if isinstance(v, torch.Tensor):
            yield holder, k, v
        elif not isinstance(v, torch.nn.Module) and (isinstance(v, (dict, list, tuple)) or hasattr(v, "__dict__")):
            yield from _tensor_slots(v, depth - 1, seen)


def _rebind(holder: Any, key: Any, value: torch.Tensor) -> bool:
    if isinstance(holder, tuple):
        return False  # immutable: left for the stray check to name
    if isinstance(holder, (dict, list)):
        holder[key] = value
    else:
        setattr(holder, key, value)
    return True


def _move_out(model: Any, tracked: set[int], ranges: list[tuple[int, int]]) -> list[str]:
    """Clone every tensor the model holds in ``ranges`` (other than ``tracked`` storages) outside
    them and rebind it; returns where. A function of its own so no local keeps an original alive."""
    replaced: dict[int, torch.Tensor] = {}
    where: list[str] = []
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for holder, key, t in list(_tensor_slots(module, 3, seen)):
            if t.device.type == "meta" or storage_key(t) in tracked or not t.untyped_storage().nbytes():
                continue
            if not inside(storage_span(t), ranges):
                continue
            new = replaced.get(id(t))
            if new is None:
                with torch.no_grad():
                    new = replaced[id(t)] = t.detach().clone()
            if _rebind(holder, key, new):
                where.append(f"{mod_name or '<model>'}.{key}")
    return where


class StableBuild:
    """One engine's build inside the regions: which tensors each region holds for the switch."""

    def __init__(self, backend: StableBackend) -> None:
        self.backend = backend
        self.weights = Region(backend, WEIGHTS)
        self.kv = Region(backend, KV_CACHE)
        self.model: Any = None
        self.kv_tensors: list[torch.Tensor] | None = None
        self.moved_out: list[str] = []

    # -- weights ------------------------------------------------------------------------
    def weight_tensors(self, model: Any = None) -> dict[str, torch.Tensor]:
        """What the reshard and the MLA redo write and graphs read: parameters and MLA's derived tensors."""
        model = self.model if model is None else model
        out = dict(model.named_parameters())
        try:
            out.update(derived_tensors(model))
        except ImportError:  # vLLM absent (tests of plain torch models): no MLA layers either
            pass
        return out

    def load_model(self, model_of: Callable[[], Any], original: Callable[[], Any]) -> Any:
        if self.model is not None:
            raise GraphModeError("the rollout engine loaded its model twice in one armed build; the weights region "
                                 "holds the first model (one engine per process)")
        with self.weights.region():
            out = original()
        self.model = model_of()
        self._adopt_weights()
        return out

    def _adopt_weights(self) -> None:
        """Everything load_model left in the weights region that the reshard does not rewrite (rotary
        caches, expert maps, other buffers) moves out of it: its contents would be lost on release."""
        tracked = {storage_key(t) for t in self.weight_tensors().values()}
        self.moved_out = _move_out(self.model, tracked, self.weights.ranges())
        strays = live_tensors_in(self.weights.ranges(), exclude=tracked)
        if strays:
            named = [f"{describe(t)} held by {sorted({type(r).__name__ for r in gc.get_referrers(t) if r is not strays})}"
                     for t in strays[:4]]
            raise GraphModeError(
                f"{len(strays)} tensor(s) besides the rollout parameters and MLA's derived tensors still live in the "
                f"address-stable weights region after load_model ({'; '.join(named)}); their "
                "contents would be lost at every release and nothing rewrites them. Build with enforce_eager=True, or "
                "report the tensor so graph_safe moves it out of the region")
        outside = [n for n, t in self.weight_tensors().items() if not inside(storage_span(t), self.weights.ranges())]
        if outside:
            raise GraphModeError(f"{len(outside)} rollout weight(s) were not allocated in the weights region "
                                 f"(first: {outside[0]}); releasing it would not free them, and graphs would read them "
                                 "at addresses nobody keeps")
        # Blocks freed inside the region (load-time temporaries, the moved-out originals) stay in
        # its pool while the pool lives (empty_cache leaves a live pool's segments alone, seen on
        # CUDA); released with the region, they cost no memory during training.
        if self.moved_out:
            logger.info("graph-safe rollout memory: moved %d tensor(s) out of the weights region: %s",
                        len(self.moved_out), ", ".join(self.moved_out[:8]))

    # -- KV cache -----------------------------------------------------------------------
    def initialize_kv_cache(self, kv_caches_of: Callable[[], Any], original: Callable[[], Any]) -> Any:
        if self.kv_tensors is not None:
            raise GraphModeError("the KV cache was initialised twice in one armed build: in graph mode the cache is "
                                 "released and re-mapped in place, never re-created")
        with self.kv.region():
            out = original()

        self.kv_tensors = list(_tensors(kv_caches_of()))
        ranges = self.kv.ranges()
        outside = [t for t in self.kv_tensors if not inside(storage_span(t), ranges)]
        if not self.kv_tensors or outside:
            raise GraphModeError(f"the KV cache is not in its address-stable region ({len(outside)} of "
                                 f"{len(self.kv_tensors)} tensors outside it)")
        # vLLM's own sleep mode discards everything initialize_from_config allocates (its "kv_cache"
        # tag) and replays its graphs after wake_up: the attention builders' scratch is rebuilt per step.
        return out

    def kv_watch(self, kv_caches_of: Callable[[], Any], forward_context: Callable[[], dict]) -> Callable[[], dict]:
        """The cache tensors graphs read: the runner's list and each attention layer's bound cache."""
        def watch() -> dict[str, torch.Tensor]:
            out = {f"kv_caches[{i}]": t for i, t in enumerate(_tensors(kv_caches_of()))}
            for name, layer in forward_context().items():
                for i, t in enumerate(_tensors(getattr(layer, "kv_cache", []))):
                    out[f"{name}.kv_cache[{i}]"] = t
            return out
        return watch


# -- what the worker patches run (vLLM's GPU Worker, vLLM-Ascend's NPUWorker) ------------------

def worker_load_model(worker: Any, original: Callable[[], Any]) -> Any:
    """Worker.load_model: inside the weights region when a build is armed, else the original."""
    build = armed()
    if build is None:
        return original()
    if worker.vllm_config.model_config.enable_sleep_mode:
        raise GraphModeError("a graph-safe build was armed for an engine with vLLM's sleep mode on: both would put "
                             "the weights in their own memory pool; the recipe's offload turns sleep mode off")
    out = build.load_model(lambda: worker.model_runner.model, original)
    setattr(worker, BUILD_ATTR, build)
    return out


def worker_initialize_from_config(worker: Any, original: Callable[[], Any]) -> Any:
    """Worker.initialize_from_config: inside the KV-cache region when this worker's weights were built in one."""
    build = getattr(worker, BUILD_ATTR, None)
    if build is None:
        return original()
    return build.initialize_kv_cache(lambda: worker.model_runner.kv_caches, original)
