#!/usr/bin/env bash
# A multi-node rehearsal on one machine (root: it makes network namespaces): the tiny run's launcher,
# scripts/train_tiny.sh, in one network namespace per node, as a user runs it on each node of a
# cluster (MASTER_ADDR, NODE_RANK, NNODES, DEVICES_PER_NODE), the 4 workers spread over the nodes.
#
#   sudo bash scripts/rehearse_multinode.sh OUT trainer.total_training_steps=2
#   sudo bash scripts/rehearse_multinode.sh OUT --fault kill-ray     # the last node's Ray killed in step 1
#   sudo bash scripts/rehearse_multinode.sh OUT --fault partition    # the last node's link down in step 1
#   # a checkpoint every 2 steps in OUT/checkpoints, the node lost in step 3; then the same command without
#   # the fault resumes from the last whole checkpoint and finishes:
#   sudo bash scripts/rehearse_multinode.sh OUT --fault kill-ray --fault-step 3 trainer.total_training_steps=3 trainer.save_freq=2
#   sudo bash scripts/rehearse_multinode.sh OUT trainer.total_training_steps=3 trainer.save_freq=2
#
# Options and outputs: python -m verl_patches.launch.netns_cluster --help (verl_patches/launch/netns_cluster.py).
# The namespaces, their links and addresses exist only while it runs; it removes them on any exit.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  echo "usage: bash scripts/rehearse_multinode.sh OUT [--nodes N] [--fault kill-ray|partition] [HYDRA_OVERRIDE ...]   (as root)"
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi
export VENV="${VENV:-$ROOT/.venv}"
# The environment once, for every node (each node's train_tiny.sh runs with SETUP_TEST_ENV=0).
if [[ "${SETUP_TEST_ENV:-1}" != 0 ]]; then bash "$ROOT/scripts/setup_test_env.sh"; fi
cd "$ROOT"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$VENV/bin/python" -m verl_patches.launch.netns_cluster "$@"
