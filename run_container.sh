#!/usr/bin/env bash
# Start (or re-enter) the recipe container on one node and open a shell in it; run it on every node.
#   bash run_container.sh [--dry-run] [NAME [IMAGE]] [-- COMMAND ...]
# NAME (default recipe-dsv3-grpo) is the container's name, as in the reference's
# `bash run_container.sh your_docker_name`; IMAGE defaults to recipe-dsv3-grpo:latest (docker/build.sh).
# A container NAME that does not exist is created detached (all NPU devices, the host driver read-only,
# large shared memory, host network for Ray / HCCL) and kept running; one that exists is started if
# stopped and reused. Then COMMAND (default: bash) runs in it interactively.
# --dry-run prints what it would do and the docker commands, and runs nothing that changes anything.
set -euo pipefail

IMAGE="${IMAGE:-recipe-dsv3-grpo:latest}"
NAME="${NAME:-recipe-dsv3-grpo}"
DEVICE="${DEVICE:-npu}"                         # npu | cuda
DOCKER="${DOCKER:-docker}"
# torch DataLoader workers and Ray's object store live in /dev/shm.
SHM_SIZE="${SHM_SIZE:-512g}"
DEV_ROOT="${DEV_ROOT:-/dev}"                    # where the device nodes are (tests point it elsewhere)
ASCEND_DRIVER_DIR="${ASCEND_DRIVER_DIR:-/usr/local/Ascend/driver}"
# Host paths to mount at the same path, separated by spaces (models, data, checkpoints).
MOUNTS="${MOUNTS:-${HOME}/models ${HOME}/data}"
WORKDIR="${WORKDIR:-/opt/recipe}"

usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  echo "env: IMAGE NAME DEVICE SHM_SIZE DEV_ROOT ASCEND_DRIVER_DIR MOUNTS WORKDIR DOCKER"
}

dry=0
positional=()
command=(bash)
while (($#)); do
  case "$1" in
    --dry-run) dry=1 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; command=("$@"); ((${#command[@]})) || command=(bash); break ;;
    -*) echo "error: unknown option $1 (the container's command goes after --)" >&2; usage >&2; exit 2 ;;
    *) positional+=("$1") ;;
  esac
  shift
done
if ((${#positional[@]} > 2)); then
  echo "error: at most NAME and IMAGE before --, got: ${positional[*]} (the container's command goes after --)" >&2
  exit 2
fi
if ((${#positional[@]} >= 1)); then NAME="${positional[0]}"; fi
if ((${#positional[@]} == 2)); then IMAGE="${positional[1]}"; fi
if ! [[ "$NAME" =~ ^[a-zA-Z0-9][a-zA-Z0-9_.-]*$ ]]; then
  echo "error: '$NAME' is not a valid container name (letters, digits, _ . -)" >&2
  exit 2
fi

RUN=("$DOCKER" run -d -it --name "$NAME" --network host --shm-size "$SHM_SIZE" -w "$WORKDIR")
case "$DEVICE" in
  npu)
    shopt -s nullglob
    cards=("$DEV_ROOT"/davinci[0-9]*)
    shopt -u nullglob
    if ((${#cards[@]} == 0)); then
      echo "error: no NPU device nodes ${DEV_ROOT}/davinci<N> on this host (is the Ascend driver installed?)" >&2
      exit 2
    fi
    for d in "${cards[@]}"; do RUN+=(--device "$d"); done
    # Management devices every NPU process opens.
    for d in davinci_manager devmm_svm hisi_hdc; do
      if [[ ! -e "$DEV_ROOT/$d" ]]; then
        echo "error: ${DEV_ROOT}/$d missing: the Ascend driver is not loaded" >&2
        exit 2
      fi
      RUN+=(--device "$DEV_ROOT/$d")
    done
    # The driver stays on the host (it must match the kernel module); CANN is in the image.
    RUN+=(-v "${ASCEND_DRIVER_DIR}:${ASCEND_DRIVER_DIR}:ro")
    for f in /usr/local/dcmi /usr/local/bin/npu-smi /etc/ascend_install.info /etc/hccn.conf; do
      if [[ -e "$f" ]]; then RUN+=(-v "$f:$f:ro"); fi
    done
    ;;
  cuda) RUN+=(--gpus all) ;;
  *) echo "error: DEVICE must be npu or cuda, got '$DEVICE'" >&2; exit 2 ;;
esac
read -r -a mounts <<< "$MOUNTS"
for m in "${mounts[@]}"; do
  if [[ -e "$m" ]]; then
    RUN+=(-v "$m:$m")
  else
    echo "note: mount source $m does not exist; skipped" >&2
  fi
done
# A shell with a terminal keeps the detached container alive between sessions.
RUN+=("$IMAGE" /bin/bash)
EXEC=("$DOCKER" exec -it "$NAME" "${command[@]}")

# running | stopped | absent (also when docker cannot be asked, which --dry-run reports).
state="absent"
if command -v "$DOCKER" >/dev/null 2>&1; then
  if running="$("$DOCKER" container inspect -f '{{.State.Running}}' "$NAME" 2>/dev/null)"; then
    if [[ "$running" == true ]]; then state=running; else state=stopped; fi
  fi
elif ((dry == 0)); then
  echo "error: $DOCKER not found" >&2
  exit 2
else
  echo "note: $DOCKER not found here; assuming no container '$NAME' exists" >&2
fi

case "$state" in
  absent) plan="not found: create it from $IMAGE (detached), then run '${command[*]}' in it" ;;
  stopped) plan="exists, stopped: start it, then run '${command[*]}' in it" ;;
  running) plan="running: run '${command[*]}' in it" ;;
esac
echo "run_container.sh: container '$NAME' on this node $plan" >&2

step() {
  if ((dry)); then
    printf '%q ' "$@"
    printf '\n'
  else
    "$@" >/dev/null
  fi
}
case "$state" in
  absent) step "${RUN[@]}" ;;
  stopped) step "$DOCKER" start "$NAME" ;;
esac
if ((dry)); then
  printf '%q ' "${EXEC[@]}"
  printf '\n'
  exit 0
fi
exec "${EXEC[@]}"
