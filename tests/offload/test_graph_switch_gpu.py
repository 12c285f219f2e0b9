"""Graph-safe switch on a GPU: real CUDA graphs (one per captured decode batch size, 1, 2, 4 and 8, as
vLLM captures one per capture size) over a tiny DeepSeek-V3-shaped decode forward (MLA with
W_UK_T / W_UV, dense and MoE MLPs, a KV cache write and read), all replayed after each of 100 switches
through the real offload engine, switch schedule and weight sync (one rank), with new weights
every cycle and training-phase allocations of varied sizes in between
(verl_patches/rigs/testing/graph_switch.py). Skips without CUDA or torch_memory_saver.

With the address-stable regions every replay equals the eager forward bit for bit, every address
a graph reads stays the captured one, and releasing the regions frees their memory. The same
program on today's storage-resize path fails: weights and the cache come back elsewhere and the
replays read stale memory. The resize run here must fail, or this test could not tell the two
apart; docs/benchmarks.md records both runs on an H100.

Each run is a child process: torch_memory_saver reports a late free and exits non-zero at
interpreter shutdown, so the child writes its result first and leaves with os._exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(tmp_path, mode: str, cycles: int, graph_sizes: str = "4") -> dict:
    out = tmp_path / f"{mode}.json"
    path = os.pathsep.join([str(REPO), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])
    env = dict(os.environ, PYTHONPATH=path, NCCL_NVLS_ENABLE="0", VERL_PATCHES_DEVICE="cuda")
    proc = subprocess.run([sys.executable, "-m", "verl_patches.rigs.testing.graph_switch", "--mode", mode,
                           "--cycles", str(cycles), "--graph-sizes", graph_sizes, "--json", str(out)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    if not out.exists():
        pytest.fail(f"graph_switch --mode {mode} wrote no result (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    r = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in r.items() if k not in ("failed_cycles", "device")}))  # for the record (-s)
    return r


GRAPH_SIZES = (1, 2, 4, 8)  # several captured decode batch sizes over the same regions (docs/ROLLOUT.md)


def test_graph_replays_equal_eager_across_100_switches_with_stable_regions(tmp_path):
    pytest.importorskip("torch_memory_saver")
    r = _run(tmp_path, "stable", 100, ",".join(map(str, GRAPH_SIZES)))
    assert r["error"] is None, r
    assert r["backend"] == "torch_memory_saver"
    # One graph per graph size, each replayed and compared with its eager forward after every switch.
    assert r["graph_sizes"] == list(GRAPH_SIZES) and r["graphs"] == len(GRAPH_SIZES), r
    assert r["replays"] == 100 * len(GRAPH_SIZES), r
    assert r["cycles"] == 100 and r["ok_cycles"] == 100, r["failed_cycles"]
    assert r["moved_cycles"] == 0 and r["unequal_cycles"] == 0
    # Released for real: the KV cache and weights regions' memory came back to the device each time.
    assert r["freed_bytes_min"] >= 0.9 * r["region_bytes"], r
    # The run's self-checks on the device, every cycle: the weight fingerprint after each reshard (it
    # raises on a difference, which would be the run's error), and the address audit after every
    # allocate (at least every watched tensor of the weights, once more before the KV cache returns).
    assert r["fingerprint_checks"] == 100, r
    assert r["addresses_checked_min"] >= r["watched"], r


def test_the_resize_path_fails_the_same_check(tmp_path):
    r = _run(tmp_path, "resize", 6, ",".join(map(str, GRAPH_SIZES)))
    failed = r.get("crashed") or r["error"] or r["failed_count"] > 0
    assert failed, f"the resize path passed the graph check, so the check proves nothing: {r}"
    if not r.get("crashed"):
        # The cause: storages came back at other addresses (counted before the replay that failed).
        assert r["moved_cycles"] > 0 or r["moved_before_last_replay"], r
        # Nothing is captured on this path, so nothing is audited: the metric says 0, not "fine".
        assert r["addresses_checked_max"] in (0, None), r
