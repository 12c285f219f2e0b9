"""MindSpeed reads recipe.megatron's flags as its own argument defaults (Ascend only).

Upstream: mindspeed/arguments.py:process_args(parser), which adds MindSpeed's arguments to the
parser that mindspeed.megatron_adaptor.get_mindspeed_args parses from the command line when the
adaptor is imported; the parsed values decide which feature patches MindSpeed registers. We wrap
it: after upstream has added its arguments, the values the worker binding recorded
(verl_patches.megatron_args.pending_mindspeed_args: --moe-tp-extend-ep, --swap-optimizer,
--use-flash-attn, --use-fused-rotary-pos-emb, --use-fused-swiglu, --num-layer-list) become the
parser's defaults, so a flag given on the command line still wins. MindSpeed is not installed off
Ascend; the fingerprint was computed from MindSpeed's public source (commit in extra["source_commit"]).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

# The MindSpeed source the fingerprint was computed from (github.com/Ascend/MindSpeed, mirror of
# gitee.com/ascend/MindSpeed): mindspeed/arguments.py at this commit.
SOURCE_COMMIT = "02c49f5de19657b7d4b73f3f024f66ffbcace5ae"


def wrap_process_args(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def process_args(parser):
        parser = original(parser)
        from verl_patches.megatron_args import pending_mindspeed_args

        pending = pending_mindspeed_args()
        if pending:
            parser.set_defaults(**pending)
        return parser

    return process_args


PATCHES = [
    Patch(
        id="mindspeed.recipe_megatron_args",
        target="mindspeed.arguments:process_args",
        kind="wrap",
        phases=("worker",),
        upstream="mindspeed",
        versions=">=0",
        fingerprint=Fingerprint(signature="def process_args(parser)", source_sha="f9100d4330cec208"),
        replacement=f"{__name__}:wrap_process_args",
        flag="actor_rollout_ref.rollout.recipe.megatron (recorded by verl.recipe_megatron.binding)",
        why="MindSpeed takes its feature switches only from its parsed arguments (normally the training "
            "script's command line); a verl Ray worker has no such command line, so the recipe's "
            "moe_tp_extend_ep, swap optimizer, flash attention, fused RoPE / SwiGLU and layer list would "
            "never reach it.",
        remove_when="MindSpeed's repatch(dict) (later branches) is called by verl with these values, or "
                    "MindSpeed reads a config object instead of the command line.",
        extra={"platforms": ("npu",), "source_commit": SOURCE_COMMIT},
    ),
]
