"""verl_patches.rollout.compile_context: the real torch.compile inside the block, exactly the previous object after
it (also on exception, and when nothing had replaced it). The replacement here is a stand-in for
MindSpeed's dummy_compile (MindSpeed needs torch_npu, which cannot import off Ascend)."""

from __future__ import annotations

import pytest
import torch

from verl_patches.rollout import compile_context as cc


def mindspeed_dummy_compile(*args, **kwargs):  # what MindSpeed registers as torch.compile: a call-through
    if args and callable(args[0]):
        return args[0]
    return lambda fn: fn


@pytest.fixture
def saved(monkeypatch):
    """A fresh save slot; torch.compile restored by monkeypatch whatever a test does."""
    monkeypatch.setattr(cc, "_SAVED", {})
    monkeypatch.setattr(torch, "compile", torch.compile)
    return cc._SAVED


def test_torch_compile_is_recognised_as_torch_own():
    assert cc.is_torch_own(torch.compile)
    assert not cc.is_torch_own(mindspeed_dummy_compile)
    assert not cc.is_torch_own(None)


def test_nothing_replaced_changes_nothing(saved):
    real = torch.compile
    with cc.real_torch_compile() as inside:
        assert inside is real and torch.compile is real
    assert torch.compile is real
    assert saved == {}  # the context itself never saves


def test_replaced_gets_the_real_one_inside_and_the_same_replacement_back(saved, monkeypatch):
    real = torch.compile
    assert cc.save_real_compile()
    monkeypatch.setattr(torch, "compile", mindspeed_dummy_compile)
    with cc.real_torch_compile() as inside:
        assert inside is real and torch.compile is real
    assert torch.compile is mindspeed_dummy_compile


def test_restores_on_exception(saved, monkeypatch):
    cc.save_real_compile()
    monkeypatch.setattr(torch, "compile", mindspeed_dummy_compile)
    with pytest.raises(KeyError, match="boom"):
        with cc.real_torch_compile():
            assert cc.is_torch_own(torch.compile)
            raise KeyError("boom")
    assert torch.compile is mindspeed_dummy_compile


def test_block_that_installs_something_else_still_gets_the_previous_object_back(saved, monkeypatch):
    cc.save_real_compile()
    monkeypatch.setattr(torch, "compile", mindspeed_dummy_compile)
    with cc.real_torch_compile():
        torch.compile = lambda *a, **k: None
    assert torch.compile is mindspeed_dummy_compile


def test_disabled_leaves_the_replacement(saved, monkeypatch):
    cc.save_real_compile()
    monkeypatch.setattr(torch, "compile", mindspeed_dummy_compile)
    with cc.real_torch_compile(enabled=False) as inside:
        assert inside is mindspeed_dummy_compile and torch.compile is mindspeed_dummy_compile
    assert torch.compile is mindspeed_dummy_compile


def test_replaced_without_a_saved_real_one_is_a_clear_error(saved, monkeypatch):
    monkeypatch.setattr(torch, "compile", mindspeed_dummy_compile)
    with pytest.raises(cc.CompileContextError, match="prelude must run before MindSpeed"):
        with cc.real_torch_compile():
            pass  # pragma: no cover
    assert torch.compile is mindspeed_dummy_compile


def test_save_never_keeps_a_replacement_and_keeps_the_first_real_one(saved, monkeypatch):
    real = torch.compile
    monkeypatch.setattr(torch, "compile", mindspeed_dummy_compile)
    assert not cc.save_real_compile() and cc.saved_real_compile() is None
    monkeypatch.setattr(torch, "compile", real)
    assert cc.save_real_compile() and cc.saved_real_compile() is real
    monkeypatch.setattr(torch, "compile", mindspeed_dummy_compile)
    assert cc.save_real_compile() and cc.saved_real_compile() is real


def test_prelude_saves_the_real_compile_before_patching(saved, monkeypatch):
    from verl_patches import prelude

    order = []
    monkeypatch.setattr(prelude, "patches_for", lambda phase: [])
    monkeypatch.setattr(prelude, "apply_all", lambda ps: order.append(("apply", cc.saved_real_compile())) or [])
    monkeypatch.delenv("VERL_PATCHES_OFF", raising=False)
    prelude.apply_prelude("worker")
    assert order == [("apply", torch.compile)]
