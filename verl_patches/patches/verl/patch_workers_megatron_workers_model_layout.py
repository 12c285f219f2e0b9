"""The reference shares the actor's process group. verl's trainer builds the Megatron reference as its own
worker (role "ref") in the actor's process (create_colocated_worker_cls); its constructor sees
torch.distributed initialised by the actor worker and skips initialize_model_parallel, so the model is
built with the actor's groups and ``ref.megatron``'s layout keys are silently ignored. We check they agree
with the process's groups and name each that differs. Role "actor_rollout_ref" does not build in 0.4.1
(init_model's reference branch gets the actor's 5-tuple from _build_model_optimizer, and
``_ref_is_offload_param`` is set only in an elif that role skips): we refuse it with that explanation.
Left as upstream has it: with random init (load_weight=False) the reference is not a copy of the actor.
Both constructors seed the same RNGs, then the trainer builds the reference first, so the actor's init
draws from a later RNG state (the KL starts above zero; throughput is unaffected).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

_W = "verl.workers.megatron_workers:ActorRolloutRefWorker."
_COMMON_OWN = dict(kind="wrap", phases=("worker",), upstream="verl", versions="==0.4.1")

# -- the reference in the actor's process ------------------------------------------------------

# ref.megatron key -> megatron.core.parallel_state getter of the size the process was initialised with
LAYOUT_KEYS = {
    "tensor_model_parallel_size": "get_tensor_model_parallel_world_size",
    "pipeline_model_parallel_size": "get_pipeline_model_parallel_world_size",
    "virtual_pipeline_model_parallel_size": "get_virtual_pipeline_model_parallel_world_size",
    "context_parallel_size": "get_context_parallel_world_size",
    "expert_model_parallel_size": "get_expert_model_parallel_world_size",
    "expert_tensor_parallel_size": "get_expert_tensor_parallel_world_size",
}


def layout_mismatches(configured: Any, actual: dict) -> list[str]:
    """Keys of ``configured`` (ref.megatron) that differ from the process's groups. Unset (None)
    expert TP means TP, unset VPP means none, as megatron-core reads them."""
    out = []
    for key, have in actual.items():
        want = configured.get(key, None) if hasattr(configured, "get") else None
        if want is None and key == "expert_tensor_parallel_size":
            want = actual["tensor_model_parallel_size"]
        if key == "virtual_pipeline_model_parallel_size" and want in (None, 1) and have in (None, 1):
            continue
        if want is not None and want != have:
            out.append(f"ref.megatron.{key}={want} but the process's groups have {have}")
    return out


def _process_layout() -> dict:
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from megatron.core import parallel_state as mpu

    return {k: getattr(mpu, getter)() for k, getter in LAYOUT_KEYS.items()}


def wrap_init_model_shared_groups(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_model(self):
        if self._is_ref and self._is_actor:
            raise ValueError(
                f"role {self.role!r}: verl 0.4.1's Megatron ActorRolloutRefWorker cannot hold the reference in the "
                "actor's worker (init_model's reference branch receives the actor's model and optimizer from "
                "_build_model_optimizer, and _ref_is_offload_param is never set for this role); use the colocated "
                "'actor_rollout' and 'ref' workers, as verl's trainer does")
        if self._is_ref:
            bad = layout_mismatches(self.config.ref.megatron, _process_layout())
            if bad:
                raise ValueError("the reference shares the actor's process group (its worker skips "
                                 "initialize_model_parallel), so its layout must be the actor's: " + "; ".join(bad))
        return original(self)

    return init_model


PATCHES = [
    Patch(
        feature="model_layout",
        id="verl.megatron_worker.ref_shares_actor_groups",
        target=_W + "init_model",
        fingerprint=Fingerprint(signature="def init_model(self)", source_sha="b43dfa697a54895c"),
        replacement=f"{__name__}:wrap_init_model_shared_groups",
        flag="always on (checks only): actor_rollout_ref.ref.megatron.{tensor,pipeline,virtual_pipeline,context,"
             "expert,expert_tensor}_model_parallel_size",
        why="The colocated reference worker skips initialize_model_parallel (the actor's worker did it in the same "
            "process) and builds its model with the actor's groups, silently ignoring ref.megatron's layout; a "
            "different layout would load a checkpoint into the wrong shards. Each differing key is named. Role "
            "actor_rollout_ref cannot build in 0.4.1 and is refused with the reason instead of an unpack error.",
        remove_when="verl's Megatron worker checks the reference layout against the shared groups (or derives it "
                    "from the actor's) and builds role actor_rollout_ref.",
        **_COMMON_OWN,
    ),
]
