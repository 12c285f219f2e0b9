"""verl_patches/train/layer_classes.py: walking a layer spec, on megatron-core's real ModuleSpec (CPU).

The NPU spec itself (MindSpeed-LLM's DeepSeek spec, walked and printed by the spec record before the build) is
checked in tests/npu_rehearsal/test_platform.py. Here: the walk reaches nested specs and plain classes, and each
kind of unusable entry is refused by name, the dummy MindSpeed 2.1.0 registered for Transformer Engine's classes
included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl_patches.train.layer_classes import LayerSpecError, check, report, walk

ModuleSpec = pytest.importorskip("megatron.core.transformer.spec_utils").ModuleSpec


@dataclasses.dataclass
class Subs:
    core_attention: object = None
    linear_proj: object = None
    q_layernorm: object = None


class Attention(torch.nn.Module):
    pass


def _spec(core=torch.nn.Linear, proj=torch.nn.Linear):
    inner = ModuleSpec(module=Attention, submodules=Subs(core_attention=core, linear_proj=proj))
    return ModuleSpec(module=torch.nn.Sequential, submodules={"self_attention": inner, "settings": 3})


def test_the_walk_names_every_class_with_its_release():
    entries = check(_spec(), "a spec")
    assert [e.path for e in entries] == ["layer", "layer.self_attention", "layer.self_attention.core_attention",
                                         "layer.self_attention.linear_proj"]
    lines = report(entries)
    assert lines[0].startswith("layer: torch.nn.modules.container.Sequential [torch v2.5.1")
    assert "tests" in lines[1] and "Attention" in lines[1]


@pytest.mark.parametrize("core,expected", [
    (torch.nn.Module, "resolves to torch.nn.Module itself"),
    (type("LayerNormLinear", (torch.nn.Module,), {"__module__": "transformer_engine.pytorch"}),
     "is Transformer Engine's"),
    (type("HostLinear", (torch.nn.Module,), {"__module__": "verl_patches.rigs.cpu.layers"}),
     "CPU platform's host module"),
])
def test_a_dummy_or_foreign_class_is_refused_naming_its_place(core, expected):
    with pytest.raises(LayerSpecError, match=rf"layer\.self_attention\.core_attention: .*{expected}"):
        check(_spec(core=core), "a spec")


def test_a_spec_whose_module_is_none_is_refused():
    with pytest.raises(LayerSpecError, match=r"layer\.self_attention: resolves to None"):
        check(ModuleSpec(module=torch.nn.Sequential, submodules={"self_attention": ModuleSpec(module=None)}), "a spec")
    assert [e.path for e in walk(_spec(proj=None))][-1] == "layer.self_attention.core_attention"  # empty slot skipped
