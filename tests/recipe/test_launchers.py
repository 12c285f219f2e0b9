"""The train_*.sh launchers in --dry-run, and a real single-node Ray bring-up and teardown on CPU.

Runs the real scripts with bash and the real ray CLI from the test venv; nothing is faked.
"""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
TRUE_WEIGHT = SCRIPTS / "train_deepseekv3_256die_true_weight.sh"
RANDOM_INIT = SCRIPTS / "train_deepseekv3_256die_random_init.sh"
VENV_BIN = Path(sys.executable).parent


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("DIST_CKPT_PATH", "ROLE", "NODE_RANK", "NNODES", "DEVICE")}
    env.update(PYTHON=sys.executable, RAY_BIN=str(VENV_BIN / "ray"), MASTER_ADDR="10.0.0.1", SOCKET_IFNAME="eth9")
    env.update(extra)
    return env


def _run(script, *args, timeout=120, **env):
    return subprocess.run(["bash", str(script), *args], env=_env(**env), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def ckpt_dir(tmp_path):
    d = tmp_path / "dist_ckpt"
    d.mkdir()
    (d / "metadata.json").write_text("{}")
    return d


def test_true_weight_requires_dist_ckpt_path(tmp_path):
    r = _run(TRUE_WEIGHT, "--dry-run")
    assert r.returncode == 2
    assert "DIST_CKPT_PATH is not set" in r.stderr
    r = _run(TRUE_WEIGHT, "--dry-run", DIST_CKPT_PATH=str(tmp_path))
    assert r.returncode == 2 and "is empty" in r.stderr
    r = _run(TRUE_WEIGHT, "--dry-run", DIST_CKPT_PATH=str(tmp_path / "nope"))
    assert r.returncode == 2 and "is not a directory" in r.stderr


def test_true_weight_dry_run_composes_and_validates(ckpt_dir):
    r = _run(TRUE_WEIGHT, "--dry-run", "trainer.total_training_steps=5", DIST_CKPT_PATH=str(ckpt_dir), NODE_RANK="0")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "role head (dry run: nothing is started)" in out
    assert f"DIST_CKPT_PATH={ckpt_dir}" in out
    # Ray commands carry the NPU count; the trainer command carries config, checkpoint and user override.
    assert re.search(r"ray start --head --block --node-ip-address=10\.0\.0\.1 --port=6379 .*NPU", out)
    assert "--address=10.0.0.1:6379" in out
    assert "--config-name=deepseekv3_256die_true_weight" in out
    assert f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={ckpt_dir}" in out
    assert "trainer.total_training_steps=5" in out
    assert "== doctor" in out and "doctor (npu" in out
    # The runtime environment with where each value came from (scripts/cluster/recipe_env.sh).
    assert "== runtime environment" in out and "HCCL_OP_EXPANSION_MODE=AIV  [recipe default; read by CANN" in out
    assert "VLLM_HOST_IP=" in out and "not set by the launcher" in out
    assert '"world": 256' in out and '"instances": 2' in out
    # The composed YAML shows the user override and the checkpoint path resolved.
    assert "total_training_steps: 5" in out and f"dist_checkpointing_path: {ckpt_dir}" in out
    assert "dry run OK" in out


def test_random_init_dry_run_env_overrides_and_layout_error():
    r = _run(RANDOM_INIT, "--dry-run", DEVICE="cuda", NODE_RANK="3", RAY_PORT="7000")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "role worker" in r.stdout
    assert "--num-gpus 16" in r.stdout and "--address=10.0.0.1:7000" in r.stdout
    assert "trainer.device=cuda" in r.stdout and '"dp": 128' in r.stdout
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1  [recipe default" in r.stdout and "HCCL_OP_EXPANSION_MODE" not in r.stdout
    # 8 nodes cannot hold the 256-die layouts: the dry run must say so and fail.
    r = _run(RANDOM_INIT, "--dry-run", NNODES="8")
    assert r.returncode == 1
    assert "world size is 128" in r.stderr and "dry run FAILED" in r.stderr


@pytest.mark.parametrize("args, env, message", [
    (["--bogus"], {}, "unknown option --bogus"),
    (["--dry-run"], {"NNODES": "zero"}, "NNODES must be a positive integer"),
    (["--dry-run"], {"DEVICE": "tpu"}, "DEVICE must be npu or cuda"),
    (["--dry-run"], {"ROLE": "boss"}, "ROLE must be head or worker"),
])
def test_bad_input_is_named(args, env, message):
    r = _run(RANDOM_INIT, *args, **env)
    assert r.returncode == 2 and message in r.stderr


def test_help():
    r = _run(TRUE_WEIGHT, "--help")
    assert r.returncode == 0 and "DIST_CKPT_PATH (required)" in r.stdout and "--dry-run" in r.stdout


def test_no_kill_by_name():
    for f in [*SCRIPTS.glob("train_*.sh"), *(SCRIPTS / "cluster").glob("*")]:
        text = f.read_text()
        assert not re.search(r"\b(pkill|killall)\b|ray stop", text), f


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _group_members(pgid):
    out = subprocess.run(["ps", "-eo", "pid=,pgid="], capture_output=True, text=True).stdout
    return [int(p) for p, g in (line.split() for line in out.splitlines()) if int(g) == pgid]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_single_node_ray_bringup_and_teardown(tmp_path):
    port, *agent = _free_ports(6)
    temp = Path(f"/tmp/rt{os.getpid()}")  # Ray's socket paths must stay short
    script = f"""
set -euo pipefail
source {SCRIPTS}/cluster/bringup.sh
bringup_defaults
bringup_export_env
bringup_start_head
echo "PGID=${{BRINGUP_PIDS[0]}}"
# Two nodes never join: the wait must time out with a message naming what joined.
if NNODES=2 WAIT_TIMEOUT_S=4 bringup_wait_devices; then echo "UNEXPECTED-READY"; fi
bringup_wait_devices
bringup_stop
echo STOPPED
"""
    env = _env(DEVICE="npu", NNODES="1", DEVICES_PER_NODE="2", RAY_NUM_CPUS="1", MASTER_ADDR="127.0.0.1",
               RAY_PORT=str(port), RAY_TEMP_DIR=str(temp), LOG_DIR=str(tmp_path / "logs"), WAIT_TIMEOUT_S="60",
               RAY_EXTRA_ARGS=(f"--ray-client-server-port={agent[0]} --dashboard-agent-listen-port={agent[1]} "
                               f"--dashboard-agent-grpc-port={agent[2]} --metrics-export-port={agent[3]} "
                               f"--runtime-env-agent-port={agent[4]}"))
    t0 = time.monotonic()
    try:
        r = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=80)
    finally:
        subprocess.run(["rm", "-rf", str(temp)])
    log = (tmp_path / "logs" / "ray_head.log")
    diag = r.stdout + r.stderr + (log.read_text() if log.exists() else "")
    assert r.returncode == 0, diag
    assert "UNEXPECTED-READY" not in r.stdout
    assert "only 1 of 2 node(s) and 2 of 4 NPU joined" in r.stderr, diag
    assert "ready: 1 node(s), 2 NPU" in r.stdout, diag
    assert "STOPPED" in r.stdout
    pgid = int(re.search(r"PGID=(\d+)", r.stdout).group(1))
    # Everything the bring-up started (its process group) is gone.
    deadline = time.monotonic() + 5
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _group_members(pgid) == []
    assert time.monotonic() - t0 < 60


def test_dry_run_names_missing_python_packages(tmp_path, ckpt_dir):
    # A Python without site-packages stands for a fresh machine's interpreter.
    bare = tmp_path / "bare_python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    r = _run(TRUE_WEIGHT, "--dry-run", DIST_CKPT_PATH=str(ckpt_dir), NODE_RANK="0", PYTHON=str(bare))
    assert r.returncode == 1
    assert "lacks: hydra-core ray torch verl" in r.stderr and "dry run FAILED" in r.stderr


GPU_RANDOM_INIT = SCRIPTS / "train_deepseekv3_128gpu_random_init.sh"


def test_the_nvidia_launcher_dry_run_composes_and_validates_with_the_cuda_lock():
    r = _run(GPU_RANDOM_INIT, "--dry-run", NODE_RANK="0")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "== deepseekv3_128gpu_random_init: role head" in out and "--num-gpus 8" in out
    assert "trainer.device=cuda" in out and "trainer.n_gpus_per_node=8" in out
    assert "VERL_PATCHES_LOCK=" in out and "upstream.cuda.lock.toml  [recipe default" in out
    assert "doctor (cuda" in out and '"world": 128' in out and '"device_memory_gib": 139' in out
    assert "HCCL_" not in out and "dry run OK" in out
