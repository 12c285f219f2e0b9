#!/usr/bin/env bash
# The main job on a fresh machine: build (or reuse) the environment, then rehearse whole
# train/rollout switches of a tiny DeepSeek-V3 on 8 local CPU processes with all three
# reshard methods, checking every rollout byte and the logits. Arguments go to the
# preflight command, e.g.:
#   bash scripts/preflight.sh --backend nccl --nproc 2          # two local GPUs
#   bash scripts/preflight.sh --json out/preflight.json --dump out/shards
# On the cluster, launch `python -m verl_patches preflight` with torchrun instead (one
# process per die); see docs/PREFLIGHT.md.
set -euo pipefail

# Before anything else: the environment build below can take many minutes.
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  cat <<'USAGE'
usage: bash scripts/preflight.sh [PREFLIGHT_ARG ...]

Build or reuse the test environment (VENV, default ./.venv), then run `python -m verl_patches
preflight` with the arguments: whole train/rollout switches of a tiny DeepSeek-V3 on local processes
with all three reshard methods, checking every rollout byte and the logits. E.g.
  bash scripts/preflight.sh --backend nccl --nproc 2
  bash scripts/preflight.sh --json out/preflight.json --dump out/shards
The preflight command's own options: $VENV/bin/python -m verl_patches preflight --help
(docs/PREFLIGHT.md).
USAGE
  exit 0
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export VENV=${VENV:-$ROOT/.venv}
bash "$ROOT/scripts/setup_test_env.sh"
cd "$ROOT"
export VLLM_PLUGINS=${VLLM_PLUGINS:-verl_patches} PYTHONUNBUFFERED=1
exec "$VENV/bin/python" -m verl_patches preflight "$@"
