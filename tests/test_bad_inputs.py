"""Bad input at every entry point: for each case a non-zero exit, a message naming the input, no
Python traceback, and no change to any existing file (finding 8 and deliverable 7).

Python entry points are called in-process through their ``main(argv)`` (cheap); the shell
launchers and the setup script run under bash, failing before any Python starts.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def ws(tmp_path):
    """A workspace of bad inputs; every file in it must be unchanged after each case."""
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bin.dat").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "file.txt").write_text("a file, not a directory\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "keep.txt").write_text("keep me\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "hf_noconfig").mkdir()
    (tmp_path / "hf_noconfig" / "x.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    (tmp_path / "hf_badindex").mkdir()
    (tmp_path / "hf_badindex" / "config.json").write_text('{"num_hidden_layers": 2, "n_routed_experts": 4, '
                                                          '"first_k_dense_replace": 1, "num_attention_heads": 2}')
    (tmp_path / "hf_badindex" / "model.safetensors.index.json").write_text('{"weight_map": {"a": "missing.safetensors"}}')
    (tmp_path / "ckpt_garbage").mkdir()
    for name in (".metadata", "common.pt"):
        (tmp_path / "ckpt_garbage" / name).write_bytes(b"garbage")
    (tmp_path / "ckpt_garbage" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / "model_strings.json").write_text('{"num_hidden_layers": "61", "first_k_dense_replace": 3, '
                                                 '"n_routed_experts": 256}')
    (tmp_path / "hf_huge").mkdir()
    (tmp_path / "hf_huge" / "config.json").write_text('{"num_hidden_layers": 1000000000, "n_routed_experts": 4, '
                                                      '"first_k_dense_replace": 1, "num_attention_heads": 2}')
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"data_source": "deepscaler", "prompt": "What is 1+1?",
                                          "reward_model": {"ground_truth": "2"}}]), str(tmp_path / "str_prompt.parquet"))
    return tmp_path


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(root.rglob("*"))}


def _main(target: str) -> Callable[[list[str]], int]:
    import importlib

    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn or "main")


CLI = "verl_patches.cli"
PREFLIGHT = "verl_patches.preflight.cli"
PLAN = "verl_patches.reshard.cli"
RECIPE = "verl_patches.checks.recipe_config"
PREPARE = "verl_patches.data.prepare"
CHECK = "verl_patches.checks.data_check"
HF2MC = "verl_patches.tools.hf_to_mcore"
MC2HF = "verl_patches.tools.mcore_to_hf"
FP8 = "verl_patches.tools.fp8_to_bf16"
CKPT = "verl_patches.tools.check_ckpt"
RI = "deepseekv3_256die_random_init"

# (id, entry point, argv with {ws} for the workspace, text the message must contain)
CASES = [
    # python -m verl_patches ...
    ("doctor-upstream-root-typo", CLI, ["doctor", "--upstream-root", "{ws}/typo"], "{ws}/typo is not a directory"),
    ("doctor-upstream-root-empty", CLI, ["doctor", "--upstream-root", "{ws}/empty"], "lock:verl"),
    ("doctor-bad-platform", CLI, ["doctor", "--platform", "tpu"], "invalid choice: 'tpu'"),
    ("unknown-subcommand", CLI, ["doctr"], "invalid choice: 'doctr'"),
    ("diff-unknown-id", CLI, ["diff", "no.such.patch"], "no.such.patch"),
    ("fingerprint-no-qualname", CLI, ["fingerprint", "verl.utils.reward_score"], "verl.utils.reward_score"),
    ("fingerprint-unknown-target", CLI, ["fingerprint", "verl.utils.reward_score:nope"], "'nope' is not defined"),
    ("hook-upstream-root-typo", CLI, ["hook", "check", "--upstream-root", "{ws}/typo"], "{ws}/typo"),
    ("hook-bad-action", CLI, ["hook", "instal"], "invalid choice: 'instal'"),
    ("rollout-plan-lengths-bad-json", CLI, ["rollout-plan", "--no-png", "--lengths", "{ws}/bad.json"],
     "--lengths {ws}/bad.json: not JSON"),
    ("rollout-plan-lengths-binary", CLI, ["rollout-plan", "--no-png", "--lengths", "{ws}/bin.dat"],
     "--lengths {ws}/bin.dat: cannot read it"),
    ("rollout-plan-tpot-list", CLI, ["rollout-plan", "--no-png", "--tpot", "{ws}/list.json"],
     "--tpot {ws}/list.json: a TPOT table is a mapping"),
    ("rollout-plan-png-dir", CLI, ["rollout-plan", "--no-recommend", "--dp", "2", "--prompts", "2", "--n", "2",
                                   "--tpot", "2=10", "--png", "{ws}/file.txt/plan.png"], "--png {ws}/file.txt/plan.png"),
    # preflight: every layout and argument mistake is found before a process starts
    ("preflight-nproc-0", PREFLIGHT, ["--nproc", "0"], "argument --nproc: '0': expected a whole number >= 1"),
    ("preflight-nproc-negative", PREFLIGHT, ["--nproc", "-2"], "argument --nproc: '-2': expected a whole number >= 1"),
    ("preflight-no-default-layout", PREFLIGHT, ["--nproc", "3"], "give --train and --rollout for 3 processes"),
    ("preflight-train-not-int", PREFLIGHT, ["--nproc", "2", "--train", "tp=x", "--rollout", "dp=2"], "'tp=x'"),
    ("preflight-train-unknown-key", PREFLIGHT, ["--nproc", "2", "--train", "tq=2", "--rollout", "dp=2"], "['tq']"),
    ("preflight-world-mismatch", PREFLIGHT, ["--nproc", "2", "--train", "tp=1", "--rollout", "dp=4"],
     "spans 4 ranks but 2 processes"),
    ("preflight-tp-does-not-divide", PREFLIGHT, ["--nproc", "2", "--train", "tp=4", "--rollout", "dp=2"],
     "not divisible by train tp*pp = 4"),
    ("preflight-layers", PREFLIGHT, ["--nproc", "2", "--train", "pp=2,layers=1,1", "--rollout", "dp=2"],
     "train layers [1, 1]"),
    ("preflight-model-missing", PREFLIGHT, ["--model", "{ws}/nope.json"], "{ws}/nope.json"),
    ("preflight-model-bad-json", PREFLIGHT, ["--nproc", "1", "--model", "{ws}/bad.json", "--train", "tp=1",
                                            "--rollout", "dp=1"], "{ws}/bad.json: not readable JSON"),
    ("preflight-model-not-object", PREFLIGHT, ["--nproc", "1", "--model", "{ws}/list.json", "--train", "tp=1",
                                              "--rollout", "dp=1"], "expected a JSON object"),
    ("preflight-steps-0", PREFLIGHT, ["--steps", "0"], "argument --steps: '0': expected a whole number >= 1"),
    ("preflight-bucket", PREFLIGHT, ["--bucket-mb", "0"],
     "argument --bucket-mb: '0': expected a finite number >= 0.000976562"),
    ("preflight-corrupt", PREFLIGHT, ["--nproc", "1", "--corrupt", "zero"], "--corrupt 'zero'"),
    ("preflight-backend", PREFLIGHT, ["--backend", "mpi"], "invalid choice: 'mpi'"),
    ("preflight-json-is-dir", PREFLIGHT, ["--json", "{ws}/dir"], "--json {ws}/dir: expected a file path"),
    ("preflight-json-unwritable", PREFLIGHT, ["--json", "{ws}/file.txt/out.json"], "cannot write in {ws}/file.txt"),
    ("preflight-dump-is-file", PREFLIGHT, ["--dump", "{ws}/file.txt"], "--dump {ws}/file.txt: expected a directory"),
    # plan
    ("plan-model-missing", PLAN, ["--model", "{ws}/nope.json", "--train", "tp=1", "--rollout", "dp=1"], "nope.json"),
    ("plan-model-bad-json", PLAN, ["--model", "{ws}/bad.json", "--train", "tp=1", "--rollout", "dp=1"], "plan: error"),
    ("plan-train-zero", PLAN, ["--model", "configs/model/tiny_deepseek_v3.json", "--train", "tp=0", "--rollout", "dp=1"],
     "train tp must be >= 1"),
    ("plan-rollout-junk", PLAN, ["--model", "configs/model/tiny_deepseek_v3.json", "--train", "tp=1", "--rollout", "dp"],
     "rollout layout 'dp'"),
    ("plan-bucket-nan", PLAN, ["--model", "configs/model/tiny_deepseek_v3.json", "--train", "tp=1", "--rollout", "dp=1",
                               "--bucket-mb", "nan"], "argument --bucket-mb: 'nan': expected a finite number >= 0.000976562"),
    ("plan-model-string-value", PLAN, ["--model", "{ws}/model_strings.json", "--train", "tp=1", "--rollout", "dp=1"],
     "num_hidden_layers='61'"),
    ("plan-model-binary", PLAN, ["--model", "{ws}/bin.dat", "--train", "tp=1", "--rollout", "dp=1"],
     "{ws}/bin.dat: not a JSON config.json"),
    ("plan-world-huge", PLAN, ["--model", "configs/model/tiny_deepseek_v3.json", "--train", "tp=1",
                               "--rollout", "tp=1,dp=100000000"], "rollout dp must be <= 8192"),
    ("plan-bucket", PLAN, ["--model", "configs/model/tiny_deepseek_v3.json", "--train", "tp=1", "--rollout", "dp=1",
                           "--bucket-mb", "-1"], "argument --bucket-mb: '-1': expected a finite number"),
    # the recipe's config: wrong types, unknown keys and impossible layouts are named errors
    ("config-unknown-name", RECIPE, ["--config-name", "nope"], "config composition failed for nope"),
    ("config-model-missing", RECIPE, ["--config-name", RI, "--model-config", "{ws}/nope.json"], "{ws}/nope.json"),
    ("config-model-bad-json", RECIPE, ["--config-name", RI, "--model-config", "{ws}/bad.json"], "{ws}/bad.json"),
    ("config-model-string-values", RECIPE, ["--config-name", RI, "--model-config", "{ws}/model_strings.json"],
     "('num_hidden_layers', '61')"),
    ("config-nnodes-float", RECIPE, ["--config-name", RI, "trainer.nnodes=16.0"],
     "trainer.nnodes must be a positive integer, got 16.0"),
    ("config-tp-string", RECIPE, ["--config-name", RI, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size='4'"],
     "tensor_model_parallel_size must be a positive integer, got '4'"),
    ("config-one-node", RECIPE, ["--config-name", RI, "trainer.nnodes=1", "trainer.n_gpus_per_node=8"],
     "world size 8 (trainer.nnodes 1 x trainer.n_gpus_per_node 8) is not divisible"),
    ("config-string-bool", RECIPE, ["--config-name", RI, "actor_rollout_ref.rollout.recipe.offload=yes"],
     "recipe.offload must be true or false, got the string 'yes'"),
    ("config-quoted-bool", RECIPE, ["--config-name", RI, "actor_rollout_ref.rollout.recipe.tensor_cache='true'"],
     "recipe.tensor_cache must be true or false, got the string 'true'"),
    ("config-unknown-key", RECIPE, ["--config-name", RI, "+actor_rollout_ref.rollout.recipe.reshard_metod=direct"],
     "recipe.reshard_metod: unknown key (did you mean 'reshard_method'?)"),
    ("config-unknown-nested-key", RECIPE, ["--config-name", RI, "+actor_rollout_ref.rollout.recipe.vllm_dp.instance=2"],
     "vllm_dp.instance: unknown key (did you mean 'instances'?)"),
    ("config-bad-method", RECIPE, ["--config-name", RI, "actor_rollout_ref.rollout.recipe.reshard_method=fast"],
     "reshard_method must be one of ['direct', 'alltoallv', 'upstream'], got the string 'fast'"),
    ("config-dp-string", RECIPE, ["--config-name", RI, "actor_rollout_ref.rollout.recipe.vllm_dp.dp_size='128'"],
     "vllm_dp.dp_size must be an integer, got the string '128'"),
    ("config-megatron-string-bool", RECIPE, ["--config-name", RI,
                                             "actor_rollout_ref.rollout.recipe.megatron.swap_optimizer='false'"],
     "swap_optimizer must be true or false, got 'false'"),
    ("config-layer-list", RECIPE, ["--config-name", RI, "actor_rollout_ref.rollout.recipe.megatron.num_layer_list=[7,7]"],
     "num_layer_list has 2 stages, PP is 8"),
    ("config-batch-zero", RECIPE, ["--config-name", RI, "data.train_batch_size=0"],
     "data.train_batch_size must be >= 1, got 0"),
    # data preparation and the data check
    ("prepare-input-missing", PREPARE, ["deepscaler", "--input", "{ws}/nope.json", "--out-dir", "{ws}/out"],
     "{ws}/nope.json"),
    ("prepare-input-dir", PREPARE, ["deepscaler", "--input", "{ws}/dir", "--out-dir", "{ws}/out"], "{ws}/dir"),
    ("prepare-input-binary", PREPARE, ["gsm8k", "--input", "{ws}/bin.dat", "--out-dir", "{ws}/out"],
     "{ws}/bin.dat: not UTF-8"),
    ("prepare-input-bad-json", PREPARE, ["deepscaler", "--input", "{ws}/bad.json", "--out-dir", "{ws}/out"],
     "{ws}/bad.json: not valid JSON"),
    ("prepare-test-size-nan", PREPARE, ["deepscaler", "--out-dir", "{ws}/out", "--test-size", "nan"], "--test-size"),
    ("prepare-test-size-inf", PREPARE, ["deepscaler", "--out-dir", "{ws}/out", "--test-size", "inf"], "--test-size"),
    ("prepare-test-size-fraction", PREPARE, ["deepscaler", "--out-dir", "{ws}/out", "--test-size", "1.5"], "1.5"),
    ("prepare-out-dir-is-file", PREPARE, ["deepscaler", "--out-dir", "{ws}/file.txt"], "{ws}/file.txt"),
    ("prepare-unscored-source", PREPARE, ["gsm8k", "--out-dir", "{ws}/out", "--data-source", "gsm8k"],
     "--data-source 'gsm8k'"),
    ("prepare-kind", PREPARE, ["math", "--out-dir", "{ws}/out"], "invalid choice: 'math'"),
    ("check-missing", CHECK, ["{ws}/nope.parquet"], "{ws}/nope.parquet"),
    ("check-not-parquet", CHECK, ["{ws}/bad.json"], "{ws}/bad.json: not a verl RL parquet file"),
    ("check-string-prompt", CHECK, ["{ws}/str_prompt.parquet"], "{ws}/str_prompt.parquet: column prompt is string"),
    # checkpoint tools
    ("hf2mc-hf-missing", HF2MC, ["--hf", "{ws}/nope", "--out", "{ws}/out"], "{ws}/nope: not a directory"),
    ("hf2mc-no-config", HF2MC, ["--hf", "{ws}/hf_noconfig", "--out", "{ws}/out"], "{ws}/hf_noconfig: no config.json"),
    ("hf2mc-index-names-missing-shard", HF2MC, ["--hf", "{ws}/hf_badindex", "--out", "{ws}/out"], "missing.safetensors"),
    ("hf2mc-tp-zero", HF2MC, ["--hf", "{ws}/hf_badindex", "--out", "{ws}/out", "--tp", "0"], "argument --tp: '0': expected a whole number >= 1"),
    ("hf2mc-layer-list", HF2MC, ["--hf", "{ws}/hf_badindex", "--out", "{ws}/out", "--num-layer-list", "1,x"], "'1,x'"),
    ("hf2mc-config-huge", HF2MC, ["--hf", "{ws}/hf_huge", "--out", "{ws}/out"], "num_hidden_layers=1000000000"),
    ("hf2mc-out-not-ours", HF2MC, ["--hf", "{ws}/hf_badindex", "--out", "{ws}/dir"], "missing.safetensors"),
    ("mc2hf-ckpt-missing", MC2HF, ["--ckpt", "{ws}/nope", "--config", "{ws}/hf_badindex/config.json", "--out",
                                   "{ws}/out"], "{ws}/nope is not a complete torch_dist checkpoint"),
    ("mc2hf-config-bad", MC2HF, ["--ckpt", "{ws}/ckpt_garbage", "--config", "{ws}/bad.json", "--out", "{ws}/out"],
     "{ws}/bad.json"),
    ("mc2hf-metadata-garbage", MC2HF, ["--ckpt", "{ws}/ckpt_garbage", "--config", "{ws}/hf_badindex/config.json",
                                       "--out", "{ws}/out"], "{ws}/ckpt_garbage/.metadata is not a readable"),
    ("fp8-input-missing", FP8, ["--input", "{ws}/nope", "--output", "{ws}/out"], "{ws}/nope is not a directory"),
    ("fp8-bad-index", FP8, ["--input", "{ws}/hf_badindex", "--output", "{ws}/out"], "missing.safetensors"),
    ("fp8-not-safetensors", FP8, ["--input", "{ws}/hf_noconfig", "--output", "{ws}/out"], "not a safetensors file"),
    ("fp8-same-dir", FP8, ["--input", "{ws}/hf_badindex", "--output", "{ws}/hf_badindex"], "must differ"),
    ("ckpt-not-dir", CKPT, ["{ws}/file.txt"], "{ws}/file.txt is not a directory"),
    ("ckpt-empty", CKPT, ["{ws}/empty"], "{ws}/empty: no .metadata, metadata.json, common.pt"),
    ("ckpt-garbage", CKPT, ["{ws}/ckpt_garbage"], "{ws}/ckpt_garbage/.metadata: not a readable"),
]


@pytest.mark.parametrize("case_id, target, argv, needle", CASES, ids=[c[0] for c in CASES])
def test_python_entry_points(ws, capsys, monkeypatch, case_id, target, argv, needle):
    monkeypatch.chdir(REPO)
    before = _snapshot(ws)
    main = _main(target)
    argv = [a.replace("{ws}", str(ws)) for a in argv]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    out, err = capsys.readouterr()
    assert rc not in (0, None), out + err
    assert needle.replace("{ws}", str(ws)) in err, err
    assert "Traceback" not in out + err
    assert _snapshot(ws) == before


def _bash(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("DIST_CKPT_PATH", "ROLE", "NODE_RANK", "NNODES", "DEVICE")}
    full.update(PYTHON=sys.executable, MASTER_ADDR="10.0.0.1", SOCKET_IFNAME="eth9")
    full.update(env)
    return subprocess.run(["bash", *args], env=full, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))


LAUNCHER = str(REPO / "scripts" / "train_deepseekv3_256die_random_init.sh")
TRUE_WEIGHT = str(REPO / "scripts" / "train_deepseekv3_256die_true_weight.sh")
SHELL_CASES = [
    ("devices-zero", [LAUNCHER, "--dry-run"], {"DEVICES_PER_NODE": "0"}, "DEVICES_PER_NODE must be a positive integer"),
    ("ray-port-text", [LAUNCHER, "--dry-run"], {"RAY_PORT": "http"},
     "RAY_PORT must be a TCP port, a whole number from 1 to 65535, got 'http'"),
    ("nnodes-float", [LAUNCHER, "--dry-run"], {"NNODES": "16.0"}, "NNODES must be a positive integer, got '16.0'"),
    ("wait-timeout", [LAUNCHER, "--dry-run"], {"WAIT_TIMEOUT_S": "-5"}, "WAIT_TIMEOUT_S must be a positive integer"),
    ("device", [LAUNCHER], {"DEVICE": "gpu"}, "DEVICE must be npu, cuda, cpu or npu-rehearsal, got 'gpu'"),
    ("option", [LAUNCHER, "--dryrun"], {}, "unknown option --dryrun"),
    ("ckpt-is-file", [TRUE_WEIGHT, "--dry-run"], {"DIST_CKPT_PATH": "{ws}/file.txt"}, "{ws}/file.txt is not a directory"),
    ("ckpt-empty", [TRUE_WEIGHT, "--dry-run"], {"DIST_CKPT_PATH": "{ws}/empty"}, "{ws}/empty is empty"),
    # The setup script (and the two scripts that run it first) never delete a directory they did not make.
    ("venv-foreign-dir", [str(REPO / "scripts" / "setup_test_env.sh")], {"VENV": "{ws}/dir"},
     "VENV={ws}/dir exists and was not made by this script"),
    ("venv-is-file", [str(REPO / "scripts" / "setup_test_env.sh")], {"VENV": "{ws}/file.txt"},
     "VENV={ws}/file.txt exists and was not made by this script"),
    ("preflight-venv-foreign", [str(REPO / "scripts" / "preflight.sh"), "--nproc", "1"], {"VENV": "{ws}/dir"},
     "VENV={ws}/dir exists and was not made by this script"),
    ("test-venv-foreign", [str(REPO / "scripts" / "test.sh"), "-k", "nothing"], {"VENV": "{ws}/dir"},
     "VENV={ws}/dir exists and was not made by this script"),
]


@pytest.mark.parametrize("case_id, args, env, needle", SHELL_CASES, ids=[c[0] for c in SHELL_CASES])
def test_shell_entry_points(ws, tmp_path_factory, case_id, args, env, needle):
    before = _snapshot(ws)
    env = {k: v.replace("{ws}", str(ws)) for k, v in env.items()}
    # The test environment's Python, except that it refuses to create a virtualenv: a setup
    # script that got past its checks must not start building one here.
    guard = tmp_path_factory.mktemp("bin") / "python"
    guard.write_text(f'#!/bin/sh\n[ "$1 $2" = "-m venv" ] && {{ echo "guard: no venv in tests" >&2; exit 97; }}\n'
                     f'exec {sys.executable} "$@"\n')
    guard.chmod(0o755)
    env.setdefault("PYTHON", str(guard))
    r = _bash(args, env)
    assert r.returncode not in (0, None), r.stdout + r.stderr
    assert needle.replace("{ws}", str(ws)) in r.stderr, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert _snapshot(ws) == before
