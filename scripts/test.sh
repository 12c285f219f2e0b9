#!/usr/bin/env bash
# The project's test command (README.md and .ci/run call exactly this): build or reuse the
# CPU test environment from the lock, then run the whole test suite against the real
# upstream packages. Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/core`).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export VENV=${VENV:-$ROOT/.venv}

bash "$ROOT/scripts/setup_test_env.sh"
# The shell scripts are linted by the tests (tests/recipe/test_docker.py); shellcheck comes
# from the system's packages, hadolint from the test requirements (in the venv's bin).
if ! command -v shellcheck >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq shellcheck >/dev/null
  else
    echo "scripts/test.sh: shellcheck is missing; install it (e.g. apt-get install shellcheck)" >&2
    exit 2
  fi
fi
cd "$ROOT"
export PATH="$VENV/bin:$PATH" REQUIRE_LINTERS=1
export VLLM_PLUGINS=${VLLM_PLUGINS:-verl_patches} RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
exec "$VENV/bin/python" -m pytest -q --timeout=900 "$@"
