"""A checkpoint's optimizer param groups are matched to this rank's groups by what they are, not by position.

Upstream: megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer.load_state_dict(state_dict)
pairs the checkpoint's param groups with the live optimizer's by index. megatron-core 0.12.1 builds the
groups (optimizer/__init__.py:_get_param_groups) in the order their first parameter is met, so the order
differs between pipeline stages: on stage 0 the first parameter is the embedding (weight decay on), on
later stages a layer norm (weight decay off). The groups are common state of the distributed checkpoint,
written by global rank 0 only and read by every rank. On resume every other stage swaps its groups'
hyperparameters (``wd_mult`` with them): the dense weights of those stages get no weight decay and the
norms get it, and the resumed run leaves the uninterrupted one from its first update (found by the tiny
run's resume check; reported upstream as NVIDIA/Megatron-LM issue 1515).

We reorder the checkpoint's groups to this rank's order by the key upstream groups by (``wd_mult``,
``lr_mult``, ``is_expert_parallel``, ``is_decoupled_lr``) and hand that to upstream's load. A group this
rank has and the checkpoint lacks (only rank 0's groups are saved) is an error naming it: its learning
rate, decay and step would otherwise come from another group.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

GROUP_KEY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


class ParamGroupMismatch(RuntimeError):
    """The checkpoint's optimizer param groups cannot be matched to this rank's."""


def _key(group: dict) -> tuple:
    return tuple(group.get(k) for k in GROUP_KEY)


def _describe(key: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(GROUP_KEY, key))


def align_param_groups(saved: list[dict], live: list[dict]) -> list[dict]:
    """The checkpoint's groups ``saved`` in the order of this rank's groups ``live`` (matched by
    GROUP_KEY); ``saved`` itself when it is already in that order."""
    live_keys = [_key(g) for g in live]
    saved_keys = [_key(g) for g in saved]
    if saved_keys == live_keys:
        return saved
    for name, keys in (("this rank's optimizer", live_keys), ("the checkpoint", saved_keys)):
        if len(set(keys)) != len(keys):
            raise ParamGroupMismatch(
                f"{name} has two param groups with the same {', '.join(GROUP_KEY)}: the checkpoint's groups "
                "cannot be matched to this rank's")
    by_key = dict(zip(saved_keys, saved))
    missing = [k for k in live_keys if k not in by_key]
    if missing:
        raise ParamGroupMismatch(
            "the checkpoint's optimizer param groups (saved by global rank 0 only) lack "
            + "; ".join(f"[{_describe(k)}]" for k in missing)
            + f" that this rank's optimizer has (the checkpoint has {len(saved)}: "
            + "; ".join(f"[{_describe(k)}]" for k in saved_keys)
            + "). Loading would give those parameters another group's learning rate, weight decay and step; "
              "resume from a checkpoint whose rank 0 has every group (same decoupled_lr and lr_mult settings)")
    return [by_key[k] for k in live_keys]


def wrap_load_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        inner = state_dict["optimizer"]
        aligned = align_param_groups(inner["param_groups"], self.optimizer.param_groups)
        if aligned is not inner["param_groups"]:
            state_dict = {**state_dict, "optimizer": {**inner, "param_groups": aligned}}
        return original(self, state_dict)

    return load_state_dict


PATCHES = [
    Patch(
        feature="checkpoint",
        id="megatron.optimizer.param_groups_by_key", upstream_ref="https://github.com/NVIDIA/Megatron-LM/issues/1515",
        target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict",
        kind="wrap",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint("def load_state_dict(self, state_dict)", "eb17c92c806ecabb"),
        replacement=f"{__name__}:wrap_load_state_dict",
        flag="always on (resuming the distributed optimizer from a checkpoint)",
        why="megatron-core saves rank 0's optimizer param groups and loads them by position on every rank, and "
            "the group order differs between pipeline stages: a resumed run swaps weight decay between the dense "
            "weights and the norms of every stage but the first.",
        remove_when="megatron-core builds param groups in one order on every rank (sorted by their key) or saves "
                    "them per rank.",
    ),
]
