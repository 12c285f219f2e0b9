"""scripts/bench_offload.py runs end to end on a tiny setting (so it cannot rot between GPU runs): every
method's round trip keeps the data (the script asserts it), the schedules and the graph-mode cost
section report, and on CPU the address-stable parts say why they are skipped."""

from __future__ import annotations

import importlib.util
import json

from tests.helpers import REPO


def test_bench_offload_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")
    spec = importlib.util.spec_from_file_location("bench_offload", REPO / "scripts" / "bench_offload.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "bench.json"
    mod.main(["--layers", "1", "--shrink", "64", "--reps", "1", "--schedule-unit-mb", "1", "--stable-mib", "4",
              "--json", str(out)])
    r = json.loads(out.read_text())
    assert set(r["methods"]) >= {"ours", "pageable", "naive", "pinned"}
    assert set(r["schedules"]) == {"ours", "baseline"}
    st = r["stable_release_allocate"]
    assert st["backend"] is None and "no address-stable allocator on 'cpu'" in st["backend_reason"]
    assert st["resize_cached"]["pair_ms"] >= 0 and "stable" not in st
    assert "resize" in r["switch_regions"] and "stable" not in r["switch_regions"]


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_offload", REPO / "scripts" / "bench_offload.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_schedules_peaks_do_not_depend_on_the_order_the_methods_run_in(monkeypatch):
    # A method that left its tensors alive (its hooks bound them) into the next method's start, where
    # they were freed, made the next method's peak read low by their size (8.58 GiB first, 7.93 after
    # ours on an H100). On CPU the bench counts the live storages it made (no device allocator), so
    # the same leak shows here: each measured peak must equal the ledger's in both orders.
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")
    mod = _load_bench()
    unit = 1 << 20
    runs = {order: mod.bench_schedules(unit, order=order) for order in (("ours", "baseline"), ("baseline", "ours"))}
    for order, r in runs.items():
        for name in ("baseline", "ours"):
            got = r[name]
            assert got["measured_peak_source"] == "live storages at step ends (CPU)"
            assert got["floor_bytes"] == 0, (order, name, got["floor_bytes"])
            # within the allocator's rounding: none on CPU, where the count is the storages' own bytes
            assert got["measured_peak_bytes"] == got["ledger_peak_bytes"], (order, name, got)
            assert got["measured_peak_step"] == got["ledger_peak_step"], (order, name, got)
    first, second = runs[("baseline", "ours")], runs[("ours", "baseline")]
    for name in ("baseline", "ours"):
        assert first[name]["measured_peak_bytes"] == second[name]["measured_peak_bytes"]
    # The baseline holds the training params and grads next to the rollout weights and KV cache.
    sizes = first["baseline"]["sizes"]
    assert first["baseline"]["ledger_peak_bytes"] > first["ours"]["ledger_peak_bytes"]
    assert first["baseline"]["ledger_peak_bytes"] >= sizes["kv_cache"] + sizes["rollout_weights"] + sizes["train_params"]


def test_a_tensor_left_alive_by_a_method_stops_the_next_one(monkeypatch):
    import pytest
    import torch

    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")
    mod = _load_bench()
    probe = mod.DeviceBytes()
    kept = torch.ones(1024, dtype=torch.bfloat16)
    probe.track([kept])
    assert probe.now() == 2048
    with pytest.raises(RuntimeError, match="still referenced before baseline"):
        mod._require_released(probe, before="baseline")
    del kept
    mod._require_released(probe, before="baseline")
    assert probe.now() == 0
