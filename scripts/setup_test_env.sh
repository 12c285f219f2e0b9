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

# One build per venv at a time: a second run for the same VENV waits for the first (then reuses what it
# built), for at most VERL_PATCHES_VENV_LOCK_WAIT_S seconds (default 1800), and is refused by name after
# that. The lock is a file beside the venv, held (flock) for this script's lifetime; it is never deleted
# (deleting it would let a third run take a fresh lock beside a build in progress).
LOCK_WAIT=${VERL_PATCHES_VENV_LOCK_WAIT_S:-1800}
if ! [[ "$LOCK_WAIT" =~ ^[0-9]+$ ]] || ((LOCK_WAIT < 1)); then
  log "error: VERL_PATCHES_VENV_LOCK_WAIT_S='$LOCK_WAIT': expected a whole number of seconds of at least 1"; exit 2
fi
command -v flock >/dev/null || { log "error: flock (util-linux) not found: it serialises builds of one venv; install util-linux"; exit 2; }
MARKER=.verl_patches_venv
foreign_venv() {  # VENV holds something this script did not make (a file, or a directory without its marks)
  { [ -e "$VENV" ] && [ ! -L "$VENV" ]; } && ! { [ -d "$VENV" ] && { [ -f "$VENV/$MARKER" ] ||
    [ -f "$VENV/.verl_patches_stamp" ] || [ -z "$(ls -A "$VENV")" ]; }; }
}
refuse_foreign() {
  log "error: VENV=$VENV exists and was not made by this script (no $MARKER in it): refusing to delete or reuse it; choose a new path or remove it yourself"
  exit 2
}
VENV_LOCK="$VENV.build.lock"
# A path that is not ours is refused before the lock is made beside it: a refusal writes nothing. (With a lock
# already there, a build of ours may be between creating the venv and marking it: decided under the lock.)
if [ ! -e "$VENV_LOCK" ] && foreign_venv; then refuse_foreign; fi
VENV_PARENT=$(dirname "$VENV")
mkdir -p "$VENV_PARENT"
exec 9>>"$VENV_LOCK"
if ! flock -n 9; then
  log "waiting for another build of $VENV to finish (lock $VENV_LOCK; up to ${LOCK_WAIT} s)"
  flock -w "$LOCK_WAIT" 9 || { log "error: another build of $VENV still holds $VENV_LOCK after ${LOCK_WAIT} s; wait for it to finish (or stop it), then run this again"; exit 2; }
fi

command -v "$PYTHON" >/dev/null || { log "error: $PYTHON not found (the recipe targets Python 3.11; set PYTHON=...)"; exit 2; }

# pyproject.toml is part of the stamp (its entry points name the vLLM plugins: a module that moves
# must be reinstalled, or vLLM loads no plugin). The source-only components' sources (MindSpeed,
# Megatron-LM's training package, MindSpeed-LLM: release archive, git tag, or skipped) are too: an
# archive that appears later, or a tag that becomes reachable, rebuilds the venv with it.
UPSTREAM_SOURCES=$(bash "$ROOT/scripts/install_upstream_sources.sh" --print "$PYTHON")
stamp_of() {
  { cat "$LOCK" "$ROOT/requirements.txt" "$ROOT/requirements-test.txt" "${BASH_SOURCE[0]}" \
        "$ROOT/scripts/install_upstream_sources.sh" "$ROOT/verl_patches/core/sources.py" "$ROOT/pyproject.toml"
    echo "$UPSTREAM_SOURCES"; } | sha256sum | cut -c1-16
}
STAMP=$(stamp_of)
if [ -f "$VENV/.verl_patches_stamp" ] && [ "$(cat "$VENV/.verl_patches_stamp")" = "$STAMP" ]; then
  log "reusing $VENV (stamp $STAMP)"
  exit 0
fi

# Only a virtualenv this script made (its marker, or the stamp of a finished build) is ever
# removed: VENV may point at any directory, and anything else there is not ours to delete.
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
    refuse_foreign
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

# The installs run through uv (pinned in requirements-test.txt, itself installed by pip): it downloads
# and unpacks in parallel, several times faster than pip on the 2-core CI machine (torch 2.5.1 with its
# CUDA libraries: 26 s against pip's 103 s). It is handed pip's own configuration (indexes, find-links,
# constraints, certificate: `pip config list`, PIP_* variables included), so it resolves where pip
# would, and it searches every index for the best match as pip does. Bytecode is compiled at install,
# as pip does: where PYTHONDONTWRITEBYTECODE is set, every import would otherwise compile from source.
pipq install -q "$(grep -E '^uv==' "$ROOT/requirements-test.txt")"
mapfile -t UV_ARGS < <("$VENV/bin/python" - <<'EOF'
import ast, os, subprocess, sys
listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
conf = {}  # pip lists global, then user, then site, then the environment: the later value wins
for line in listing.splitlines():
    key, sep, value = line.partition("=")
    if sep:
        conf[key.rsplit(".", 1)[-1]] = ast.literal_eval(value)
for name, flag in (("index-url", "--index-url"), ("extra-index-url", "--extra-index-url"),
                   ("find-links", "--find-links"), ("constraint", "--constraint")):
    for value in conf.get(name, "").split():
        if name != "constraint" or os.path.exists(value):
            print(flag)
            print(value)
if conf.get("cert"):
    print("SSL_CERT_FILE=" + conf["cert"])
EOF
)
UV_ENV=()
if ((${#UV_ARGS[@]})) && [[ "${UV_ARGS[-1]}" == SSL_CERT_FILE=* ]]; then
  UV_ENV=("${UV_ARGS[-1]}"); unset 'UV_ARGS[-1]'
fi
uvq() { env "${UV_ENV[@]}" "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --compile-bytecode \
          --index-strategy unsafe-best-match "${UV_ARGS[@]}" "$@"; }

# 1. torch first (the registry's build runs on a CPU; it mirrors the cluster's 2.5.1),
#    and the build tools vLLM's sdist needs without build isolation.
#    setuptools<81 because verl imports pkg_resources; >=77 for vLLM's pyproject license field.
log "torch==$TORCH_V and build tools"
uvq "torch==$TORCH_V" "setuptools>=77,<81" "setuptools-scm>=8" wheel packaging jinja2

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
# pip builds the wheel (its requirements are the empty target's, computed by setup.py at build time;
# uv would read the sdist's static metadata instead, written for CUDA, which pins another torch).
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
VLLM_TARGET_DEVICE=empty pipq wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$SDIST"
uvq "$WHEELS"/vllm-*.whl \
  "verl==$VERL_V" "transformers==$TF_V" "ray[default]==$RAY_V" "hydra-core==$HYDRA_V" \
  "torch==$TORCH_V" "numba==0.61.2" \
  -r "$ROOT/requirements.txt" -r "$ROOT/requirements-test.txt"

# 3. Packages whose declared dependencies must not come in: megatron-core (would pull
#    nvidia-modelopt and friends) and vLLM-Ascend (torch-npu, which breaks `import torch`
#    off Ascend).
log "megatron-core $MCORE_V and vllm-ascend $VASC_V without dependencies"
uvq --no-deps "megatron-core==$MCORE_V" "vllm-ascend==$VASC_V"

# 3b. The source-only components at the lock's releases, without dependencies (no registry carries
#     them): MindSpeed, Megatron-LM's training package and MindSpeed-LLM, each from its release archive
#     (VERL_PATCHES_UPSTREAM_DIR, else upstream/ in or beside the checkout), else its git tag, else
#     skipped with a note. MindSpeed's argument and feature modules import on CPU; its NPU kernels are
#     never loaded; nothing imports mindspeed_llm by installing it.
while read -r line; do log "$line"; done <<<"$UPSTREAM_SOURCES"
bash "$ROOT/scripts/install_upstream_sources.sh" "$VENV/bin/python"

# 4. The overlay itself, editable, so its vLLM plugin entry point is registered.
uvq --no-deps --no-build-isolation -e "$ROOT"

echo "$STAMP" > "$VENV/.verl_patches_stamp"
log "done: $VENV"
