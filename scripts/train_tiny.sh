#!/usr/bin/env bash
# The recipe on one machine: real GRPO steps through verl's trainer (verl.trainer.main_ppo) with
# every patch of the overlay, on a 4-layer DeepSeek-V3 with 4 workers (configs/tiny_deepseek_v3.yaml),
# brought up by the same code as the 256-die launchers (scripts/cluster/): a single-node Ray head
# started and stopped by this script, then the trainer.
#
#   bash scripts/train_tiny.sh                       # 12 steps on the CPU
#   bash scripts/train_tiny.sh trainer.total_training_steps=4 trainer.save_freq=2
#   bash scripts/train_tiny.sh --dry-run             # print and validate, start nothing
#
# DEVICE=cpu (default) runs on the host with the CPU platform's stand-ins (verl_patches/rigs/cpu/: vLLM's
# model receives the reshard and transformers generates from it); DEVICE=cuda needs 4 GPUs and an
# environment with vLLM's CUDA build (VENV=...); DEVICE=npu-rehearsal trains the NPU path (MindSpeed,
# MindSpeed-LLM's DeepSeek layers) on the host through the NPU rehearsal platform's torch_npu stand-in
# (verl_patches/rigs/npu_rehearsal/), generation staying the CPU platform's stand-in. Outputs under TINY_OUT
# (default out/tiny): the generated model and data, checkpoints, logs/, metrics.jsonl, tensorboard/ and plots/, and profiles/ when
# actor_rollout_ref.rollout.recipe.profile.stages names stages (docs/TINY_RUN.md, "Profiles").
#
# The console after the environment build: a banner (what runs, where everything goes), one line
# per phase, the run report's line per step and its summary (verl_patches/reporting/report.py), then the plots
# (python -m verl_patches plot). Everything else goes to the logs the banner names
# (LAUNCH_CONSOLE=steps of scripts/cluster/launch.sh; LAUNCH_CONSOLE=full shows it all).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  echo "usage: bash scripts/train_tiny.sh [--dry-run] [HYDRA_OVERRIDE ...]"
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi
export VENV="${VENV:-$ROOT/.venv}"

# SETUP_TEST_ENV=0: the environment is built already (scripts/rehearse_multinode.sh builds it once for
# all its nodes).
if [[ "${SETUP_TEST_ENV:-1}" != 0 ]]; then bash "$ROOT/scripts/setup_test_env.sh"; fi
PY="$VENV/bin/python"
TINY_OUT="${TINY_OUT:-$ROOT/out/tiny}"
mkdir -p "$TINY_OUT"
TINY_OUT="$(cd "$TINY_OUT" && pwd)"
export LOG_DIR="${LOG_DIR:-$TINY_OUT/logs}"
mkdir -p "$LOG_DIR"
SETUP_LOG="$LOG_DIR/setup.log"
: >"$SETUP_LOG"

# The model directory, its Megatron checkpoint and the data: generated, deterministic, offline, built
# once (TINY_ASSETS: a build to share between runs). The checkpoint's names follow the training model's
# layer spec: MindSpeed-LLM's DeepSeek spec on the NPU path (a build of its own), verl's TE names elsewhere.
case "${DEVICE:-cpu}" in
  npu|npu-rehearsal) TINY_SPEC=mindspeed_llm; TINY_ASSETS="${TINY_ASSETS:-$TINY_OUT/assets_mindspeed_llm}" ;;
  *) TINY_SPEC=te; TINY_ASSETS="${TINY_ASSETS:-$TINY_OUT/assets}" ;;
esac
"$PY" -m verl_patches.rigs.tiny.assets "$TINY_ASSETS" --spec "$TINY_SPEC" >>"$SETUP_LOG" 2>&1 \
  || { echo "error: building the tiny assets failed; see $SETUP_LOG" >&2; tail -n 20 "$SETUP_LOG" >&2; exit 1; }

# The one line, as on the cluster: verl's worker module imports the overlay's prelude. The venv's
# verl is left as installed; a copy of it with the hook line goes first on PYTHONPATH
# (README, "copy their packages next to verl_patches").
UPSTREAM_ROOT="$TINY_OUT/upstream"
"$PY" -m verl_patches.rigs.tiny.upstream "$UPSTREAM_ROOT" >>"$SETUP_LOG" 2>&1 \
  || { echo "error: copying verl with the prelude line failed; see $SETUP_LOG" >&2; tail -n 20 "$SETUP_LOG" >&2; exit 1; }

export RECIPE_ROOT="$ROOT" UPSTREAM_ROOT PYTHON="$PY" RAY_BIN="$VENV/bin/ray"
# One node by default; several as on a cluster (scripts/rehearse_multinode.sh): the same command on every
# node with MASTER_ADDR (the head's address), NODE_RANK, NNODES and DEVICES_PER_NODE (NNODES x
# DEVICES_PER_NODE = 4 workers for the tiny config's layout).
export NNODES="${NNODES:-1}"
export DEVICE="${DEVICE:-cpu}" DEVICES_PER_NODE="${DEVICES_PER_NODE:-$((4 / NNODES))}"
export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
export MODEL_PATH="$TINY_ASSETS/model" TRAIN_FILES="$TINY_ASSETS/data/train.parquet"
export VAL_FILES="$TINY_ASSETS/data/val.parquet" CKPT_SAVE_DIR="${CKPT_SAVE_DIR:-$TINY_OUT/checkpoints}"
export WAIT_TIMEOUT_S="${WAIT_TIMEOUT_S:-300}" LAUNCH_CONSOLE="${LAUNCH_CONSOLE:-steps}"
# A Ray of its own, a short private temp dir (Ray's socket paths are limited to 107 characters), and the ports this
# run binds itself, taken as one block of free ports between Ray's own worker ports (10002-19999) and the kernel's
# ephemeral range: Ray's port, the vLLM DP masters' 8, Ray's worker ports (64) and its agents' 4. Ray's fixed
# default ports are shared by every Ray on a host: two tiny runs side by side (the tests run several) failed to bind
# 10002 ("Failed to start the grpc server"). One block, not one pick per purpose: picked separately, two of them
# overlapped once (the DP masters on the run's own agent ports, CI 2026-11-28). RAY_PORT and RAY_EXTRA_ARGS, when
# the user sets them, replace their parts of the block.
PORT_BLOCK="$("$PY" -c 'from verl_patches.base.ports import free_port_block; print(free_port_block(77, low=20000))')"
RAY_PORT="${RAY_PORT:-$PORT_BLOCK}"
RAY_TEMP_DIR="${RAY_TEMP_DIR:-$(mktemp -d /tmp/ray_tiny.XXXXXX)}"
VLLM_DP_PORT=$((PORT_BLOCK + 1))
if [[ -z "${RAY_EXTRA_ARGS:-}" ]]; then
  RAY_OWN_PORT=$((PORT_BLOCK + 9))
  RAY_EXTRA_ARGS="--min-worker-port=$RAY_OWN_PORT --max-worker-port=$((RAY_OWN_PORT + 63))"
  RAY_EXTRA_ARGS+=" --dashboard-agent-listen-port=$((RAY_OWN_PORT + 64)) --dashboard-agent-grpc-port=$((RAY_OWN_PORT + 65))"
  RAY_EXTRA_ARGS+=" --metrics-export-port=$((RAY_OWN_PORT + 66)) --runtime-env-agent-port=$((RAY_OWN_PORT + 67))"
  export RAY_EXTRA_ARGS
fi
export RAY_PORT RAY_TEMP_DIR VLLM_PLUGINS="${VLLM_PLUGINS:-verl_patches}" RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1

# shellcheck source=scripts/cluster/bringup.sh
source "$HERE/cluster/bringup.sh"
# shellcheck source=scripts/cluster/launch.sh
source "$HERE/cluster/launch.sh"

# shellcheck disable=SC2034  # read by launch_main in cluster/launch.sh
LAUNCH_EXTRA_VARS=(UPSTREAM_ROOT)
# The tiny run is where the fingerprint check is tested: VERL_PATCHES_INJECT_FAULT is allowed here only
# (bringup_check_env refuses it in the cluster launchers).
# shellcheck disable=SC2034
LAUNCH_ALLOW_FAULT_INJECTION=1
launch_run_hook() {
  # shellcheck disable=SC2034  # appended to the trainer command by launch_build_trainer_cmd
  LAUNCH_RUN_OVERRIDES=(
    "custom_reward_function.path=${ROOT}/verl_patches/rigs/tiny/reward.py"
    "actor_rollout_ref.actor.megatron.dist_checkpointing_path=${TINY_ASSETS}/dist_ckpt"
    "actor_rollout_ref.rollout.recipe.vllm_dp.master_port_base=${VLLM_DP_PORT}"
    "actor_rollout_ref.rollout.recipe.metrics_file=${TINY_OUT}/metrics.jsonl"
    "actor_rollout_ref.rollout.recipe.tensorboard_dir=${TINY_OUT}/tensorboard"
    "actor_rollout_ref.rollout.recipe.profile.dir=${TINY_OUT}/profiles"
  )
}

# What runs and where it goes (a --dry-run or --help prints its own).
tiny_banner() {
  local steps=12 arg
  for arg in "$@"; do
    case "$arg" in
      --dry-run|-h|--help) return 0 ;;
      trainer.total_training_steps=*) steps="${arg#*=}" ;;
    esac
  done
  echo "== train_tiny: ${steps} GRPO steps of a 4-layer DeepSeek-V3 through verl's trainer (verl.trainer.main_ppo)"
  echo "   with every patch of the overlay, on $((NNODES * DEVICES_PER_NODE)) ${DEVICE} workers$( ((NNODES > 1)) && echo " (${NNODES} nodes x ${DEVICES_PER_NODE}, this node's rank ${NODE_RANK:-from MASTER_ADDR})") (train TP2 x PP2 x EP2, rollout DP2 x TP2)"
  echo "   outputs:     ${TINY_OUT}"
  echo "   logs:        ${LOG_DIR}/ (setup.log, launch.log: bring-up and checks, trainer.log: the trainer's whole output)"
  echo "   metrics:     ${TINY_OUT}/metrics.jsonl, tensorboard: ${TINY_OUT}/tensorboard, plots: ${TINY_OUT}/plots"
}
tiny_banner "$@"

dry=0
case " $* " in *" --dry-run "*|*" -h "*|*" --help "*) dry=1 ;; esac
if ((dry == 0)); then
  # A run's record starts afresh: the report appends to metrics.jsonl and tensorboard adds event files.
  rm -rf -- "$TINY_OUT/metrics.jsonl" "$TINY_OUT/tensorboard" "$TINY_OUT/plots" "$TINY_OUT/profiles" "$LOG_DIR/trainer.log"
fi
rc=0
launch_main tiny_deepseek_v3 "$@" || rc=$?
((dry == 0)) || exit "$rc"
# Ray and the trainer are stopped before the plots are drawn (the EXIT trap would do it after).
bringup_stop
# The head drew them (a worker node has no metrics of its own).
if [[ "$(bringup_role)" == head ]] && { ((rc == 0)) || [[ -s "$TINY_OUT/metrics.jsonl" ]]; }; then
  # The curves of the run (also of a failed one, up to where it stopped).
  "$PY" -m verl_patches plot "$TINY_OUT" || rc=$((rc ? rc : 1))
fi
exit "$rc"
