#!/usr/bin/env bash
# Cluster bring-up shared by the train_*.sh launchers: defaults from the environment,
# head/worker role, Ray start with the device count, wait for every node's devices,
# and teardown of exactly the processes this script started (never by name).
# Source it; nothing runs on source.

# Run instead of sourced: say how it is used, define nothing, run nothing.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  usage="usage: source scripts/cluster/bringup.sh (from bash; the scripts/train_*.sh launchers source it). It defines functions and runs nothing.
A launcher's options: bash scripts/train_deepseekv3_256die_random_init.sh --help"
  if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then echo "$usage"; exit 0; fi
  echo "$usage" >&2
  exit 2
fi

# The runtime environment (every reference variable, its reader and why): recipe_env_apply / _print.
# shellcheck source=scripts/cluster/recipe_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/recipe_env.sh"

# Every value can be overridden from the environment; these are the 256-die defaults.
bringup_defaults() {
  RECIPE_ROOT="${RECIPE_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
  # Upstream packages copied next to each other (verl/, vllm/, megatron/, ...) take precedence over
  # the installed ones when set (README: "clone them at those tags and copy their packages").
  UPSTREAM_ROOT="${UPSTREAM_ROOT:-}"
  NNODES="${NNODES:-16}"
  DEVICES_PER_NODE="${DEVICES_PER_NODE:-16}"
  DEVICE="${DEVICE:-npu}"                      # npu | cuda | cpu (the host: no accelerator) | npu-rehearsal
  PYTHON="${PYTHON:-python3}"
  RAY_BIN="${RAY_BIN:-ray}"
  RAY_PORT="${RAY_PORT:-6379}"
  # Short path: Ray's unix sockets live under it and are limited to 107 characters.
  RAY_TEMP_DIR="${RAY_TEMP_DIR:-/tmp/ray_recipe}"
  RAY_NUM_CPUS="${RAY_NUM_CPUS:-}"             # empty: Ray counts the cores itself
  RAY_EXTRA_ARGS="${RAY_EXTRA_ARGS:-}"         # more `ray start` flags (e.g. fixed agent ports), split on spaces
  WAIT_TIMEOUT_S="${WAIT_TIMEOUT_S:-900}"
  STOP_GRACE_S="${STOP_GRACE_S:-15}"
  MASTER_ADDR="${MASTER_ADDR:-$(bringup_local_ips | head -n1)}"
  MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
  SOCKET_IFNAME="${SOCKET_IFNAME:-$(bringup_ifname_for "$MASTER_ADDR")}"
  CANN_ENV_SCRIPT="${CANN_ENV_SCRIPT:-/usr/local/Ascend/ascend-toolkit/set_env.sh}"
  NNAL_ENV_SCRIPT="${NNAL_ENV_SCRIPT:-/usr/local/Ascend/nnal/atb/set_env.sh}"
  LOG_DIR="${LOG_DIR:-${RECIPE_ROOT}/out/logs}"
  BRINGUP_PIDS=()
  BRINGUP_HEAD_PID=""
}

bringup_local_ips() {
  if command -v ip >/dev/null 2>&1; then
    ip -o -4 addr show scope global 2>/dev/null | awk '{split($4, a, "/"); print a[1]}'
  elif command -v hostname >/dev/null 2>&1; then
    hostname -I 2>/dev/null | tr ' ' '\n' | grep -v '^$' || true
  fi
}

# The interface that reaches the head: what gloo/HCCL/NCCL must bind to. On the head
# itself that is the interface holding MASTER_ADDR (a route lookup would say "lo").
bringup_ifname_for() {
  local dev=""
  if command -v ip >/dev/null 2>&1; then
    dev="$(ip -o -4 addr show 2>/dev/null | awk -v a="$1" '{split($4, p, "/"); if (p[1] == a) {print $2; exit}}')"
    if [[ -z "$dev" ]]; then
      dev="$(ip -o route get "$1" 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')"
    fi
  fi
  echo "${dev:-eth0}"
}

# head | worker: ROLE if set, else NODE_RANK (0 is the head), else whether MASTER_ADDR is ours.
bringup_role() {
  if [[ -n "${ROLE:-}" ]]; then
    case "$ROLE" in
      head|worker) echo "$ROLE" ;;
      *) echo "error: ROLE must be head or worker, got '$ROLE'" >&2; return 2 ;;
    esac
  elif [[ -n "${NODE_RANK:-}" ]]; then
    if [[ "$NODE_RANK" == 0 ]]; then echo head; else echo worker; fi
  elif [[ "$MASTER_ADDR" == 127.0.0.1 || "$MASTER_ADDR" == localhost ]] || bringup_local_ips | grep -qxF "$MASTER_ADDR"; then
    echo head
  else
    echo worker
  fi
}

# The values every node reads (counts, timeouts, RAY_PORT, NODE_RANK, ROLE, DEVICE, LAUNCH_CONSOLE and
# the overlay's VERL_PATCHES_* variables): one checker, verl_patches/launch/cluster_checks.py, for the dry
# run and the real run alike, so both refuse the same values with the same message. Standard library
# only: it runs before the Python environment is checked.
bringup_check_env() {
  NNODES="$NNODES" DEVICES_PER_NODE="$DEVICES_PER_NODE" RAY_PORT="$RAY_PORT" WAIT_TIMEOUT_S="$WAIT_TIMEOUT_S" \
    STOP_GRACE_S="$STOP_GRACE_S" DEVICE="$DEVICE" ROLE="${ROLE:-}" NODE_RANK="${NODE_RANK:-}" \
    LAUNCH_CONSOLE="${LAUNCH_CONSOLE:-full}" LAUNCH_ALLOW_FAULT_INJECTION="${LAUNCH_ALLOW_FAULT_INJECTION:-}" \
    PYTHONPATH="${RECIPE_ROOT}${PYTHONPATH:+:${PYTHONPATH}}" \
    "$PYTHON" -m verl_patches.launch.cluster_checks env
}

# Ray's name for the accelerator: verl asks Ray for "NPU" on Ascend and "GPU" otherwise. On the
# host (DEVICE=cpu) Ray is told the node has DEVICES_PER_NODE "GPU" slots: verl places one worker
# per slot, and each worker runs on the CPU (the CPU platform's patches, verl_patches/rigs/cpu/).
# DEVICE=npu-rehearsal (the NPU rehearsal platform, verl_patches/rigs/npu_rehearsal/: torch_npu's stand-in on the
# host) is the NPU's to verl and Ray: "NPU" slots, trainer.device=npu, one worker per slot, on the CPU.
bringup_resource_name() {
  if [[ "$DEVICE" == npu || "$DEVICE" == npu-rehearsal ]]; then echo NPU; else echo GPU; fi
}

# The trainer.device verl gets: the Ray resource family its worker groups ask for.
bringup_trainer_device() {
  case "$DEVICE" in
    cpu) echo cuda ;;
    npu-rehearsal) echo npu ;;
    *) echo "$DEVICE" ;;
  esac
}

# The platform the overlay's doctor judges (the rehearsal is the NPU's, with its stand-in selected).
bringup_platform() {
  if [[ "$DEVICE" == npu-rehearsal ]]; then echo npu; else echo "$DEVICE"; fi
}

bringup_device_args() {
  if [[ "$DEVICE" == npu || "$DEVICE" == npu-rehearsal ]]; then
    printf '%s\n' --resources "{\"NPU\": ${DEVICES_PER_NODE}}"
  else
    printf '%s\n' --num-gpus "$DEVICES_PER_NODE"
  fi
  if [[ -n "$RAY_NUM_CPUS" ]]; then
    printf '%s\n' --num-cpus "$RAY_NUM_CPUS"
  elif [[ "$DEVICE" == cpu || "$DEVICE" == npu-rehearsal ]]; then
    # Each worker's placement bundle asks for one CPU, the trainer's task runner for one more;
    # Ray would otherwise offer only the cores it counts.
    printf '%s\n' --num-cpus "$((DEVICES_PER_NODE + 2))"
  fi
  local extra
  read -r -a extra <<< "$RAY_EXTRA_ARGS"
  if ((${#extra[@]})); then printf '%s\n' "${extra[@]}"; fi
}

# --block keeps Ray's daemons children of this command, so stopping it stops them.
bringup_ray_head_cmd() {
  RAY_CMD=("$RAY_BIN" start --head --block --node-ip-address="$MASTER_ADDR" --port="$RAY_PORT"
           --temp-dir="$RAY_TEMP_DIR" --include-dashboard=false --disable-usage-stats)
  mapfile -t -O "${#RAY_CMD[@]}" RAY_CMD < <(bringup_device_args)
}

# A worker joins with its own address: the one on the interface that reaches the head (NODE_IP, else
# the address of SOCKET_IFNAME), the address the other nodes reach it at, as VLLM_HOST_IP.
bringup_ray_worker_cmd() {
  RAY_CMD=("$RAY_BIN" start --block --address="${MASTER_ADDR}:${RAY_PORT}" --disable-usage-stats)
  local ip="${NODE_IP:-$(recipe_env_node_ip)}"
  if [[ -n "$ip" ]]; then RAY_CMD+=(--node-ip-address="$ip"); fi
  mapfile -t -O "${#RAY_CMD[@]}" RAY_CMD < <(bringup_device_args)
}

# What the trainer and every Ray worker process read; exported before Ray starts so
# Ray's workers inherit it on every node: PYTHONPATH (the overlay), RAY_ADDRESS (verl's
# ray.init joins this cluster) and the socket interfaces; the tuning variables come from
# recipe_env.sh (recipe_env_apply, run by launch_main).
# A socket interface the user exported (GLOO_, HCCL_, NCCL_SOCKET_IFNAME) wins over SOCKET_IFNAME,
# as everywhere in recipe_env.sh and as the dry run reports it; SOCKET_IFNAME fills only the unset.
bringup_export_env() {
  export PYTHONPATH="${RECIPE_ROOT}${UPSTREAM_ROOT:+:${UPSTREAM_ROOT}}${PYTHONPATH:+:${PYTHONPATH}}"
  bringup_rehearsal_env
  export RAY_ADDRESS="${MASTER_ADDR}:${RAY_PORT}"
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$SOCKET_IFNAME}"
  # Node health (read by Ray's GCS on the head and by every raylet; README, "Node loss"): a node that
  # misses RAY_health_check_failure_threshold checks, one every RAY_health_check_period_ms, each given
  # RAY_health_check_timeout_ms, is dead, and the node watch stops the run; a worker's raylet that
  # cannot reach the head for RAY_gcs_rpc_server_reconnect_timeout_s exits, and its launcher with it.
  # Ray's own defaults; a value in the environment wins.
  export RAY_health_check_period_ms="${RAY_health_check_period_ms:-3000}"
  export RAY_health_check_timeout_ms="${RAY_health_check_timeout_ms:-10000}"
  export RAY_health_check_failure_threshold="${RAY_health_check_failure_threshold:-5}"
  export RAY_gcs_rpc_server_reconnect_timeout_s="${RAY_gcs_rpc_server_reconnect_timeout_s:-60}"
  if [[ "$DEVICE" == npu ]]; then
    export HCCL_SOCKET_IFNAME="${HCCL_SOCKET_IFNAME:-$SOCKET_IFNAME}"
  elif [[ "$DEVICE" == cuda ]]; then
    export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$SOCKET_IFNAME}"
  else
    # No kernel compiler targets the host here: torch.compile would spend about a minute per
    # process compiling megatron-core's fused elementwise functions and gain nothing.
    export TORCHDYNAMO_DISABLE=1
  fi
}

# DEVICE=npu-rehearsal: every process (the checks, the trainer, Ray's workers) imports the stand-in's torch_npu
# before verl, which decides its device once at import; the platform is selected by this variable only
# (verl_patches/rigs/npu_rehearsal/). Idempotent.
bringup_rehearsal_env() {
  [[ "$DEVICE" == npu-rehearsal ]] || return 0
  local site="${RECIPE_ROOT}/verl_patches/rigs/npu_rehearsal/site"
  case ":${PYTHONPATH:-}:" in
    *":${site}:"*) ;;
    *) export PYTHONPATH="${site}${PYTHONPATH:+:${PYTHONPATH}}" ;;
  esac
  export VERL_PATCHES_PLATFORM=npu-rehearsal
  # Generation on the rehearsal is the overlay's CPU stand-in: vLLM's platform is the overlay's plugin, not
  # vLLM-Ascend's (which the stand-in's torch_npu would otherwise activate beside it: vLLM refuses two).
  export VLLM_PLUGINS="${VLLM_PLUGINS:-verl_patches}"
}

bringup_source_cann() {
  [[ "$DEVICE" == npu ]] || return 0
  if [[ ! -f "$CANN_ENV_SCRIPT" ]]; then
    echo "error: CANN environment script not found: CANN_ENV_SCRIPT=$CANN_ENV_SCRIPT" >&2
    return 2
  fi
  # Ascend's set_env.sh scripts read unset variables.
  set +u
  # shellcheck disable=SC1090
  source "$CANN_ENV_SCRIPT"
  if [[ -f "$NNAL_ENV_SCRIPT" ]]; then
    # shellcheck disable=SC1090
    source "$NNAL_ENV_SCRIPT"
  fi
  set -u
}

bringup_print_env() {
  local name
  for name in RECIPE_ROOT UPSTREAM_ROOT DEVICE NNODES DEVICES_PER_NODE MASTER_ADDR RAY_PORT RAY_TEMP_DIR RAY_NUM_CPUS \
              RAY_EXTRA_ARGS SOCKET_IFNAME CANN_ENV_SCRIPT NNAL_ENV_SCRIPT WAIT_TIMEOUT_S LOG_DIR PYTHON RAY_BIN "$@"; do
    printf '  %s=%q\n' "$name" "${!name-}"
  done
}

# Start a command in its own session: its PID is its process group, so teardown can
# reach every process it spawned (and nothing else).
bringup_spawn() {
  local log="$1"; shift
  mkdir -p "$(dirname "$log")"
  # procs exec: the command gets SIGTERM if this shell dies without running its traps (SIGKILL).
  setsid "$PYTHON" -m verl_patches.launch.procs exec -- "$@" >"$log" 2>&1 < /dev/null &
  BRINGUP_PIDS+=("$!")
}

bringup_start_head() {
  bringup_ray_head_cmd
  echo "starting Ray head: ${RAY_CMD[*]}"
  bringup_spawn "${LOG_DIR}/ray_head.log" "${RAY_CMD[@]}"
  BRINGUP_HEAD_PID="${BRINGUP_PIDS[-1]}"
}

# Head only: whether the Ray head this script started still runs; if not, say so with its log's tail.
bringup_head_alive() {
  local what="$1"
  bringup_alive "${BRINGUP_HEAD_PID:?bringup_start_head first}" && return 0
  echo "error: the Ray head (pid ${BRINGUP_HEAD_PID}) exited ${what}; ${LOG_DIR}/ray_head.log ends with:" >&2
  tail -n "${LAUNCH_TAIL_LINES:-20}" "${LOG_DIR}/ray_head.log" 2>/dev/null | sed 's/^/  | /' >&2 || true
  return 3
}

bringup_wait_port() {
  local deadline=$((SECONDS + WAIT_TIMEOUT_S))
  until (exec 3<>"/dev/tcp/${MASTER_ADDR}/${RAY_PORT}") 2>/dev/null; do
    if ((SECONDS > deadline)); then
      echo "error: Ray head ${MASTER_ADDR}:${RAY_PORT} not reachable after ${WAIT_TIMEOUT_S} s" >&2
      return 3
    fi
    sleep 2
  done
}

# Worker only: what the head's RAY_PORT says to a connection, within 3 s: up (accepted), refused (its
# host answers, its Ray stopped) or silent (no answer, no route: a partition, or a head too busy).
bringup_head_state() {
  local said
  # shellcheck disable=SC2016  # $1 and $2 are the inner bash's arguments, expanded there
  if said="$(timeout 3 env LC_ALL=C bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$MASTER_ADDR" "$RAY_PORT" 2>&1)"; then
    echo up
  elif [[ "$said" == *"Connection refused"* ]]; then
    echo refused
  else
    echo silent
  fi
}

bringup_start_worker() {
  bringup_wait_port || return $?
  bringup_ray_worker_cmd
  echo "starting Ray worker: ${RAY_CMD[*]}"
  bringup_spawn "${LOG_DIR}/ray_worker_$(hostname 2>/dev/null || echo node).log" "${RAY_CMD[@]}"
}

# Head only: the head's port accepts connections, or the head's process is gone (its log's tail is
# shown) or the wait times out; Ray's own client would retry a dead head for minutes.
bringup_wait_head() {
  local deadline=$((SECONDS + WAIT_TIMEOUT_S))
  until (exec 3<>"/dev/tcp/${MASTER_ADDR}/${RAY_PORT}") 2>/dev/null; do
    bringup_head_alive "before it listened on ${MASTER_ADDR}:${RAY_PORT}" || return 3
    if ((SECONDS > deadline)); then
      echo "error: the Ray head did not listen on ${MASTER_ADDR}:${RAY_PORT} within ${WAIT_TIMEOUT_S} s (${LOG_DIR}/ray_head.log)" >&2
      return 3
    fi
    sleep 1
  done
}

# Head only: all NNODES x DEVICES_PER_NODE devices registered, or a clear timeout, or at once the
# head's exit with its log (a busy RAY_PORT: the port answers, but not our Ray).
bringup_wait_devices() {
  bringup_wait_head || return $?
  local expected=$((NNODES * DEVICES_PER_NODE))
  echo "waiting up to ${WAIT_TIMEOUT_S} s for ${NNODES} node(s) x ${DEVICES_PER_NODE} $(bringup_resource_name) = ${expected}"
  # In the background and waited for, so that a signal to this shell is handled at once (a
  # foreground child would defer the traps until it exits) and teardown can stop it.
  "$PYTHON" "${RECIPE_ROOT}/scripts/cluster/wait_for_devices.py" --address "${MASTER_ADDR}:${RAY_PORT}" \
    --resource "$(bringup_resource_name)" --expected "$expected" --nodes "$NNODES" --timeout "$WAIT_TIMEOUT_S" \
    --head-pid "$BRINGUP_HEAD_PID" --head-log "${LOG_DIR}/ray_head.log" &
  BRINGUP_PIDS+=("$!")
  wait "$!"
}

bringup_alive() {
  kill -0 "$1" 2>/dev/null
}

# Head only, once the trainer runs: the node watch in the background (BRINGUP_WATCH_PID; it is stopped
# with the rest). It exits 4 with a line naming the node and the step when a node that joined is lost.
bringup_start_node_watch() {
  local trainer_log="$1"
  "$PYTHON" -m verl_patches.launch.node_watch --address "${MASTER_ADDR}:${RAY_PORT}" --nodes "$NNODES" \
    --log "$trainer_log" >"${LOG_DIR}/node_watch.log" 2>&1 </dev/null &
  # shellcheck disable=SC2034  # read by scripts/cluster/launch.sh, which sources this file
  BRINGUP_WATCH_PID="$!"
  BRINGUP_PIDS+=("$!")
}

# The seconds Ray takes to call a silent node dead (its health checks), plus two reads of the node table.
bringup_node_loss_bound_s() {
  echo $(( (RAY_health_check_failure_threshold * (RAY_health_check_period_ms + RAY_health_check_timeout_ms)) / 1000 + 4 ))
}

# Head only, after the trainer failed on a multi-node run: whether the node watch reports a lost node,
# given NODE_LOSS_GRACE_S (default: the health checks' bound) to see it. A trainer often fails first: its
# collectives to a node whose processes died fail at once ("Connection reset by peer"), while Ray calls
# the node dead only after its missed health checks.
bringup_node_watch_sees_loss() {
  local pid="$1" waited=0 grace="${NODE_LOSS_GRACE_S:-$(bringup_node_loss_bound_s)}"
  ((NNODES > 1)) || return 1
  echo "the trainer failed: checking for up to ${grace} s whether a node was lost (${LOG_DIR}/node_watch.log)"
  while bringup_alive "$pid" && ((waited < grace * 10)); do
    sleep 0.1
    waited=$((waited + 1))
  done
  grep -q '^error: node ' "${LOG_DIR}/node_watch.log" 2>/dev/null
}

bringup_group_alive() {
  kill -0 -- "-$1" 2>/dev/null
}

# TERM what we started, give it STOP_GRACE_S, then its process group (ours by setsid).
bringup_stop() {
  local pid waited
  ((${#BRINGUP_PIDS[@]})) || return 0
  for pid in "${BRINGUP_PIDS[@]}"; do
    bringup_alive "$pid" && kill -TERM "$pid" 2>/dev/null
  done
  for pid in "${BRINGUP_PIDS[@]}"; do
    waited=0
    while bringup_group_alive "$pid" && ((waited < STOP_GRACE_S * 10)); do
      sleep 0.1
      waited=$((waited + 1))
      # Ray's reaper takes the group down once --block exits; nudge it half-way.
      if ((waited == STOP_GRACE_S * 5)); then kill -TERM -- "-$pid" 2>/dev/null || true; fi
    done
    if bringup_group_alive "$pid"; then
      echo "process group $pid still alive after ${STOP_GRACE_S} s: SIGKILL" >&2
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  BRINGUP_PIDS=()
}
