"""The weight sync's one owner (verl_patches/reshard/weight_sync.py): one implementation per reshard_method, chosen
once, and the per-switch sequence move -> redo MLA's derived tensors -> verify. The sequence test replaces the
three steps' own work with recorders (a declared stand-in: the real steps run in the tiny run and the reshard
tests); what it checks is the owner's order and what each step is handed."""

from __future__ import annotations

import pytest
import torch

from verl_patches.config.settings import KEYS, METHODS
from verl_patches.reshard import weight_sync as ws
from verl_patches.reshard.stats import ExecStats


def test_every_method_has_one_implementation_named_after_it():
    assert set(ws.WEIGHT_SYNCS) == set(METHODS) == set(KEYS["reshard_method"].kind)
    for name in METHODS:
        cls = ws.for_method(name)
        assert issubclass(cls, ws.WeightSync) and cls.name == name
    assert ws.for_method("alltoallv") is ws.ReferenceAlltoAllV and ws.for_method("direct") is ws.DirectSliceRouting
    assert [c.runs_in_verl for c in (ws.DirectSliceRouting, ws.ReferenceAlltoAllV, ws.VerlFullGather)] == \
        [False, False, True]
    with pytest.raises(ValueError, match=r"reshard method 'recipe': expected one of \('direct', 'alltoallv'"):
        ws.for_method("recipe")


def test_the_references_refuse_sequential_experts_by_name():
    ws.DirectSliceRouting.check_storage("sequential")
    with pytest.raises(Exception, match="'alltoallv' emulates its reference on GroupedMLP storage"):
        ws.ReferenceAlltoAllV.check_storage("sequential")


def test_one_switch_moves_then_redoes_mla_then_verifies(monkeypatch):
    calls = []
    roll = {"w": torch.zeros(2, dtype=torch.bfloat16)}
    monkeypatch.setattr(ws, "vllm_params", lambda model: roll)
    monkeypatch.setattr(ws, "redo_mla_post_load", lambda model, dtype: calls.append(("redo", dtype)))
    monkeypatch.setattr(ws, "execute_direct", lambda plan, rank, train, r, group: calls.append(("move", set(r)))
                        or ExecStats("direct"))
    monkeypatch.setattr(ws.faults, "inject_after_reshard", lambda step, rank, r: calls.append(("fault?", step)))
    monkeypatch.setattr(ws.WeightSync, "verify", lambda self, train, r, step=None: calls.append(("verify", step))
                        or type("R", (), {"params": 1, "seconds": 0.0, "bytes_read": 4})())
    monkeypatch.setattr(ws, "check_mla_derived", lambda model, i: calls.append(("mla", i)) or 1)
    sync = ws.DirectSliceRouting(plan=None, rank=0)
    train = {"w": torch.ones(2, dtype=torch.bfloat16)}
    stats, checks = sync.sync(train, model=None, step=7, fingerprint_every=2)
    assert stats.method == "direct" and checks["fingerprint_passed"] == 1.0
    assert calls == [("move", {"w"}), ("redo", torch.bfloat16), ("fault?", 7), ("verify", 7), ("mla", 0)]
    calls.clear()
    _, checks = sync.sync(train, model=None, step=8, fingerprint_every=2)  # the second switch: not a check's turn
    assert calls == [("move", {"w"}), ("redo", torch.bfloat16), ("fault?", 8)] and checks["fingerprint_passed"] == 0.0
    assert sync.switches == 2
