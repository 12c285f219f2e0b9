#!/usr/bin/env bash
# The project's test command (README.md and .ci/run call exactly this): build or reuse the
# CPU test environment from the lock, then run the whole test suite against the real
# upstream packages. Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/core`).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export VENV=${VENV:-$ROOT/.venv}

bash "$ROOT/scripts/setup_test_env.sh"
cd "$ROOT"
export VLLM_PLUGINS=${VLLM_PLUGINS:-verl_patches} RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
exec "$VENV/bin/python" -m pytest -q --timeout=900 "$@"
