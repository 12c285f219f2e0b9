"""Node loss in a multi-node rehearsal (issue 36; the rehearsal itself: test_multinode_rehearsal.py, whose
helpers this file uses), and the resume after it. The run saves every 2 steps into CKPT_SAVE_DIR (OUT/checkpoints,
one path every node sees); in step 3, after the save of step 2, the worker node's Ray is killed (SIGKILL to its
process group), or its link is detached from the switch (a partition: the node runs on, silent). The head's
launcher stops within the bound of Ray's health checks (set short here: RAY_health_check_*), names the lost node
and the step, exits 4; the other launcher ends with its Ray; nothing is left in either namespace. Then the same
command again (without the fault): it resumes from the whole checkpoint of step 2 (verl's resume_mode=auto,
patch verl.ray_trainer.checkpoint_resume_whole), finishes, leaves nothing behind, and its step 3 equals an
uninterrupted run's bit for bit (the single-node run of the same command, run beside the first resumed run: one
node's steps equal two nodes' bit for bit, test_multinode_rehearsal.py).

Root only (network namespaces); everything is removed afterwards, by the script and again by the
fixture's finalizer (only namespaces of this test's own tag).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.recipe.test_multinode_rehearsal import STOP_GRACE_S, _diag, _metrics, _rehearse, netns_tag
from tests.recipe.test_train_tiny import _compared

pytestmark = pytest.mark.slow
__all__ = ["netns_tag"]  # the fixture, used by the test below

# Ray's health checks in the node-loss cases: one check a second, each given 1 s, 5 missed = dead. The
# head's launcher must stop within 5 x (1 + 1) s of the loss, plus the node watch's read (2 s) and the
# teardown of the head (STOP_GRACE_S, 5 here), with 10 s to spare on a loaded machine.
HEALTH = ("RAY_health_check_period_ms=1000,RAY_health_check_timeout_ms=1000,RAY_health_check_failure_threshold=5,"
          "RAY_gcs_rpc_server_reconnect_timeout_s=10")
LOSS_BOUND_S = 5 * 2 + 2 + STOP_GRACE_S + 10
# The other launcher: the killed node's ends with its Ray at once; the partitioned node's once the head
# has not answered for HEAD_SILENT_S (RAY_gcs_rpc_server_reconnect_timeout_s, 10 here; one check takes
# 3 s at most, one every 2 s), then its Ray's teardown (STOP_GRACE_S, 5 here; a worker's Ray whose head is
# gone ignores SIGTERM and is killed after it), with 10 s to spare on a loaded machine.
WORKER_END_BOUND_S = 10 + 3 + 2 + STOP_GRACE_S + 10
# 3 steps, a checkpoint after step 2 (verl also saves after the last step), the node lost in step 3. Few steps:
# CI's time is short; one step after the resume is compared.
STEPS, SAVE_FREQ, FAULT_STEP = 3, 2, 3
RUN = (f"trainer.total_training_steps={STEPS}", f"trainer.save_freq={SAVE_FREQ}", "trainer.val_before_train=False",
       "trainer.test_freq=-1")


class Uninterrupted:
    """The same command on one node, uninterrupted: started beside the first resumed run (both wait on Ray and their
    ranks much of the time), never beside a node loss, whose bound a loaded machine would stretch."""

    def __init__(self, out: Path, assets: Path):
        self.out, self.assets, self.proc = out, assets, None

    def start(self) -> None:
        if self.proc is None:
            env = dict(os.environ, SETUP_TEST_ENV="0", VENV=str(Path(sys.executable).parent.parent),
                       TINY_OUT=str(self.out), TINY_ASSETS=str(self.assets))
            with open(self.out / "console.log", "w") as log:
                self.proc = subprocess.Popen(["bash", str(REPO / "scripts" / "train_tiny.sh"), *RUN], env=env,
                                             cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, text=True)

    def metrics(self) -> dict[int, dict]:
        self.start()
        rc = self.proc.wait(timeout=900)
        assert rc == 0, (self.out / "console.log").read_text(errors="replace")[-4000:]
        return _metrics(self.out / "metrics.jsonl")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_assets):
    run = Uninterrupted(tmp_path_factory.mktemp("uninterrupted"), tiny_assets)
    try:
        yield run
    finally:
        if run.proc is not None and run.proc.poll() is None:
            run.proc.terminate()  # the launcher stops what it started (its trap)
            run.proc.wait(timeout=60)


@pytest.mark.parametrize("fault", ["kill-ray", "partition"])
def test_a_node_lost_mid_step_stops_the_run_naming_node_and_step_and_the_same_command_resumes(
        tmp_path, netns_tag, uninterrupted, fault):
    out = tmp_path / fault
    r, rec, took = _rehearse(out, netns_tag, "--fault", fault, "--fault-step", str(FAULT_STEP), "--health", HEALTH,
                             *RUN)
    diag = _diag(r, out)
    assert rec.get("fault_action"), diag
    head_rc, worker_rc = rec["exit"]
    assert head_rc == 4, diag
    # Within the bound after the fault, with the node and the step on the head's console.
    assert rec["exit_s"][0] - rec["fault_s"] < LOSS_BOUND_S, (rec, diag)
    head = (out / "node0" / "console.log").read_text()
    # The step then running: 3 (2 s into it, of about 20), after the save of step 2.
    step = rec["fault_during_step"]
    assert step == FAULT_STEP and rec["tracker_at_fault"] == SAVE_FREQ, (rec, diag)
    assert re.search(rf"error: node 10\.213\.0\.2 \(Ray node [0-9a-f]{{12}}\) lost during step {step}/{STEPS} "
                     rf"\(last completed step: {step - 1}\)", head), diag
    assert "stopping the run" in head
    # The other launcher ended what it started, with a non-zero status: its Ray's (SIGKILL) where it was
    # killed; 4 where the node was cut off, saying so. Nothing is left in either namespace.
    assert rec["exit_s"][1] - rec["fault_s"] < WORKER_END_BOUND_S, (rec, diag)
    if fault == "kill-ray":
        assert worker_rc == 137, (rec, diag)
    else:
        assert worker_rc == 4, (rec, diag)
        assert "has not answered for" in (out / "node1" / "console.log").read_text(), diag
    assert rec["leftovers"] == {}, rec["leftovers"]
    stopped = rec["exit_s"][0] - rec["fault_s"]

    # The same command again, the fault aside: it resumes from step 2's whole checkpoint and finishes.
    uninterrupted.start()
    r, rec, took_again = _rehearse(out, netns_tag, "--health", HEALTH, *RUN)
    diag = _diag(r, out)
    assert r.returncode == 0 and rec.get("exit") == [0, 0], diag
    assert rec["leftovers"] == {}, rec["leftovers"]
    trainer = (out / "node0" / "logs" / "trainer.log").read_text(errors="replace")
    assert f"checkpoint: resuming from step {SAVE_FREQ}, {out / 'checkpoints'}/global_step_{SAVE_FREQ} (whole)" \
        in trainer, diag
    resumed = _metrics(out / "node0" / "metrics.jsonl")
    assert sorted(resumed) == list(range(SAVE_FREQ + 1, STEPS + 1)), sorted(resumed)
    one = uninterrupted.metrics()
    for s in resumed:
        assert _compared(resumed[s]) == _compared(one[s]), (
            s, {k: (one[s].get(k), resumed[s].get(k)) for k in _compared(one[s]) if one[s].get(k) != resumed[s].get(k)})
    print(f"{fault}: head stopped {stopped:.1f} s after the fault; rehearsal {took:.0f} s, resumed run {took_again:.0f} s")
