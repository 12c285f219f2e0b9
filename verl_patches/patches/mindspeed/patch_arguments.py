"""MindSpeed reads recipe.megatron's flags as its own argument defaults (Ascend only).

Upstream: mindspeed/features_manager/features_manager.py:MindSpeedFeaturesManager.register_features_args
(parser), which adds the arguments of every feature in MindSpeed's feature list to a parser. At the
release the lock pins, both of MindSpeed's parses go through it: get_mindspeed_args
(mindspeed/args_utils.py), which mindspeed.megatron_adaptor calls when it is imported and whose parsed
values decide which feature patches MindSpeed registers, and Megatron's parse_args as MindSpeed wraps
it (mindspeed/core/megatron_basic/arguments_basic.py, extra_args_provider_decorator; MindSpeed-LLM's
argument parser calls it too). We wrap it: after upstream has added its arguments, the values the worker
binding recorded (verl_patches.config.megatron_args.pending_mindspeed_args) become the parser's
defaults, so a flag given on the command line still wins. Defaults reach the parsed namespace even for
flags no feature defines (num_layer_list is MindSpeed-LLM's), and the features read each with getattr.
Until v2.1.0_core_r0.12.1 the adaptor parsed with mindspeed.arguments:process_args, the target this
patch had then; from v2.2.0_core_r0.12.1 the adaptor no longer calls process_args (its fingerprint is
unchanged, so only a test of the hand-over could tell: tests/patches/mindspeed/test_mindspeed_release.py).
The fingerprint is from the release the lock pins (RELEASE_TAG at RELEASE_COMMIT), read from its
archive; tests/patches/mindspeed/ run against that package where it is installed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.config.megatron_args import pending_mindspeed_args

# configs/upstream.lock.toml [components.mindspeed]; tests/test_lock.py checks they agree.
RELEASE_TAG = "v2.2.0_core_r0.12.1"
RELEASE_COMMIT = "f321067c6fd1e32ad74848416942bdb899cf9627"


def wrap_register_features_args(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of the classmethod's function (the patch machinery re-wraps it as a classmethod)."""

    @functools.wraps(original)
    def register_features_args(cls, parser):
        result = original(cls, parser)

        pending = pending_mindspeed_args()
        if pending:
            parser.set_defaults(**pending)
        return result

    return register_features_args


PATCHES = [
    Patch(
        feature="model_layout",
        id="mindspeed.recipe_megatron_args",
        target="mindspeed.features_manager.features_manager:MindSpeedFeaturesManager.register_features_args",
        kind="wrap",
        phases=("worker",),
        upstream="mindspeed",
        # The release's setup.py names its version after the megatron-core it is built for.
        versions="==0.12.1",
        fingerprint=Fingerprint(signature="def register_features_args(cls, parser)", source_sha="6c299044933b66a0"),
        replacement=f"{__name__}:wrap_register_features_args",
        flag="actor_rollout_ref.rollout.recipe.megatron (recorded by verl.recipe_megatron.binding)",
        why="MindSpeed takes its feature switches only from its parsed arguments (normally the training "
            "script's command line); a verl Ray worker has no such command line, so the recipe's "
            "moe_tp_extend_ep, swap optimizer, flash attention, fused RoPE / SwiGLU and layer list would "
            "never reach it.",
        remove_when="verl calls MindSpeed's repatch(dict) (mindspeed.megatron_adaptor, from v2.2.0_core_r0.12.1) "
                    "with these values before it builds the model, or MindSpeed reads a config object instead of "
                    "the command line.",
        upstream_ref=f"MindSpeed {RELEASE_TAG} ({RELEASE_COMMIT})",
        platforms=("npu",), extra={"source_commit": RELEASE_COMMIT},
    ),
]
