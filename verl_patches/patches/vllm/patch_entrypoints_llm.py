"""vllm.LLM's sleep / wake_up reach the switch loop's steps when the recipe's rollout attached its memory.

Upstream: vllm/entrypoints/llm.py:LLM.sleep and LLM.wake_up drive sleep mode (a memory pool
that does not free memory on multi-node NPU, and that the recipe turns off). verl 0.4.1's
MegatronVLLMShardingManager calls wake_up(tags=["weights"]) before loading weights,
wake_up(tags=["kv_cache"]) after, and sleep(level=1) when generation is done. We wrap both:
on an engine the recipe's rollout built (attach_engine_memory), each call runs its row of the
switch loop's call -> step table (verl_patches/offload/live.py:CALLS), so verl's own switch frees
memory for real, in the loop's order. Any other engine gets the original.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from verl_patches.core import stash
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

# Set on the vllm.LLM instance by the rollout patch (verl_patches.rollout.engine_memory.attach_engine_memory).
MEMORY_ATTR = stash.attr("memory")


def _switch(llm: Any) -> Any:
    """The switch loop that holds the engine's memory, or None (upstream's sleep mode)."""
    memory = getattr(llm, MEMORY_ATTR, None)
    if memory is None:
        return None
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.offload.live import live_switch
    from verl_patches.offload.schedule import ScheduleError

    switch = live_switch()
    if not any(m is memory for m in switch.members):
        raise ScheduleError("this vLLM engine's memory is not in the process's switch loop (closed, or set by hand); "
                            "attach it with attach_engine_memory(llm, memory)")
    return switch


def wrap_sleep(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def sleep(self, level: int = 1):
        switch = _switch(self)
        if switch is None:
            return original(self, level)
        # Generation is over: the KV cache, then the weights, are freed (no copy).
        switch.run_call("LLM.sleep")

    return sleep


def wrap_wake_up(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wake_up(self, tags: Optional[list[str]] = None):
        switch = _switch(self)
        if switch is None:
            return original(self, tags)
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.offload.live import WAKE_TAGS, switch_call, wake_call

        unknown = set(tags or ()) - set(WAKE_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags {sorted(unknown)}: expected 'weights' and/or 'kv_cache'")
        # In the loop's order (weights before the cache: the reshard writes them while the cache's
        # memory is still free).
        wanted = [t for t in WAKE_TAGS if tags is None or t in tags]
        for tag in sorted(wanted, key=lambda t: switch.step_names.index(switch_call(wake_call(t)).reaches[0])):
            switch.run_call(wake_call(tag))

    return wake_up


_FLAG = ("actor_rollout_ref.rollout.recipe.offload (default True; the rollout attaches its memory to the "
         "engine only then)")
_REMOVE = ("verl's sharding manager calls the rollout's onload / offload / init-cache / free-cache methods "
           "itself (a sharding-manager patch), or vLLM's sleep mode frees device memory on multi-node NPU.")

PATCHES = [
    Patch(
        feature="switch",
        id="vllm.llm.sleep_to_offload",
        target="vllm.entrypoints.llm:LLM.sleep",
        kind="wrap",
        phases=("worker",),
        upstream="vllm",
        versions="==0.9.1",
        fingerprint=Fingerprint(signature="def sleep(self, level: int=1)", source_sha="59440a3d8da0085d"),
        replacement=f"{__name__}:wrap_sleep",
        flag=_FLAG,
        why="verl's sharding manager puts the engine to sleep after generation; with the recipe's sleep mode off "
            "that frees nothing, so the call frees the KV cache and the rollout weights through the offload "
            "engine instead (docs/RECIPE.md item 2).",
        remove_when=_REMOVE,
    ),
    Patch(
        feature="switch",
        id="vllm.llm.wake_up_to_onload", requires=("vllm.llm.sleep_to_offload",),
        target="vllm.entrypoints.llm:LLM.wake_up",
        kind="wrap",
        phases=("worker",),
        upstream="vllm",
        versions="==0.9.1",
        fingerprint=Fingerprint(signature="def wake_up(self, tags: Optional[list[str]]=None)",
                                source_sha="f50718b968b300df"),
        replacement=f"{__name__}:wrap_wake_up",
        flag=_FLAG,
        why="verl's sharding manager wakes the engine's weights before resharding into them and its KV cache "
            "after; the recipe's weights and cache were freed by the offload engine, so these calls allocate "
            "them again through it (docs/RECIPE.md items 2 and 8).",
        remove_when=_REMOVE,
    ),
]
