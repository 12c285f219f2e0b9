#!/usr/bin/env bash
# Install MindSpeed at the lock's release (configs/upstream.lock.toml) into a Python environment,
# without its dependencies. MindSpeed is on no package registry, so the source is, in this order:
#   1. the release archive (`git archive` of the tag), checked against the lock's sha256, in
#      VERL_PATCHES_UPSTREAM_DIR when it is set; otherwise in a folder named `upstream` inside the
#      checkout (ignored by git) or inside a sibling folder of the checkout (an offline machine's
#      folder of upstream archives), the first that holds it;
#   2. the git tag, checked against the lock's commit;
#   3. neither reachable (a CI machine with registry access only): a note, nothing installed, exit 0.
#
#   bash scripts/install_mindspeed.sh [--print] [PYTHON]
#
# --print names the source it would use by its content, not its place (one line: "archive sha256:HASH
# NAME", "git URL@TAG commit" or "skip: WHY") and installs nothing; setup_test_env.sh puts that line
# into its venv stamp, so a moved or linked checkout keeps its venv. PYTHON defaults to python3.
# GIT (git) and MINDSPEED_GIT_TIMEOUT_S (20) control the tag lookup.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  echo "usage: bash scripts/install_mindspeed.sh [--print] [PYTHON]"
  usage
  exit 0
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOCK=$ROOT/configs/upstream.lock.toml
GIT=${GIT:-git}
GIT_TIMEOUT=${MINDSPEED_GIT_TIMEOUT_S:-20}

print_only=0
if [[ "${1:-}" == --print ]]; then print_only=1; shift; fi
PY=${1:-python3}

log() { printf '[install_mindspeed] %s\n' "$*" >&2; }

lock_field() { "$PY" - "$LOCK" "$1" <<'EOF'
import sys, tomllib
print(tomllib.load(open(sys.argv[1], "rb"))["components"]["mindspeed"].get(sys.argv[2], ""))
EOF
}
REPO=$(lock_field repo); REF=$(lock_field ref); COMMIT=$(lock_field commit)
ARCHIVE=$(lock_field archive); ARCHIVE_SHA=$(lock_field archive_sha256); VERSION=$(lock_field version)
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

choose_source() {
  local path="" d
  for d in "${UPSTREAM_DIRS[@]}"; do
    if [[ -f "$d/$ARCHIVE" ]]; then path="$d/$ARCHIVE"; break; fi
  done
  if [[ -n "$path" ]]; then
    local sha
    sha=$(sha256sum "$path" | cut -d' ' -f1)
    if [[ "$sha" != "$ARCHIVE_SHA" ]]; then
      log "error: $path has sha256 $sha; the lock's MindSpeed $REF archive has $ARCHIVE_SHA (a different MindSpeed would make every fingerprint check meaningless)"
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
      log "error: tag $REF of $REPO is commit $found; the lock pins $COMMIT"
      return 2
    fi
    SOURCE="git $REPO@$REF $found"
    return 0
  fi
  SOURCE="skip: no $ARCHIVE found (set VERL_PATCHES_UPSTREAM_DIR) and tag $REF of $REPO not reachable"
}

choose_source
if ((print_only)); then
  echo "$SOURCE"
  exit 0
fi

case "$SOURCE" in
  skip:*)
    log "note: MindSpeed not installed ($SOURCE; looked in ${UPSTREAM_DIRS[*]}); its tests skip and doctor --strict reports it missing on Ascend"
    exit 0 ;;
  archive\ *) target=$ARCHIVE_PATH ;;
  git\ *) target="git+${REPO}@${REF}" ;;
esac
log "MindSpeed $REF from ${SOURCE%% *}: $target"
# CI_BUILD=1: MindSpeed's setup.py otherwise pip-installs its requirements.txt (unpinned) itself.
CI_BUILD=1 "$PY" -m pip --disable-pip-version-check install -q --no-deps --no-build-isolation "$target"
installed=$("$PY" -c 'import importlib.metadata as m; print(m.version("mindspeed"))')
if [[ "$installed" != "$VERSION" ]]; then
  log "error: installed mindspeed reports version $installed; the lock's release reports $VERSION"
  exit 2
fi
log "done: mindspeed $installed ($REF, $COMMIT)"
