#!/usr/bin/env bash
# DeepSeek-V3 671B GRPO on 256 dies, random-init weights (peak-throughput run, fixed 3K responses).
# Run on every node: the head (MASTER_ADDR) starts Ray and the trainer, the others join.
# --dry-run prints and validates everything without starting anything.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/cluster/bringup.sh
source "${HERE}/cluster/bringup.sh"
# shellcheck source=scripts/cluster/launch.sh
source "${HERE}/cluster/launch.sh"

# RECIPE_CONFIG: another run config of this kind (the 128-GPU launcher sets it).
launch_main "${RECIPE_CONFIG:-deepseekv3_256die_random_init}" "$@"
