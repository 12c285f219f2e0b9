#!/usr/bin/env bash
# Start the recipe container on one A3 node (run it on every node): all NPU devices,
# the host driver mounted read-only, large shared memory, host network (Ray/HCCL).
# Values come from the environment; --dry-run prints the docker command only.
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

dry=0
args=()
while (($#)); do
  case "$1" in
    --dry-run) dry=1 ;;
    -h|--help)
      sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'
      echo "env: IMAGE NAME DEVICE SHM_SIZE DEV_ROOT ASCEND_DRIVER_DIR MOUNTS WORKDIR DOCKER; extra args go to the container command"
      exit 0 ;;
    *) args+=("$1") ;;
  esac
  shift
done

CMD=("$DOCKER" run -it --rm --name "$NAME" --network host --shm-size "$SHM_SIZE" -w "$WORKDIR")

case "$DEVICE" in
  npu)
    shopt -s nullglob
    cards=("$DEV_ROOT"/davinci[0-9]*)
    shopt -u nullglob
    if ((${#cards[@]} == 0)); then
      echo "error: no NPU device nodes ${DEV_ROOT}/davinci<N> on this host (is the Ascend driver installed?)" >&2
      exit 2
    fi
    for d in "${cards[@]}"; do CMD+=(--device "$d"); done
    # Management devices every NPU process opens.
    for d in davinci_manager devmm_svm hisi_hdc; do
      if [[ ! -e "$DEV_ROOT/$d" ]]; then
        echo "error: ${DEV_ROOT}/$d missing: the Ascend driver is not loaded" >&2
        exit 2
      fi
      CMD+=(--device "$DEV_ROOT/$d")
    done
    # The driver stays on the host (it must match the kernel module); CANN is in the image.
    CMD+=(-v "${ASCEND_DRIVER_DIR}:${ASCEND_DRIVER_DIR}:ro")
    for f in /usr/local/dcmi /usr/local/bin/npu-smi /etc/ascend_install.info /etc/hccn.conf; do
      if [[ -e "$f" ]]; then CMD+=(-v "$f:$f:ro"); fi
    done
    ;;
  cuda) CMD+=(--gpus all) ;;
  *) echo "error: DEVICE must be npu or cuda, got '$DEVICE'" >&2; exit 2 ;;
esac

read -r -a mounts <<< "$MOUNTS"
for m in "${mounts[@]}"; do
  if [[ -e "$m" ]]; then
    CMD+=(-v "$m:$m")
  else
    echo "note: mount source $m does not exist; skipped" >&2
  fi
done
CMD+=("$IMAGE" "${args[@]}")

if ((dry)); then
  printf '%q ' "${CMD[@]}"
  printf '\n'
  exit 0
fi
exec "${CMD[@]}"
