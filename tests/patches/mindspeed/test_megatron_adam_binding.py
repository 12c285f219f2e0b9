"""verl_patches/train/mindspeed_adaptor.py:bind_megatron_adam, on megatron-core 0.12.1's real optimizer modules.

verl's worker module imports megatron-core's optimizer before MindSpeed's adaptor registers MindSpeed's AdamW as
apex's FusedAdam, so megatron's ``Adam`` stays torch's AdamW and MindSpeed's optimizer features (the swap
optimizer's step) never run (found by the NPU rehearsal's tiny run: ``KeyError: 'step'`` in torch's AdamW). The
binding gives both modules what an import after the adaptor would have bound. The whole path (MindSpeed's real
registration) runs in the rehearsal's tiny run; here the binding itself, with a stand-in apex module."""

from __future__ import annotations

import sys
import types

import pytest

from verl_patches.train.mindspeed_adaptor import ADAM_USERS, bind_megatron_adam


@pytest.fixture
def megatron_optimizer(monkeypatch):
    pytest.importorskip("megatron.core.optimizer")
    modules = [sys.modules[name] for name in ADAM_USERS]
    for m in modules:
        monkeypatch.setattr(m, "Adam", m.Adam)  # restored after the test
    monkeypatch.delitem(sys.modules, "apex.optimizers", raising=False)
    return modules


def test_without_mindspeeds_registration_nothing_changes(megatron_optimizer):
    before = [m.Adam for m in megatron_optimizer]
    assert bind_megatron_adam() == [] and [m.Adam for m in megatron_optimizer] == before


def test_megatrons_adam_becomes_what_mindspeed_registered(megatron_optimizer, monkeypatch):
    class MindSpeedAdamW:  # what MindSpeed's --optimizer-selection registers as apex.optimizers.FusedAdam
        pass

    monkeypatch.setitem(sys.modules, "apex.optimizers", types.SimpleNamespace(FusedAdam=MindSpeedAdamW))
    assert bind_megatron_adam() == list(ADAM_USERS)
    assert all(m.Adam is MindSpeedAdamW for m in megatron_optimizer)
    assert bind_megatron_adam() == []  # already bound
