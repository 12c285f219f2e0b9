"""The launchers' multi-node pieces without a cluster (issue 36): a worker joins with its own address,
knows a head that is gone from one that is silent, and the head's node-loss bound follows Ray's health
checks. The real thing, two network namespaces: tests/recipe/test_multinode_rehearsal.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.helpers import REPO

BRINGUP = f"""
set -euo pipefail
source {REPO}/scripts/cluster/bringup.sh
bringup_defaults
"""


def _bash(script: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("NODE_IP", "SOCKET_IFNAME") and not k.startswith("RAY_health")}
    full.update(PYTHON=sys.executable, **env)
    return subprocess.run(["bash", "-c", BRINGUP + script], env=full, capture_output=True, text=True, timeout=60)


def test_a_worker_joins_with_its_own_address():
    r = _bash('bringup_ray_worker_cmd; printf "%s\\n" "${RAY_CMD[@]}"', MASTER_ADDR="10.9.0.1", NODE_IP="10.9.0.7")
    assert r.returncode == 0, r.stderr
    assert "--node-ip-address=10.9.0.7" in r.stdout.splitlines() and "--address=10.9.0.1:6379" in r.stdout
    # Unset: the address of the interface that reaches the head (here lo's, for a head on 127.0.0.1).
    r = _bash('SOCKET_IFNAME=lo; bringup_ray_worker_cmd; printf "%s\\n" "${RAY_CMD[@]}"', MASTER_ADDR="127.0.0.1")
    assert "--node-ip-address=127.0.0.1" in r.stdout.splitlines(), r.stdout + r.stderr


def test_a_worker_tells_a_head_that_is_up_from_one_that_refuses():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        check = "bringup_head_state"
        assert _bash(check, MASTER_ADDR="127.0.0.1", RAY_PORT=str(port)).stdout.strip() == "refused"
        s.listen(1)
        assert _bash(check, MASTER_ADDR="127.0.0.1", RAY_PORT=str(port)).stdout.strip() == "up"
    # A silent head (no answer at all) is the partition case of tests/recipe/test_multinode_node_loss.py.

def test_the_node_loss_bound_follows_rays_health_checks():
    r = _bash("bringup_export_env; bringup_node_loss_bound_s")
    assert r.stdout.strip() == str(5 * 13 + 4), r.stderr  # Ray's defaults: 5 x (3 s + 10 s), plus two reads
    r = _bash("bringup_export_env; bringup_node_loss_bound_s", RAY_health_check_period_ms="1000",
              RAY_health_check_timeout_ms="1000", RAY_health_check_failure_threshold="5")
    assert r.stdout.strip() == "14"
