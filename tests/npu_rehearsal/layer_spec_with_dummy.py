"""``python -m verl_patches layer-spec`` with MindSpeed-LLM's DeepSeek spec module replaced by one whose experts slot
is a bare ``torch.nn.Module``: a declared test stand-in for a release that registers dummies (MindSpeed 2.1.0 did
so for Transformer Engine's classes: issue 35's reproduction). The stand-in module answers ``layer_spec`` only,
built from megatron-core's real classes when the record asks for it (after the prelude, as the real one is).
Run by tests/npu_rehearsal/test_platform.py on the NPU rehearsal platform; arguments go to the command.
"""

from __future__ import annotations

import sys
import types

SPEC_MODULE = "mindspeed_llm.tasks.models.spec.deepseek_spec"


class _SpecWithDummy(types.ModuleType):
    def __getattr__(self, name: str):
        if name != "layer_spec":
            raise AttributeError(f"{SPEC_MODULE} (test stand-in) has no {name}")
        import torch
        from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            mlp=ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=torch.nn.Module))))


if __name__ == "__main__":
    sys.modules[SPEC_MODULE] = _SpecWithDummy(SPEC_MODULE)
    from verl_patches.checks import layer_spec

    sys.exit(layer_spec.main(sys.argv[1:]))
