"""DeepSeek-V3's layer spec on the CPU platform: Transformer Engine's structure with host modules.

Upstream: verl/models/mcore/model_initializer.py:DeepseekV3Model.get_transformer_layer_spec asks
megatron-core for the Transformer Engine spec, which needs TE (CUDA); on NPU MindSpeed substitutes
its kernels. On the host ours returns the same spec with host modules in TE's places
(verl_patches/rigs/cpu/megatron_layers.py: RMSNorm, fused norm + column-parallel linear, MLA attention
over packed sequences, one matmul per expert), so the model keeps TE's structure and parameter
names and every other module is megatron-core's own. Never applied on NPU or CUDA.
"""

from __future__ import annotations

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def get_transformer_layer_spec(self):
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.rigs.cpu.megatron_layers import te_layer_spec

    return te_layer_spec(self.tfconfig)


PATCHES = [
    Patch(
        feature="cpu_platform",
        id="cpu.verl.deepseek_v3_host_layer_spec",
        target="verl.models.mcore.model_initializer:DeepseekV3Model.get_transformer_layer_spec",
        kind="replace",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint("def get_transformer_layer_spec(self)", "63fbbc674d1586dc"),
        replacement=f"{__name__}:get_transformer_layer_spec",
        flag="the CPU platform (no accelerator)",
        why="verl builds DeepSeek-V3 from megatron-core's Transformer Engine spec, which has no host implementation; "
            "the host spec keeps TE's structure and names so the reshard, verl's converter and checkpoints see the "
            "model they see on a GPU.",
        remove_when="megatron-core ships a spec with host kernels for MLA, fused norms and grouped experts.",
        platforms=("cpu",),
    ),
]
