#!/usr/bin/env bash
# DeepSeek-V3 671B GRPO on 16 nodes x 8 NVIDIA GPUs (H200), real weights from a Megatron distributed checkpoint (DIST_CKPT_PATH) in the 128-GPU layout.
# The 256-die launcher with the 128-GPU run config and CUDA defaults (docs/NVIDIA.md); run on every node,
# --dry-run prints and validates everything without starting anything.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export DEVICE="${DEVICE:-cuda}" DEVICES_PER_NODE="${DEVICES_PER_NODE:-8}"
export RECIPE_CONFIG="${RECIPE_CONFIG:-deepseekv3_128gpu_true_weight}"
exec bash "$HERE/train_deepseekv3_256die_true_weight.sh" "$@"
