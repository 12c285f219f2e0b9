"""The parameter gather megatron-core defers to the next forward, finished when verl's update returns.

Upstream: verl/workers/actor/megatron_actor.py:MegatronPPOActor.update_policy runs the optimizer
steps. With ``overlap_param_gather`` (patch verl.ddp_overlap.get_model) megatron-core 0.12.1's
distributed optimizer no longer all-gathers the updated shards in its step: the next forward's
pre-hooks do, one DDP bucket at a time, overlapped with compute. Until then each rank's parameters outside
its own shard are those of before the step, and in verl the next reader is not a forward but the
reshard to the rollout (then the switch's offload, a checkpoint). We wrap it: after upstream
returns, every gather still due is finished (verl_patches/train/ddp_overlap.py:complete_param_gather) and
the chunks are checked settled. Between the steps of one update (several mini-batches or epochs)
the gather still overlaps the next forward. Without the overlap nothing is due and nothing runs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.train.ddp_overlap import FLAG, REMOVE_WHEN, check_settled, complete_param_gather


def wrap_update_policy(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_policy(self, dataloader):
        out = original(self, dataloader)

        complete_param_gather(self.actor_module)
        check_settled(self.actor_module, "the actor after its update")
        return out

    return update_policy


PATCHES = [
    Patch(
        id="verl.ddp_overlap.update_policy",
        target="verl.workers.actor.megatron_actor:MegatronPPOActor.update_policy",
        kind="wrap", phases=("worker",), upstream="verl", versions="==0.4.1", feature="model_layout", flag=FLAG,
        fingerprint=Fingerprint(signature="def update_policy(self, dataloader: Iterable[DataProto]) -> Dict",
                                source_sha="64d3665802aee83a"),
        replacement=f"{__name__}:wrap_update_policy",
        why="With overlap_param_gather megatron-core leaves each rank's parameters outside its shard as they were "
            "before the step until the next forward; verl's next reader is the reshard to the rollout, which would "
            "send them stale. The gather due is finished when the update returns.",
        remove_when=REMOVE_WHEN,
        requires=("verl.ddp_overlap.get_model",),
        after=("verl.old_log_prob.update_policy",),
    ),
]
