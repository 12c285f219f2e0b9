#!/usr/bin/env bash
# Build the CPU test environment: the real pinned upstream stack (configs/upstream.lock.toml)
# in a virtualenv, importable without an accelerator (see the project's UPSTREAM_ON_CPU notes).
#
#   bash scripts/setup_test_env.sh            # creates ./.venv (VENV=... to choose)
#
# Idempotent: a venv whose stamp matches the lock and requirements is reused as is.
set -euo pipefail

if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  echo "usage: bash scripts/setup_test_env.sh     (VENV=DIR to choose the venv; PYTHON=python3.11)"
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3.11}
CACHE=${VERL_PATCHES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/verl_patches}
LOCK=$ROOT/configs/upstream.lock.toml

log() { printf '[setup_test_env] %s\n' "$*" >&2; }

command -v "$PYTHON" >/dev/null || { log "error: $PYTHON not found (the recipe targets Python 3.11; set PYTHON=...)"; exit 2; }

# MindSpeed's source (release archive, git tag, or skipped) is part of the stamp: an archive that
# appears later, or a tag that becomes reachable, rebuilds the venv with it.
MINDSPEED_SOURCE=$(bash "$ROOT/scripts/install_mindspeed.sh" --print "$PYTHON")
stamp_of() {
  { cat "$LOCK" "$ROOT/requirements.txt" "$ROOT/requirements-test.txt" "${BASH_SOURCE[0]}" \
        "$ROOT/scripts/install_mindspeed.sh"; echo "$MINDSPEED_SOURCE"; } | sha256sum | cut -c1-16
}
STAMP=$(stamp_of)
if [ -f "$VENV/.verl_patches_stamp" ] && [ "$(cat "$VENV/.verl_patches_stamp")" = "$STAMP" ]; then
  log "reusing $VENV (stamp $STAMP)"
  exit 0
fi

# Only a virtualenv this script made (its marker, or the stamp of a finished build) is ever
# removed: VENV may point at any directory, and anything else there is not ours to delete.
MARKER=.verl_patches_venv
if [ -e "$VENV" ] || [ -L "$VENV" ]; then
  if [ -d "$VENV" ] && [ ! -L "$VENV" ] && { [ -f "$VENV/$MARKER" ] || [ -f "$VENV/.verl_patches_stamp" ]; }; then
    log "rebuilding $VENV (made by this script; its stamp is out of date)"
    rm -rf "$VENV"
  elif [ -d "$VENV" ] && [ ! -L "$VENV" ] && [ -z "$(ls -A "$VENV")" ]; then
    rmdir "$VENV"
  elif [ -L "$VENV" ]; then
    log "error: VENV=$VENV is a symbolic link (to $(readlink "$VENV")) and its stamp does not match this checkout's lock and requirements: refusing to rebuild through a link; point VENV at the real directory, or remove the link"
    exit 2
  else
    log "error: VENV=$VENV exists and was not made by this script (no $MARKER in it): refusing to delete or reuse it; choose a new path or remove it yourself"
    exit 2
  fi
fi

# Versions come from the lock, never from this script.
lockv() { "$PYTHON" - "$LOCK" "$1" "${2:-version}" <<'EOF'
import sys, tomllib
print(tomllib.load(open(sys.argv[1], "rb"))["components"][sys.argv[2]][sys.argv[3]])
EOF
}
TORCH_V=$(lockv torch); VLLM_V=$(lockv vllm); VERL_V=$(lockv verl)
MCORE_V=$(lockv megatron_core); VASC_V=$(lockv vllm_ascend); TF_V=$(lockv transformers)
RAY_V=$(lockv ray); HYDRA_V=$(lockv hydra_core)

log "creating $VENV with $("$PYTHON" --version)"
"$PYTHON" -m venv "$VENV"
echo "made by scripts/setup_test_env.sh; safe for it to delete and rebuild" > "$VENV/$MARKER"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# pip warns once per package about configured local mirror folders it cannot use; keep the log readable.
pipq() { "${PIP[@]}" "$@" 2> >(grep -v -e "^WARNING: Location '" -e "does not provide the extra" >&2); }
export PIP_PROGRESS_BAR=off

# 1. torch first (the registry's build runs on a CPU; it mirrors the cluster's 2.5.1),
#    and the build tools vLLM's sdist needs without build isolation.
#    setuptools<81 because verl imports pkg_resources; >=77 for vLLM's pyproject license field.
log "torch==$TORCH_V and build tools"
pipq install -q "torch==$TORCH_V" "setuptools>=77,<81" "setuptools-scm>=8" wheel packaging jinja2

# 2. vLLM as pure Python (VLLM_TARGET_DEVICE=empty, as vLLM-Ascend installs it). Its built
#    version is $VLLM_V+empty, which pip refuses for a plain requirement, so the sdist is
#    fetched by the address pip's own configured index gives, then installed from the file.
mkdir -p "$CACHE"
SDIST=$CACHE/vllm-$VLLM_V.tar.gz
if [ ! -s "$SDIST" ]; then
  log "fetching the vllm $VLLM_V sdist through pip's configured index"
  "$VENV/bin/python" "$ROOT/scripts/fetch_sdist.py" vllm "$VLLM_V" "$SDIST" "$(lockv vllm sdist_sha256)"
fi

log "vllm $VLLM_V (empty target) + verl $VERL_V + the rest of the lock + test tools"
VLLM_TARGET_DEVICE=empty pipq install -q --no-build-isolation "$SDIST" \
  "verl==$VERL_V" "transformers==$TF_V" "ray[default]==$RAY_V" "hydra-core==$HYDRA_V" \
  "torch==$TORCH_V" "numba==0.61.2" \
  -r "$ROOT/requirements.txt" -r "$ROOT/requirements-test.txt"

# 3. Packages whose declared dependencies must not come in: megatron-core (would pull
#    nvidia-modelopt and friends) and vLLM-Ascend (torch-npu, which breaks `import torch`
#    off Ascend).
log "megatron-core $MCORE_V and vllm-ascend $VASC_V without dependencies"
pipq install -q --no-deps "megatron-core==$MCORE_V" "vllm-ascend==$VASC_V"

# 3b. MindSpeed at the lock's release, without dependencies (no registry carries it): from the
#     release archive (VERL_PATCHES_UPSTREAM_DIR, else upstream/ in or beside the checkout), else the git tag, else skipped
#     with a note. Its argument and feature modules import on CPU; its NPU kernels are never loaded.
log "mindspeed: $MINDSPEED_SOURCE"
bash "$ROOT/scripts/install_mindspeed.sh" "$VENV/bin/python"

# 4. The overlay itself, editable, so its vLLM plugin entry point is registered.
pipq install -q --no-deps --no-build-isolation -e "$ROOT"

echo "$STAMP" > "$VENV/.verl_patches_stamp"
log "done: $VENV"
