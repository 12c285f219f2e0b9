"""Issue 29, item 3: the launchers' dry run rejects what the real run rejects, with the same message, because
both call the same checker (verl_patches/launch/cluster_checks.py): the environment every node reads (bringup_check_env)
and the head's inputs (launch_check_head, inside launch_validate). Real scripts, real bash, real checkpoints in the
torch_dist format; nothing is faked. The real runs here stop at the checks (RAY_BIN is /bin/false in case they
did not)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import declared_ckpt, head_inputs, model_shapes
from verl_patches.launch import cluster_checks

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
RANDOM_INIT = SCRIPTS / "train_deepseekv3_256die_random_init.sh"
TRUE_WEIGHT = SCRIPTS / "train_deepseekv3_256die_true_weight.sh"
DSV3 = json.loads((REPO / "configs" / "model" / "deepseek_v3.json").read_text())


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DIST_CKPT_PATH", "ROLE", "NODE_RANK", "NNODES", "DEVICE", "MODEL_PATH", "TRAIN_FILES",
                        "VAL_FILES") and not k.endswith("_SOCKET_IFNAME") and not k.startswith("VERL_PATCHES_")}
    env.update(PYTHON=sys.executable, RAY_BIN="/bin/false", MASTER_ADDR="10.0.0.1", SOCKET_IFNAME="eth9")
    # A multi-node run needs the checkpoint directory named (shared storage); nothing here writes there.
    env.setdefault("CKPT_SAVE_DIR", str(Path(tempfile.gettempdir()) / "verl_patches_cluster_check_ckpt"))
    env.update(extra)
    return env


def _run(script, *args, **env):
    return subprocess.run(["bash", str(script), *args], env=_env(**env), capture_output=True, text=True, timeout=180)


def _errors(r) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]


@pytest.fixture
def inputs(tmp_path):
    return head_inputs(tmp_path / "inputs")


@pytest.fixture
def model(inputs):
    return Path(inputs["MODEL_PATH"])


@pytest.fixture
def data(inputs):
    return Path(inputs["TRAIN_FILES"])


# --- the environment every node reads: the launcher refuses it before anything, dry run or not ------------------

ENV_CASES = [
    ({"RAY_PORT": "70000"}, "error: RAY_PORT must be a TCP port, a whole number from 1 to 65535, got '70000'"),
    ({"RAY_PORT": "0"}, "error: RAY_PORT must be a TCP port, a whole number from 1 to 65535, got '0'"),
    ({"NODE_RANK": "two"}, "error: NODE_RANK must be a whole number from 0 (the head) to NNODES-1, got 'two'"),
    ({"NODE_RANK": "16"}, "error: NODE_RANK must be a whole number from 0 (the head) to NNODES-1 = 15, got '16'"),
    ({"WAIT_TIMEOUT_S": "0"}, "error: WAIT_TIMEOUT_S must be a positive integer, got '0'"),
    ({"LAUNCH_CONSOLE": "quiet"}, "error: LAUNCH_CONSOLE must be full or steps, got 'quiet'"),
    ({"VERL_PATCHES_DEVICE": "tpu"}, "error: VERL_PATCHES_DEVICE='tpu': expected one of npu, cuda, cpu"),
    ({"VERL_PATCHES_REWARD_TIMEOUT_S": "0"},
     "error: VERL_PATCHES_REWARD_TIMEOUT_S='0': expected a finite number >= 0.01 and <= 3600; refused: a timeout of "
     "0 or less would score every answer that needs math-verify 0.0"),
    ({"VERL_PATCHES_HEARTBEAT_TIMEOUT_S": "0"}, "refused: a heartbeat timeout of 0 or less would switch"),
    ({"VERL_PATCHES_REWARD_TIMEUOT_S": "5"}, "error: VERL_PATCHES_REWARD_TIMEUOT_S is not a variable the overlay "
     "reads (a misspelt name?)"),
]


@pytest.mark.parametrize("env, message", ENV_CASES)
def test_the_checker_names_each_bad_value(env, message):
    found = cluster_checks.env_problems({**env})
    assert len(found) == 1 and message.removeprefix("error: ") in found[0], found


@pytest.mark.parametrize("env, message", ENV_CASES[:1] + ENV_CASES[2:3] + ENV_CASES[7:8] + ENV_CASES[9:])
def test_dry_run_and_real_run_refuse_a_bad_value_with_the_same_message(env, message):
    dry = _run(RANDOM_INIT, "--dry-run", **env)
    real = _run(RANDOM_INIT, **env)
    for r in (dry, real):
        assert r.returncode == 2, r.stdout + r.stderr
        assert _errors(r) and message in _errors(r)[0], r.stderr
        assert "starting Ray" not in r.stdout and "Traceback" not in r.stderr
    assert _errors(dry) == _errors(real)


def test_good_values_pass():
    assert cluster_checks.env_problems({"RAY_PORT": "65535", "NODE_RANK": "15", "NNODES": "16", "ROLE": "",
                                       "VERL_PATCHES_REWARD_TIMEOUT_S": "5", "DEVICE": ""}) == []


# --- what the head reads: launch_check_head, the function both launch_validate paths call -----------------------

def _check_head(ckpt=None, what="head", **env):
    """The launcher's own launch_check_head, as launch_validate runs it on the head (dry or real), or on a
    worker (``what="worker"``: the inputs it shares with the head)."""
    script = f"""
set -euo pipefail
source {SCRIPTS}/cluster/bringup.sh
source {SCRIPTS}/cluster/launch.sh
bringup_defaults
CONFIG_NAME=deepseekv3_256die_true_weight
launch_defaults
LAUNCH_CKPT_DIR={ckpt or ''}
launch_check_head {what}
"""
    return subprocess.run(["bash", "-c", script], env=_env(PYTHONPATH=str(REPO), **env), capture_output=True,
                          text=True, timeout=300)


def test_head_inputs_pass(model, data, tmp_path):
    ckpt = declared_ckpt(tmp_path / "ckpt", model_shapes(DSV3))
    r = _check_head(ckpt, MODEL_PATH=str(model), TRAIN_FILES=str(data), VAL_FILES=str(data))
    assert r.returncode == 0, r.stderr
    assert f"{ckpt}: complete torch_dist checkpoint" in r.stdout and f"of the model of {model}/config.json" in r.stdout


def test_missing_model_and_data_are_named(tmp_path, data):
    r = _check_head(MODEL_PATH=str(tmp_path / "nomodel"), TRAIN_FILES=str(tmp_path / "no.parquet"),
                    VAL_FILES=str(data))
    assert r.returncode == 2
    assert _errors(r) == [
        f"error: MODEL_PATH={tmp_path / 'nomodel'} has no config.json (HF model directory with config and tokenizer)",
        f"error: data file not found: TRAIN_FILES={tmp_path / 'no.parquet'} (python -m verl_patches.data.prepare "
        "deepscaler --input ... --out-dir ...)"]


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 4096}, "its embedding.word_embeddings.weight is (129280, 4096), the config gives "
                            "(vocab_size, hidden_size) = (129280, 7168)"),
    ({"num_hidden_layers": 27}, "it holds 27 decoder layer(s) (indices up to 26), the config gives "
                                "num_hidden_layers = 61"),
])
def test_a_checkpoint_of_another_model_size_is_named(model, data, tmp_path, change, message):
    """A true-weight DIST_CKPT_PATH converted from another model (e.g. a smaller DeepSeek) than MODEL_PATH's."""
    ckpt = declared_ckpt(tmp_path / "ckpt", model_shapes({**DSV3, **change}))
    r = _check_head(ckpt, MODEL_PATH=str(model), TRAIN_FILES=str(data), VAL_FILES=str(data))
    assert r.returncode == 2
    assert _errors(r) == [f"error: DIST_CKPT_PATH={ckpt} does not hold the model of MODEL_PATH={model}/config.json: "
                          + message], r.stderr


def test_a_worker_checks_the_shared_inputs_as_the_head_does(model, data, tmp_path):
    """A worker's dry run passed a checkpoint of another model size that the head's refused: workers skipped
    the head's checks. Now a worker runs the checks of what every node reads, with the head's messages (not
    the head's Ray port: that is the head's own)."""
    ckpt = declared_ckpt(tmp_path / "ckpt", model_shapes({**DSV3, "num_hidden_layers": 27}))
    env = dict(MODEL_PATH=str(model), TRAIN_FILES=str(data), VAL_FILES=str(tmp_path / "val.parquet"))
    head, worker = _check_head(ckpt, **env), _check_head(ckpt, what="worker", **env)
    assert head.returncode == worker.returncode == 2
    assert _errors(worker) == _errors(head) == [
        f"error: data file not found: VAL_FILES={tmp_path / 'val.parquet'} (python -m verl_patches.data.prepare "
        "deepscaler --input ... --out-dir ...)",
        f"error: DIST_CKPT_PATH={ckpt} does not hold the model of MODEL_PATH={model}/config.json: it holds 27 "
        "decoder layer(s) (indices up to 26), the config gives num_hidden_layers = 61"], worker.stderr
    good = declared_ckpt(tmp_path / "good", model_shapes(DSV3))
    ok = _check_head(good, what="worker", MODEL_PATH=str(model), TRAIN_FILES=str(data), VAL_FILES=str(data))
    assert ok.returncode == 0 and f"{good}: complete torch_dist checkpoint" in ok.stdout, ok.stderr


@pytest.mark.slow
def test_a_worker_dry_run_refuses_a_wrong_size_checkpoint_as_the_head_does(model, data, tmp_path):
    """The whole launcher's dry run on a worker node (NODE_RANK 3) and on the head: the same errors."""
    ckpt = declared_ckpt(tmp_path / "ckpt", model_shapes({**DSV3, "num_hidden_layers": 27}))
    env = dict(DIST_CKPT_PATH=str(ckpt), DEVICE="cpu", MODEL_PATH=str(model), TRAIN_FILES=str(data),
               VAL_FILES=str(data), LOG_DIR=str(tmp_path / "logs"))
    head, worker = _run(TRUE_WEIGHT, "--dry-run", NODE_RANK="0", **env), _run(TRUE_WEIGHT, "--dry-run", NODE_RANK="3", **env)
    assert worker.returncode == 1 and "dry run FAILED" in worker.stderr, worker.stdout + worker.stderr
    want = (f"error: DIST_CKPT_PATH={ckpt} does not hold the model of MODEL_PATH={model}/config.json: it holds 27 "
            "decoder layer(s) (indices up to 26), the config gives num_hidden_layers = 61")
    assert want in _errors(worker) and want in _errors(head), worker.stderr


def test_a_busy_ray_port_on_the_head_is_named(model, data):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = _check_head(MODEL_PATH=str(model), TRAIN_FILES=str(data), VAL_FILES=str(data), MASTER_ADDR="127.0.0.1",
                        RAY_PORT=str(port))
    assert r.returncode == 2
    assert _errors(r) == [f"error: RAY_PORT={port} is already in use on MASTER_ADDR=127.0.0.1 (a Ray head still "
                          "running, or another program): the Ray head could not listen there; stop what holds it or "
                          "choose another RAY_PORT"]
    # Free again: no finding (and a MASTER_ADDR that is not this machine's is Ray's to report).
    assert cluster_checks.port_problem("127.0.0.1", port) is None
    assert cluster_checks.port_problem("10.255.255.1", port) is None


@pytest.mark.slow
def test_true_weight_dry_run_and_real_run_refuse_a_wrong_size_checkpoint_alike(model, data, tmp_path):
    """The whole launcher, both paths, as the head: a checkpoint of 27 layers for a 61-layer config.json,
    and a missing validation file. The dry run and the real bring-up print the same errors (the real run
    stops before starting anything)."""
    ckpt = declared_ckpt(tmp_path / "ckpt", model_shapes({**DSV3, "num_hidden_layers": 27}))
    env = dict(DIST_CKPT_PATH=str(ckpt), NODE_RANK="0", DEVICE="cpu", MODEL_PATH=str(model), TRAIN_FILES=str(data),
               VAL_FILES=str(tmp_path / "val.parquet"), LOG_DIR=str(tmp_path / "logs"))
    dry = _run(TRUE_WEIGHT, "--dry-run", **env)
    real = _run(TRUE_WEIGHT, **env)
    assert dry.returncode == 1 and "dry run FAILED" in dry.stderr, dry.stdout + dry.stderr
    assert real.returncode == 1 and "starting Ray" not in real.stdout, real.stdout + real.stderr
    want = [f"error: data file not found: VAL_FILES={tmp_path / 'val.parquet'} (python -m verl_patches.data.prepare "
            "deepscaler --input ... --out-dir ...)",
            f"error: DIST_CKPT_PATH={ckpt} does not hold the model of MODEL_PATH={model}/config.json: it holds 27 "
            "decoder layer(s) (indices up to 26), the config gives num_hidden_layers = 61"]
    assert _errors(dry)[:2] == want, dry.stderr
    assert _errors(dry) == _errors(real)


# --- settings that weaken a check: refused, or said on every run ------------------------------------------------

def test_fault_injection_is_refused_by_the_cluster_launchers_dry_or_not():
    env = {"VERL_PATCHES_INJECT_FAULT": "flip,step=3,rank=1"}
    want = ("error: VERL_PATCHES_INJECT_FAULT='flip,step=3,rank=1' corrupts rollout weights on purpose (a test of the "
            "weight fingerprint) and is never for a real run: unset it (scripts/train_tiny.sh is the launcher for "
            "fault-injection runs)")
    dry, real = _run(RANDOM_INIT, "--dry-run", **env), _run(RANDOM_INIT, **env)
    for r in (dry, real):
        assert r.returncode == 2 and _errors(r) == [want], r.stderr
    # The tiny launcher, where the fingerprint check is tested, allows it.
    assert cluster_checks.env_problems({**env, "LAUNCH_ALLOW_FAULT_INJECTION": "1"}) == []


def test_switching_patches_off_is_said_on_every_run():
    warned = cluster_checks.env_warnings({"VERL_PATCHES_OFF": "yes", "VERL_PATCHES_DISABLE": "a.b,c.d"})
    assert warned == [
        "VERL_PATCHES_OFF='yes' weakens the run: no patch is applied: every fix and check of the overlay is off "
        "(upstream's behaviour)",
        "VERL_PATCHES_DISABLE='a.b,c.d' weakens the run: the named patches, and the checks they carry, are off"]
    assert cluster_checks.env_warnings({"VERL_PATCHES_OFF": "0", "VERL_PATCHES_DISABLE": ""}) == []
    # A warning, not an error: the launcher goes on (to the bad RAY_PORT here, which stops it before anything).
    r = _run(RANDOM_INIT, "--dry-run", VERL_PATCHES_OFF="1", RAY_PORT="99999")
    assert "warning: VERL_PATCHES_OFF='1' weakens the run: no patch is applied" in r.stderr
    assert _errors(r) == ["error: RAY_PORT must be a TCP port, a whole number from 1 to 65535, got '99999'"]
