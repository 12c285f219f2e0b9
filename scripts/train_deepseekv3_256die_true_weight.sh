#!/usr/bin/env bash
# DeepSeek-V3 671B GRPO on 256 dies from real weights: a Megatron distributed checkpoint
# (DIST_CKPT_PATH, made by python -m verl_patches.tools.hf_to_mcore). Run on every node;
# --dry-run prints and validates everything without starting anything.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/cluster/bringup.sh
source "${HERE}/cluster/bringup.sh"
# shellcheck source=scripts/cluster/launch.sh
source "${HERE}/cluster/launch.sh"

# shellcheck disable=SC2034  # read by launch_usage / launch_main in cluster/launch.sh
LAUNCH_EXTRA_USAGE="DIST_CKPT_PATH (required): Megatron distributed checkpoint directory, on storage every node sees"
# shellcheck disable=SC2034
LAUNCH_EXTRA_VARS=(DIST_CKPT_PATH)

# Called by launch_main before anything is printed or started.
launch_run_hook() {
  if [[ -z "${DIST_CKPT_PATH:-}" ]]; then
    echo "error: DIST_CKPT_PATH is not set: the real-weight run needs the Megatron distributed checkpoint" \
         "directory (convert with: python -m verl_patches.tools.hf_to_mcore --help)" >&2
    return 2
  fi
  if [[ ! -d "$DIST_CKPT_PATH" ]]; then
    echo "error: DIST_CKPT_PATH=$DIST_CKPT_PATH is not a directory" >&2
    return 2
  fi
  if [[ -z "$(ls -A "$DIST_CKPT_PATH")" ]]; then
    echo "error: DIST_CKPT_PATH=$DIST_CKPT_PATH is empty (conversion not run or not finished?)" >&2
    return 2
  fi
  # shellcheck disable=SC2034  # appended to the trainer command by launch_build_trainer_cmd
  LAUNCH_RUN_OVERRIDES=("actor_rollout_ref.actor.megatron.dist_checkpointing_path=${DIST_CKPT_PATH}")
  # shellcheck disable=SC2034  # checked (complete, and of the model of MODEL_PATH) by launch_check_head
  LAUNCH_CKPT_DIR="$DIST_CKPT_PATH"
}

# RECIPE_CONFIG: another run config of this kind (the 128-GPU launcher sets it).
launch_main "${RECIPE_CONFIG:-deepseekv3_256die_true_weight}" "$@"
