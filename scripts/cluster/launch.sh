#!/usr/bin/env bash
# The launcher body shared by scripts/train_*.sh: parse --dry-run, build the trainer
# command for one config, validate (doctor, config composition, layout arithmetic),
# then bring up Ray (head or worker) and run verl's trainer on the head.
# Source it after bringup.sh and call launch_main CONFIG_NAME "$@".
#
# LAUNCH_CONSOLE=full (default) shows everything on the console and copies the trainer's output to
# LOG_DIR/trainer.log. LAUNCH_CONSOLE=steps (scripts/train_tiny.sh) keeps the console to what a
# person reads: the bring-up, the checks and Ray's messages go to LOG_DIR/launch.log, the trainer's
# whole output to LOG_DIR/trainer.log, and the console gets one line per phase, the run report's
# lines (python -m verl_patches.reporting.console) and, on a failure, the end of the log that says why.

# Run instead of sourced: say how it is used, define nothing, run nothing.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  usage="usage: source scripts/cluster/launch.sh (from bash; after bringup.sh, then call launch_main CONFIG_NAME ARG...). It defines functions and runs nothing.
A launcher's options: bash scripts/train_deepseekv3_256die_random_init.sh --help"
  if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then echo "$usage"; exit 0; fi
  echo "$usage" >&2
  exit 2
fi

launch_usage() {
  cat <<USAGE
usage: $(basename "$0") [--dry-run] [HYDRA_OVERRIDE ...]

  --dry-run   print the environment, the Ray commands and the composed trainer command,
              validate them with the real run's own checks (environment values, on the head its
              port, on every node the model, data and checkpoint, doctor, config composition,
              layout); start nothing.
  HYDRA_OVERRIDE  passed to verl.trainer.main_ppo, e.g. trainer.total_training_steps=5

Run the same command on every node. Environment (defaults in parentheses):
  ROLE (from NODE_RANK, else head if MASTER_ADDR is a local address), NODE_RANK,
  MASTER_ADDR (first local address), RAY_PORT (6379), NNODES (16), DEVICES_PER_NODE (16),
  DEVICE (npu | cuda | cpu | npu-rehearsal), UPSTREAM_ROOT (copied upstream packages, first on PYTHONPATH), SOCKET_IFNAME (the interface routing to MASTER_ADDR),
  CANN_ENV_SCRIPT, NNAL_ENV_SCRIPT, MODEL_PATH, TRAIN_FILES, VAL_FILES,
  CKPT_SAVE_DIR (required on more than one node: a directory every node shares; one node: under out/),
  LOG_DIR, RAY_TEMP_DIR, RAY_NUM_CPUS, WAIT_TIMEOUT_S (900), PYTHON (python3), RAY_BIN (ray),
  LAUNCH_CONSOLE (full | steps: the console shows the report's lines, the rest goes to LOG_DIR)
  ${LAUNCH_EXTRA_USAGE:-}
USAGE
}

launch_defaults() {
  MODEL_PATH="${MODEL_PATH:-${HOME}/models/DeepSeek-V3-bf16}"
  TRAIN_FILES="${TRAIN_FILES:-${HOME}/data/deepscaler/train.parquet}"
  VAL_FILES="${VAL_FILES:-${HOME}/data/deepscaler/test.parquet}"
  LAUNCH_CKPT_SAVE_DIR_GIVEN="${CKPT_SAVE_DIR:+1}"
  CKPT_SAVE_DIR="${CKPT_SAVE_DIR:-${RECIPE_ROOT}/out/checkpoints/${CONFIG_NAME}}"
}

# TRAINER_CMD: what the head runs. CONFIG_OVERRIDES: the Hydra overrides alone, which
# the validation composes exactly as verl's main_ppo will.
launch_build_trainer_cmd() {
  CONFIG_OVERRIDES=(
    "actor_rollout_ref.model.path=${MODEL_PATH}"
    "data.train_files=${TRAIN_FILES}"
    "data.val_files=${VAL_FILES}"
    "trainer.nnodes=${NNODES}"
    "trainer.n_gpus_per_node=${DEVICES_PER_NODE}"
    "trainer.device=$(bringup_trainer_device)"
    "trainer.default_local_dir=${CKPT_SAVE_DIR}"
    "${LAUNCH_RUN_OVERRIDES[@]}"
    "${USER_OVERRIDES[@]}"
  )
  TRAINER_CMD=("$PYTHON" -m verl.trainer.main_ppo "--config-path=${RECIPE_ROOT}/configs"
               "--config-name=${CONFIG_NAME}" "${CONFIG_OVERRIDES[@]}")
}

launch_print_cmd() {
  printf '  '
  printf '%q ' "$@"
  printf '\n'
}

# The Python environment, the head's inputs (on the head), the doctor, then Hydra composition and
# layout checks; returns non-zero on any failure. The dry run and the real run both call exactly this.
launch_validate() {
  local role="$1" rc=0
  # The overlay from this checkout, whether or not it is pip-installed.
  local -x PYTHONPATH="${RECIPE_ROOT}${UPSTREAM_ROOT:+:${UPSTREAM_ROOT}}${PYTHONPATH:+:${PYTHONPATH}}"
  echo "== python environment ($PYTHON)"
  local missing
  missing="$("$PYTHON" - <<'PY' 2>&1
import importlib.util
need = {"torch": "torch", "hydra": "hydra-core", "omegaconf": "hydra-core", "verl": "verl", "ray": "ray"}
print(" ".join(sorted({pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None})))
PY
)" || missing="(python failed: $missing)"
  if [[ -n "$missing" ]]; then
    echo "error: $PYTHON lacks: $missing (install requirements.txt, or set PYTHON to the recipe's environment)" >&2
    return 1
  fi
  echo "  torch, hydra-core, verl, ray importable"
  # Every rank writes its shards of a checkpoint into CKPT_SAVE_DIR: on several nodes that must be one directory
  # they all see. The default lies under this checkout, inside this node's container: refused, not guessed.
  if ((NNODES > 1)) && [[ -z "${LAUNCH_CKPT_SAVE_DIR_GIVEN:-}" ]]; then
    echo "error: CKPT_SAVE_DIR is not set on a ${NNODES}-node run: every node's ranks write their shards of a checkpoint into it, and the default (${CKPT_SAVE_DIR}) is inside this node's container; set CKPT_SAVE_DIR to a directory on storage every node mounts at the same path" >&2
    rc=1
  fi
  if [[ "$role" == head ]]; then
    launch_check_head head || rc=1
  else
    # The inputs every node reads are checked here too, with the head's messages (its Ray port is the head's).
    launch_check_head worker || rc=1
  fi
  echo "== doctor"
  if "$PYTHON" -c 'import verl_patches.cli' 2>/dev/null; then
    # UPSTREAM_ROOT is first on PYTHONPATH, so the doctor finds the copied packages there.
    # On Ascend it also resolves the layer spec this config's ranks build DeepSeek-V3 from, and lists its classes.
    "$PYTHON" -m verl_patches doctor --platform "$(bringup_platform)" --layer-spec "$CONFIG_NAME" -- "${CONFIG_OVERRIDES[@]}" \
      || { echo "error: doctor failed (see above)" >&2; rc=1; }
  else
    echo "error: doctor unavailable: 'import verl_patches.cli' fails with $PYTHON (is the overlay on PYTHONPATH?)" >&2
    rc=1
  fi
  echo "== prelude hook in verl's worker module"
  "$PYTHON" -m verl_patches hook check \
    || { echo "error: the overlay is not hooked into this verl: run '$PYTHON -m verl_patches hook install' on every node" >&2; rc=1; }
  echo "== config composition, layout and data ($CONFIG_NAME)"
  "$PYTHON" -m verl_patches.checks.recipe_config --config-name "$CONFIG_NAME" --print-config --check-data \
    -- "${CONFIG_OVERRIDES[@]}" \
    || { echo "error: config composition, layout or data check failed (see above)" >&2; rc=1; }
  return "$rc"
}

# What the head reads before anything starts (verl_patches/launch/cluster_checks.py, one checker for the dry
# run and the real run): RAY_PORT free on MASTER_ADDR, MODEL_PATH's config.json, the data files and,
# for a real-weight run (LAUNCH_CKPT_DIR), a complete checkpoint of that config's model.
launch_check_head() {
  local what="${1:-head}"
  if [[ "$what" == head ]]; then
    echo "== head inputs: RAY_PORT, model, data${LAUNCH_CKPT_DIR:+, checkpoint ${LAUNCH_CKPT_DIR}}"
  else
    echo "== shared inputs (as the head checks them): model, data${LAUNCH_CKPT_DIR:+, checkpoint ${LAUNCH_CKPT_DIR}}"
  fi
  local ckpt=()
  if [[ -n "${LAUNCH_CKPT_DIR:-}" ]]; then ckpt=(--ckpt "$LAUNCH_CKPT_DIR"); fi
  MODEL_PATH="$MODEL_PATH" TRAIN_FILES="$TRAIN_FILES" VAL_FILES="$VAL_FILES" MASTER_ADDR="$MASTER_ADDR" \
    RAY_PORT="$RAY_PORT" "$PYTHON" -m verl_patches.launch.cluster_checks "$what" "${ckpt[@]}"
}

launch_main() {
  CONFIG_NAME="$1"; shift
  local dry=0
  USER_OVERRIDES=()
  while (($#)); do
    case "$1" in
      --dry-run) dry=1 ;;
      -h|--help) launch_usage; return 0 ;;
      --*) echo "error: unknown option $1 (Hydra overrides have no leading --)" >&2; launch_usage >&2; return 2 ;;
      *) USER_OVERRIDES+=("$1") ;;
    esac
    shift
  done
  bringup_defaults
  bringup_check_env || return $?
  recipe_env_apply "$DEVICE" || return $?
  bringup_rehearsal_env
  launch_defaults
  # Run-specific required inputs and overrides (set by the train_*.sh script).
  LAUNCH_RUN_OVERRIDES=()
  # A train_*.sh may name extra variables to print (an array); none by default.
  if ! declare -p LAUNCH_EXTRA_VARS >/dev/null 2>&1; then LAUNCH_EXTRA_VARS=(); fi
  if declare -F launch_run_hook >/dev/null; then
    launch_run_hook || return $?
  fi
  local role
  role="$(bringup_role)" || return $?
  launch_build_trainer_cmd
  LAUNCH_CONSOLE="${LAUNCH_CONSOLE:-full}"  # full | steps (checked by bringup_check_env)
  if [[ $dry == 1 || "$LAUNCH_CONSOLE" == full ]]; then
    launch_run "$role" "$dry" 3>&1 4>&2
    return $?
  fi
  # steps: this shell's output goes to launch.log; fds 3 and 4 stay the console's.
  mkdir -p "$LOG_DIR"
  LAUNCH_LOG="${LOG_DIR}/launch.log"
  : >"$LAUNCH_LOG"
  local rc=0
  launch_run "$role" "$dry" 3>&1 4>&2 >>"$LAUNCH_LOG" 2>&1 || rc=$?
  if ((rc)) && [[ "${LAUNCH_FAILED_LOG:-}" != shown ]]; then
    launch_show_tail "$LAUNCH_LOG" "launch failed (status $rc)"
  fi
  return "$rc"
}

# To the console (fd 3) when LAUNCH_CONSOLE=steps; in the log otherwise too.
launch_say() {
  echo "$*"
  if [[ "${LAUNCH_CONSOLE:-full}" == steps ]]; then echo "$*" >&3; fi
}

# On stderr: why it stopped, from the end of a log.
launch_show_tail() {
  local log="$1" what="$2"
  echo "error: ${what}; the end of ${log}:" >&2
  # Long lines (a worker's config dump) are cut: the lines around the error stay on the screen.
  tail -n "${LAUNCH_TAIL_LINES:-30}" "$log" | sed -e 's/\x1b\[[0-9;]*m//g' -e 's/^\(.\{240\}\).*/\1 [...]/' \
    -e 's/^/  | /' >&2
}

# Print, validate and start this node's part. fd 3 and 4: the console's stdout and stderr.
launch_run() {
  local role="$1" dry="$2"
  echo "== ${CONFIG_NAME}: role ${role}$([[ $dry == 1 ]] && echo ' (dry run: nothing is started)')"
  echo "== environment"
  bringup_print_env MODEL_PATH TRAIN_FILES VAL_FILES CKPT_SAVE_DIR "${LAUNCH_EXTRA_VARS[@]}"
  echo "== runtime environment (scripts/cluster/recipe_env.sh; a value already in the environment wins)"
  recipe_env_print
  echo "== Ray head command (node ${MASTER_ADDR})"
  bringup_ray_head_cmd; launch_print_cmd "${RAY_CMD[@]}"
  echo "== Ray worker command (every other node)"
  bringup_ray_worker_cmd; launch_print_cmd "${RAY_CMD[@]}"
  echo "== trainer command (head, after all ${NNODES} x ${DEVICES_PER_NODE} devices joined)"
  launch_print_cmd "${TRAINER_CMD[@]}"

  if [[ $dry == 1 ]]; then
    if launch_validate "$role"; then
      echo "== dry run OK: configuration composed and validated"
      return 0
    fi
    echo "== dry run FAILED: see the errors above" >&2
    return 1
  fi

  # CANN first: the doctor imports torch_npu on Ascend.
  bringup_source_cann || return $?
  # The dry run's checks, the same function, on every node before it starts or joins anything: a worker
  # checks the inputs it shares with the head, its environment, doctor, prelude hook and config (one that
  # failed any would only fail later inside verl's workers).
  launch_validate "$role" || return 1
  if [[ "$role" == head ]]; then
    launch_say "checks passed: python environment, head inputs, doctor, prelude hook, config composition, layout and data"
  else
    launch_say "checks passed: python environment, shared inputs, doctor, prelude hook, config composition, layout and data"
  fi
  launch_start "$role"
}

# The node watch saw a node go: say so on the console (its line names the node and the step).
launch_node_lost() {
  local line
  line="$(grep -h '^error: node ' "${LOG_DIR}/node_watch.log" 2>/dev/null | head -n 3)"
  launch_say "${line:-error: the node watch stopped without naming a node (${LOG_DIR}/node_watch.log)}"
  if [[ "${LAUNCH_CONSOLE:-full}" != steps ]]; then echo "${line:-}" >&2; fi
  launch_say "stopping the run: the trainer and this node's Ray are stopped; the other nodes' launchers end with their Ray"
  LAUNCH_FAILED_LOG=shown
}

# Start this node's part: Ray (and, on the head, the trainer once every device joined).
# Everything started is stopped when this shell exits, including on SIGINT, SIGTERM and
# SIGHUP; if the shell is killed outright, the parent-death signal (procs exec) stops it.
launch_start() {
  local role="$1"
  bringup_export_env
  trap bringup_stop EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  trap 'exit 129' HUP
  if [[ "$role" == worker ]]; then
    bringup_start_worker || return $?
    # Stay up as long as this node's Ray runs and the head is there. Once the head's port refuses
    # connections (its launcher stopped its Ray), this node's Ray is stopped at once; a head that has not
    # answered for HEAD_SILENT_S (default RAY_gcs_rpc_server_reconnect_timeout_s: a partition) stops it
    # too, exit 4: Ray's raylet does not notice a silent head while it has no call to the head pending
    # (measured: still up 2 minutes after its link was cut, in tests/recipe/test_multinode_node_loss.py).
    local ray_pid="${BRINGUP_PIDS[0]}" refused=0 wrc=0 last_up=$SECONDS
    local silent_s="${HEAD_SILENT_S:-${RAY_gcs_rpc_server_reconnect_timeout_s:-60}}"
    if ! [[ "$silent_s" =~ ^[1-9][0-9]*$ ]]; then
      echo "error: HEAD_SILENT_S='${silent_s}' must be a positive number of seconds" >&2
      return 2
    fi
    while bringup_alive "$ray_pid"; do
      case "$(bringup_head_state)" in
        up) refused=0; last_up=$SECONDS ;;
        refused) refused=$((refused + 1)) ;;
        *) refused=0 ;;
      esac
      if ((refused >= 2)); then
        launch_say "the Ray head at ${MASTER_ADDR}:${RAY_PORT} is gone (its port refuses connections): stopping this node's Ray"
        return 0
      fi
      if ((SECONDS - last_up >= silent_s)); then
        launch_say "error: the Ray head at ${MASTER_ADDR}:${RAY_PORT} has not answered for $((SECONDS - last_up)) s (HEAD_SILENT_S=${silent_s}): this node is cut off; stopping its Ray"
        return 4
      fi
      sleep 2 & wait "$!" || true
    done
    wait "$ray_pid" || wrc=$?
    launch_say "this node's Ray exited (status ${wrc}; ${LOG_DIR}/ray_worker_$(hostname 2>/dev/null || echo node).log)"
    # Killed (SIGKILL, the OOM killer): the node's part of the run was lost, which its status says.
    if ((wrc > 128 && wrc != 143)); then return "$wrc"; fi
    return 0
  fi
  bringup_start_head
  bringup_wait_devices || return $?
  mkdir -p "$LOG_DIR"
  local log="${LOG_DIR}/trainer.log" out filter_pid=""
  launch_say "Ray head up with ${NNODES} x ${DEVICES_PER_NODE} $(bringup_resource_name); starting the trainer; its whole output: ${log}"
  if [[ "${LAUNCH_CONSOLE:-full}" == steps ]]; then
    exec {out}> >("$PYTHON" -m verl_patches.reporting.console "$log" >&3 2>&4)
    filter_pid=$!
  else
    exec {out}> >(tee -a "$log")
  fi
  "$PYTHON" -m verl_patches.launch.procs exec -- "${TRAINER_CMD[@]}" >&"$out" 2>&1 &
  local trainer_pid=$!
  exec {out}>&-
  BRINGUP_PIDS=("$trainer_pid" "${BRINGUP_PIDS[@]}")
  # Every node that joined is watched while the trainer runs (verl_patches/launch/node_watch.py): a node
  # whose Ray dies or goes silent stops the run within Ray's health-check bound, naming the node and the
  # step, instead of leaving the other ranks in a collective until its communication timeout.
  bringup_start_node_watch "$log"
  local watch_pid="$BRINGUP_WATCH_PID"
  local rc=0
  # The Ray head is watched while the trainer runs: if it exits, the run stops at once, saying so
  # (the trainer's Ray calls would otherwise retry a dead head for minutes). The short sleep runs in
  # the background and is waited for, so the traps still run at once on a signal.
  while bringup_alive "$trainer_pid"; do
    if ! bringup_head_alive "while the trainer ran"; then rc=3; break; fi
    if ! bringup_alive "$watch_pid"; then rc=4; break; fi
    sleep 1 & wait "$!" || true
  done
  if ((rc == 3)); then
    launch_say "the Ray head exited while the trainer ran: stopping the run (${LOG_DIR}/ray_head.log)"
    return "$rc"
  fi
  if ((rc == 4)); then
    launch_node_lost
    return "$rc"
  fi
  wait "$trainer_pid" || rc=$?
  if [[ -n "$filter_pid" ]]; then
    # The console filter ends at the end of the trainer's output; teardown stops it if a leftover
    # process still holds that output open.
    local waited=0
    while bringup_alive "$filter_pid" && ((waited < 50)); do sleep 0.1; waited=$((waited + 1)); done
    BRINGUP_PIDS+=("$filter_pid")
  fi
  # A trainer that failed because a node went (its collectives to the node's ranks broke, an actor there
  # died) is reported as the node's loss: the watch is given the health checks' time to see it.
  if ((rc)) && bringup_node_watch_sees_loss "$watch_pid"; then
    launch_node_lost
    return 4
  fi
  launch_say "trainer exited with status $rc"
  if ((rc)) && [[ "${LAUNCH_CONSOLE:-full}" == steps ]]; then
    launch_show_tail "$log" "the trainer failed (status $rc)" 2>&4
    LAUNCH_FAILED_LOG=shown
  fi
  return "$rc"
}
