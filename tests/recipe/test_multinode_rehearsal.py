"""Several nodes on one machine (issue 36): scripts/rehearse_multinode.sh makes 2 network namespaces
joined by a bridge (in a third namespace), with addresses inside them only, and runs the tiny run's
launcher (scripts/train_tiny.sh) in each as a user runs it on each node of a cluster (MASTER_ADDR,
NODE_RANK, NNODES, DEVICES_PER_NODE): 2 nodes x 2 CPU workers.

- The rehearsal: the head waits for both nodes and starts the trainer, verl's workers run on both Ray
  nodes, the steps equal the single-node tiny run's bit for bit, every launcher exits 0 and no process
  is left in either namespace.
- Node loss: tests/recipe/test_multinode_node_loss.py (a file of its own, so that CI's two workers can run
  it beside this one).

Root only (network namespaces); everything is removed afterwards, by the script and again by the
fixture's finalizer (only namespaces of this test's own tag).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.recipe.test_train_tiny import _compared

pytestmark = pytest.mark.slow

STEPS = 2
# No validation: the steps are what is compared, and CI's time is short.
RUN = (f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=False", "trainer.test_freq=-1")
STOP_GRACE_S = 5  # the launchers' teardown grace (their STOP_GRACE_S)
# A worker whose head stopped: two refused checks 2 s apart (3 s each at most), then its Ray's teardown.
WORKER_AFTER_HEAD_S = 2 * (2 + 3) + STOP_GRACE_S + 10


def _need_root():
    if os.geteuid() != 0:
        pytest.fail("the multi-node rehearsal makes network namespaces: run the tests as root (CI does)")


@pytest.fixture
def netns_tag():
    """A tag for this test's namespaces; the finalizer removes any left with it (and what runs in them)."""
    _need_root()
    tag = f"t{os.getpid() % 100000}{int(time.monotonic() * 10) % 1000}"
    yield tag
    from verl_patches.launch.netns_cluster import Network

    names = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
             if re.fullmatch(rf"{tag}(sw|n\d+)", n)]
    if names:
        net = Network(tag, 0)
        net.made = names
        failed = net.destroy()
        assert not failed, f"namespaces not removed: {failed}"


def _rehearse(out: Path, tag: str, *args: str, timeout: int = 900) -> tuple[subprocess.CompletedProcess, dict, float]:
    env = dict(os.environ, SETUP_TEST_ENV="0", VENV=str(Path(sys.executable).parent.parent),
               STOP_GRACE_S=str(STOP_GRACE_S))
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(REPO / "scripts" / "rehearse_multinode.sh"), str(out), "--tag", tag, *args],
                       env=env, cwd=str(REPO), capture_output=True, text=True, timeout=timeout)
    took = time.monotonic() - t0
    rec = json.loads((out / "rehearsal.json").read_text()) if (out / "rehearsal.json").exists() else {}
    # The script removed its namespaces itself, before the finalizer.
    left = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if n.startswith(tag)]
    assert left == [], left
    return r, rec, took


def _diag(r, out: Path) -> str:
    parts = [r.stdout[-3000:], r.stderr[-3000:]]
    for f in sorted(out.glob("node*/console.log")) + sorted(out.glob("node*/logs/launch.log")):
        parts.append(f"== {f}\n" + f.read_text(errors="replace")[-3000:])
    return "\n".join(parts)


def _metrics(path: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def test_two_nodes_train_like_one_and_leave_nothing(tmp_path, netns_tag, tiny_assets):
    # The same steps on one node (scripts/train_tiny.sh as the README runs it), run beside the rehearsal: both
    # wait on Ray and on their ranks much of the time (CI's 2 cores were 43% busy), so together they take less
    # than one after the other. Their steps do not depend on timing (compared bit for bit below).
    single = tmp_path / "single"
    env = dict(os.environ, SETUP_TEST_ENV="0", VENV=str(Path(sys.executable).parent.parent), TINY_OUT=str(single),
               TINY_ASSETS=str(tiny_assets))
    with open(tmp_path / "single.log", "w") as log:
        s = subprocess.Popen(["bash", str(REPO / "scripts" / "train_tiny.sh"), *RUN], env=env, cwd=str(REPO),
                             stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        out = tmp_path / "rehearsal"
        r, rec, took = _rehearse(out, netns_tag, *RUN)
        s.wait(timeout=600)
    finally:
        if s.poll() is None:
            s.terminate()  # the launcher stops what it started (its trap)
            s.wait(timeout=60)
    assert r.returncode == 0 and rec.get("exit") == [0, 0], _diag(r, out)
    head = (out / "node0" / "console.log").read_text()
    worker = (out / "node1" / "console.log").read_text()
    # The head waited for both nodes, then started the trainer; the worker checked before it joined.
    launch = (out / "node0" / "logs" / "launch.log").read_text()
    assert "ready: 2 node(s), 4 GPU (expected 4)" in launch, launch[-3000:]
    assert "Ray head up with 2 x 2 GPU; starting the trainer" in head
    assert "checks passed: python environment, shared inputs, doctor, prelude hook" in worker
    assert "--node-ip-address=10.213.0.2" in (out / "node1" / "logs" / "launch.log").read_text()
    # verl's workers (the worker group's actors) on both Ray nodes, the nodes being the two namespaces.
    nodes = rec["ray"]["nodes"]
    assert sorted(nodes.values()) == ["10.213.0.1", "10.213.0.2"], rec["ray"]
    workers = [node for cls, node in rec["ray"]["actors"] if "WorkerDict" in cls]
    assert len(workers) == 4 and set(workers) == set(nodes), rec["ray"]
    # The worker's launcher ended soon after the head's (it saw the head's port refuse), and nothing is
    # left running in either namespace once the launchers exited.
    assert "is gone (its port refuses connections): stopping this node's Ray" in worker, worker[-2000:]
    assert rec["exit_s"][1] - rec["exit_s"][0] < WORKER_AFTER_HEAD_S, rec
    assert rec["leftovers"] == {}, rec["leftovers"]

    # The single-node run's steps: bit for bit.
    assert s.returncode == 0, (tmp_path / "single.log").read_text(errors="replace")[-4000:]
    multi, one = _metrics(out / "node0" / "metrics.jsonl"), _metrics(single / "metrics.jsonl")
    assert sorted(multi) == sorted(one) == list(range(1, STEPS + 1)), (sorted(multi), sorted(one))
    for step in one:
        assert _compared(multi[step]) == _compared(one[step]), (
            step, {k: (one[step].get(k), multi[step].get(k)) for k in _compared(one[step])
                   if one[step].get(k) != multi[step].get(k)})
    print(f"rehearsal {took:.0f} s")
