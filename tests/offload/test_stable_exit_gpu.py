"""A process that used torch_memory_saver's address-stable regions exits with status 0 after a run that
passed (skips without CUDA or torch_memory_saver). Without the backend's exit hook
(TorchMemorySaverBackend.close_at_exit), torch_memory_saver 0.0.10 prints 'only support interesting
region' at interpreter exit and the process returns 1, so every graph-mode Ray worker and script
ended "failed"."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHILD = """
import sys, torch
from verl_patches.offload.stable import TorchMemorySaverBackend
b = TorchMemorySaverBackend()
with b.region("weights"):
    w = torch.ones(1 << 20, device="cuda")
with b.region("kv"):
    kv = torch.zeros(1 << 22, device="cuda")
b.release("kv")
b.allocate("kv")
kv.add_(w.sum())
if sys.argv[1] == "released":
    b.release("kv")
    b.release("weights")
print("run passed", flush=True)
"""


@pytest.mark.parametrize("at_exit", ["mapped", "released"])
def test_a_process_with_stable_regions_exits_0(at_exit):
    pytest.importorskip("torch_memory_saver")
    path = os.pathsep.join([str(REPO), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])
    r = subprocess.run([sys.executable, "-c", CHILD, at_exit], env=dict(os.environ, PYTHONPATH=path), cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert "run passed" in r.stdout, r.stderr[-3000:]
    assert "only support interesting region" not in r.stdout + r.stderr
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
