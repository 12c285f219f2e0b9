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
