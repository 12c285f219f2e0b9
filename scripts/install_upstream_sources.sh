#!/usr/bin/env bash
# Install the lock's source-only components (configs/upstream.lock.toml, the entries with an `archive`:
# MindSpeed, Megatron-LM's training package, MindSpeed-LLM, in the lock's order) into a Python
# environment, without their dependencies. No package registry carries them, so each one's source is,
# in this order:
#   1. its release archive (`git archive` of the tag), checked against the lock's sha256, in
#      VERL_PATCHES_UPSTREAM_DIR when it is set; otherwise in a folder named `upstream` inside the
#      checkout (ignored by git) or inside a sibling folder of the checkout (an offline machine's
#      folder of upstream archives), the first that holds it;
#   2. the git tag, checked against the lock's commit;
#   3. neither reachable (a CI machine with registry access only): a note, nothing installed, exit 0
#      (--require makes it an error: the Ascend image must have them).
# How each is installed:
#   mindspeed          pip --no-deps --no-build-isolation, CI_BUILD=1 (its setup.py otherwise
#                      pip-installs its own unpinned requirements);
#   megatron_training  Megatron-LM's megatron/training and megatron/legacy ship no setup.py: they are
#                      written beside megatron-core's megatron/core in site-packages (`megatron` is a
#                      namespace package there) with a dist-info of the lock's name and version, by
#                      verl_patches/core/sources.py, whose RECORD lets pip list and uninstall them.
#                      Not a folder on a .pth line: the doctor then finds the package by its
#                      distribution and reads its version and source as it does for MindSpeed;
#   mindspeed_llm      the release's mindspeed_llm/ written as it is, the same way: its setup.py's
#                      find_packages() leaves out the folders without an __init__.py (45 of 302 modules
#                      at v2.2.0, the MLA and flash-attention features among them), and would try to
#                      build an NPU extension where torch_npu imports; its requirements (transformers
#                      4.43.2, ray 2.10.0) are not installed.
# Each install records its source (pip's direct_url.json: the archive's sha256, or the commit), and the
# script checks the installed copy against the lock afterwards (version, source, and every file against
# its RECORD). A copy that already passes that check is left as it is, so a second run changes nothing.
# Nothing here imports the installed packages (`import mindspeed_llm` runs its megatron adaptor).
#
#   bash scripts/install_upstream_sources.sh [--print] [--require] [PYTHON]
#
# --print names each component's source by its content, not its place (one line each, "KEY archive
# sha256:HASH NAME", "KEY git URL@TAG COMMIT" or "KEY skip: WHY") and installs nothing;
# setup_test_env.sh puts those lines into its venv stamp, so a moved or linked checkout keeps its venv.
# PYTHON defaults to python3. GIT (git) and UPSTREAM_GIT_TIMEOUT_S (20) control the tag lookup.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  echo "usage: bash scripts/install_upstream_sources.sh [--print] [--require] [PYTHON]"
  usage
  exit 0
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOCK=$ROOT/configs/upstream.lock.toml
SOURCES_PY=$ROOT/verl_patches/core/sources.py
GIT=${GIT:-git}
GIT_TIMEOUT=${UPSTREAM_GIT_TIMEOUT_S:-20}

print_only=0
require=0
while [[ "${1:-}" == --* ]]; do
  case "$1" in
    --print) print_only=1 ;;
    --require) require=1 ;;
    *) echo "usage: bash scripts/install_upstream_sources.sh [--print] [--require] [PYTHON]" >&2; exit 2 ;;
  esac
  shift
done
PY=${1:-python3}

log() { printf '[install_upstream_sources] %s\n' "$*" >&2; }

# One tab-separated line per source-only component, in the lock's order.
mapfile -t ENTRIES < <("$PY" - "$LOCK" <<'EOF'
import sys, tomllib
comps = tomllib.load(open(sys.argv[1], "rb"))["components"]
for key, c in comps.items():
    if "archive" in c:
        fields = [key] + [str(c.get(f, "")) for f in ("repo", "ref", "commit", "archive", "archive_sha256", "package", "version")]
        if not all(fields):
            sys.exit(f"{sys.argv[1]}: component {key} has an archive but lacks one of repo, ref, commit, "
                     "archive_sha256, package, version")
        print("\t".join(fields))
EOF
)
if ((${#ENTRIES[@]} == 0)); then
  log "error: no component with an archive in $LOCK"
  exit 2
fi
if [[ -n "${VERL_PATCHES_UPSTREAM_DIR:-}" ]]; then
  UPSTREAM_DIRS=("$VERL_PATCHES_UPSTREAM_DIR")
else
  UPSTREAM_DIRS=("$ROOT/upstream")
  for d in "$ROOT"/../*/upstream; do
    [[ -d "$d" ]] && UPSTREAM_DIRS+=("$(cd "$d" && pwd)")
  done
fi

# The tag's commit on the remote (the peeled commit for an annotated tag), or nothing.
remote_commit() {
  command -v "$GIT" >/dev/null 2>&1 || return 0
  timeout "$GIT_TIMEOUT" "$GIT" ls-remote --tags "$REPO" "refs/tags/$REF" "refs/tags/$REF^{}" 2>/dev/null \
    | awk '{c[$2] = $1} END {t = "refs/tags/" ref; if ((t "^{}") in c) print c[t "^{}"]; else if (t in c) print c[t]}' ref="$REF" \
    || true
}

# Sets SOURCE (and ARCHIVE_PATH) for the component in KEY, REPO, REF, ...; returns 2 on a wrong archive
# or a moved tag.
choose_source() {
  local path="" d
  ARCHIVE_PATH=""
  for d in "${UPSTREAM_DIRS[@]}"; do
    if [[ -f "$d/$ARCHIVE" ]]; then path="$d/$ARCHIVE"; break; fi
  done
  if [[ -n "$path" ]]; then
    local sha
    sha=$(sha256sum "$path" | cut -d' ' -f1)
    if [[ "$sha" != "$ARCHIVE_SHA" ]]; then
      log "error: $path has sha256 $sha; the lock's $KEY $REF archive has $ARCHIVE_SHA (another release would make every fingerprint check meaningless)"
      return 2
    fi
    ARCHIVE_PATH="$(cd "$(dirname "$path")" && pwd)/$ARCHIVE"
    SOURCE="archive sha256:$sha $ARCHIVE"
    return 0
  fi
  local found
  found=$(remote_commit)
  if [[ -n "$found" ]]; then
    if [[ "$found" != "$COMMIT" ]]; then
      log "error: tag $REF of $REPO is commit $found; the lock pins $COMMIT for $KEY"
      return 2
    fi
    SOURCE="git $REPO@$REF $found"
    return 0
  fi
  SOURCE="skip: no $ARCHIVE found (set VERL_PATCHES_UPSTREAM_DIR) and tag $REF of $REPO not reachable"
}

check_installed() {
  "$PY" "$SOURCES_PY" check "$PACKAGE" "$VERSION" --archive-sha256 "$ARCHIVE_SHA" --commit "$COMMIT"
}

pip_install() {  # pip_install TARGET [ENV...]: the component's own setup.py, no dependencies
  local target=$1; shift
  env "$@" "$PY" -m pip --disable-pip-version-check install -q --no-deps --no-build-isolation --force-reinstall "$target"
}

install_component() {
  local target
  case "$SOURCE" in
    # pip checks the address's hash against the file and records it (direct_url.json).
    archive\ *) target="$("$PY" -c 'import pathlib, sys; print(pathlib.Path(sys.argv[1]).as_uri())' "$ARCHIVE_PATH")#sha256=$ARCHIVE_SHA" ;;
    git\ *) target="git+${REPO}@${COMMIT}" ;;
  esac
  case "$KEY" in
    mindspeed) pip_install "$target" CI_BUILD=1 ;;
    megatron_training) install_tree megatron/training megatron/legacy ;;
    mindspeed_llm) install_tree mindspeed_llm ;;
    *)
      log "error: the lock's $KEY has an archive, and this script has no install method for it: add one here"
      return 2 ;;
  esac
}

install_tree() {  # install_tree PATH...: those folders of the release, as they are (sources.py install-tree)
  local paths=("$@")
  if "$PY" -m pip --disable-pip-version-check show -q "$PACKAGE" >/dev/null 2>&1; then
    "$PY" -m pip --disable-pip-version-check uninstall -q -y "$PACKAGE"
  fi
  if [[ -n "$ARCHIVE_PATH" ]]; then
    "$PY" "$SOURCES_PY" install-tree "$PACKAGE" "$VERSION" --paths "${paths[@]}" \
      --archive "$ARCHIVE_PATH" --archive-sha256 "$ARCHIVE_SHA" >/dev/null
    return
  fi
  local tmp rc=0
  tmp=$(mktemp -d)
  "$GIT" clone -q --depth 1 --branch "$REF" "$REPO" "$tmp/src" || rc=2
  if ((rc == 0)) && [[ "$("$GIT" -C "$tmp/src" rev-parse HEAD)" != "$COMMIT" ]]; then
    log "error: the clone of $REPO@$REF is not commit $COMMIT"
    rc=2
  fi
  if ((rc == 0)); then
    "$PY" "$SOURCES_PY" install-tree "$PACKAGE" "$VERSION" --paths "${paths[@]}" \
      --tree "$tmp/src" --repo "$REPO" --ref "$REF" --commit "$COMMIT" >/dev/null || rc=2
  fi
  rm -rf "$tmp"
  return "$rc"
}

status=0
for entry in "${ENTRIES[@]}"; do
  IFS=$'\t' read -r KEY REPO REF COMMIT ARCHIVE ARCHIVE_SHA PACKAGE VERSION <<<"$entry"
  choose_source || exit 2
  if ((print_only)); then
    echo "$KEY $SOURCE"
    continue
  fi
  if [[ "$SOURCE" == skip:* ]]; then
    if ((require)); then
      log "error: $KEY not installed ($SOURCE; looked in ${UPSTREAM_DIRS[*]})"
      status=2
    else
      log "note: $KEY not installed ($SOURCE; looked in ${UPSTREAM_DIRS[*]}); its tests skip and doctor --strict reports it missing on Ascend"
    fi
    continue
  fi
  if check_installed >/dev/null; then
    log "$KEY $REF already installed ($PACKAGE $VERSION from the lock's release): left as it is"
    continue
  fi
  log "$KEY $REF from ${SOURCE%% *}: ${ARCHIVE_PATH:-$REPO@$REF}"
  install_component
  if ! problem=$(check_installed); then
    log "error: $KEY after the install: $problem"
    exit 2
  fi
  log "done: $PACKAGE $VERSION ($REF, $COMMIT)"
done
exit "$status"
