"""MindSpeed reads recipe.megatron's flags as its own argument defaults (Ascend only).

Upstream: mindspeed/arguments.py:process_args(parser), which adds MindSpeed's arguments to the
parser that mindspeed.megatron_adaptor.get_mindspeed_args parses from the command line when the
adaptor is imported; the parsed values decide which feature patches MindSpeed registers. We wrap
it: after upstream has added its arguments, the values the worker binding recorded
(verl_patches.config.megatron_args.pending_mindspeed_args) become the parser's defaults, so a flag given
on the command line still wins. Defaults reach the parsed namespace even for flags this parser
does not define: at the release, process_args registers the arguments of only a few features
(its module-level FEATURES_LIST), while the feature manager decides by the full list
(create_features_list), e.g. swap_optimizer and use_flash_attn, reading each with getattr.
The fingerprint is from the release the lock pins (RELEASE_TAG at RELEASE_COMMIT), read from its
archive; tests/patches/mindspeed/ run against that package where it is installed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

# configs/upstream.lock.toml [components.mindspeed]; tests/test_lock.py checks they agree.
RELEASE_TAG = "v2.1.0_core_r0.12.1"
RELEASE_COMMIT = "0e3f9d7d30a6a7a7d53ced3215d512bd5756de7d"


def wrap_process_args(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def process_args(parser):
        parser = original(parser)
        from verl_patches.config.megatron_args import pending_mindspeed_args

        pending = pending_mindspeed_args()
        if pending:
            parser.set_defaults(**pending)
        return parser

    return process_args


PATCHES = [
    Patch(
        feature="model_layout",
        id="mindspeed.recipe_megatron_args",
        target="mindspeed.arguments:process_args",
        kind="wrap",
        phases=("worker",),
        upstream="mindspeed",
        # The release's setup.py names its version after the megatron-core it is built for.
        versions="==0.12.1",
        fingerprint=Fingerprint(signature="def process_args(parser)", source_sha="87d0b6d8f3ff8bde"),
        replacement=f"{__name__}:wrap_process_args",
        flag="actor_rollout_ref.rollout.recipe.megatron (recorded by verl.recipe_megatron.binding)",
        why="MindSpeed takes its feature switches only from its parsed arguments (normally the training "
            "script's command line); a verl Ray worker has no such command line, so the recipe's "
            "moe_tp_extend_ep, swap optimizer, flash attention, fused RoPE / SwiGLU and layer list would "
            "never reach it.",
        remove_when="MindSpeed's repatch(dict) (later branches) is called by verl with these values, or "
                    "MindSpeed reads a config object instead of the command line.",
        upstream_ref=f"MindSpeed {RELEASE_TAG} ({RELEASE_COMMIT})",
        platforms=("npu",), extra={"source_commit": RELEASE_COMMIT},
    ),
]
