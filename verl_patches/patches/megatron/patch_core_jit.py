"""megatron-core's ``jit_fuser`` reads torch.compile when used, as MindSpeed's adaptor expects, on Ascend.

Upstream: megatron/core/jit.py binds ``jit_fuser = torch.compile`` when it is imported; the fusions
(megatron/core/fusions/fused_bias_dropout.py, fused_bias_swiglu.py, ...) decorate their functions with it
when they are imported. MindSpeed's megatron_basic feature replaces ``torch.compile`` with a call-through
(mindspeed/core/megatron_basic/requirements_basic.py: dummy_compile; "Need replace modules before import
megatron") and relies on megatron being imported after its adaptor. In verl's worker the module that carries
the overlay's prelude (verl/workers/megatron_workers.py) imports megatron-core first, so megatron.core.jit
holds the real torch.compile and every fusion imported later would be compiled by dynamo on the NPU (on the
rehearsal: ``InternalTorchDynamoError`` in bias_dropout_add_fused_train). The prelude applies this record before
MindSpeed-LLM's adaptor (verl_patches/entry_points.py: apply_prelude), whose features import the fusions while
they register (after the adaptor's pre-patches made torch.compile the call-through); the adaptor's rank-start
import refuses if a fusion was imported before
(verl_patches/train/mindspeed_adaptor.py: import_mindspeed_llm_at_rank_start).
"""

from __future__ import annotations

from typing import Any

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def jit_fuser(*args: Any, **kwargs: Any) -> Any:
    """torch.compile as it is when a fusion is decorated (after MindSpeed's adaptor: its call-through), not as it
    was when megatron.core.jit was imported."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch

    return torch.compile(*args, **kwargs)

PATCHES = [
    Patch(
        feature="model_layout",
        id="megatron.jit_fuser_mindspeed_compile",
        target="megatron.core.jit:jit_fuser",
        kind="replace",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint(signature="jit_fuser = torch.jit.script", source_sha="a680da5ea8657981"),
        replacement=f"{__name__}:jit_fuser",
        flag="",
        why="MindSpeed's adaptor makes torch.compile a call-through and expects megatron to be imported after it; "
            "verl's worker module imports megatron-core before the overlay's prelude can run, so megatron's "
            "jit_fuser keeps the real torch.compile and the fusions imported afterwards (bias-dropout-add, "
            "SwiGLU) would go through dynamo on the NPU.",
        remove_when="verl imports MindSpeed's adaptor before megatron-core in its NPU workers (later verl does, at "
                    "verl import), or megatron-core reads torch.compile at call time.",
        upstream_ref="megatron-core 0.12.1 megatron/core/jit.py; MindSpeed v2.2.0 "
                     "mindspeed/features_manager/megatron_basic/requirements_basic.py (te_adaptation)",
        platforms=("npu",),
    ),
]
