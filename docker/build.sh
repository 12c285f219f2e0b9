#!/usr/bin/env bash
# Build docker/Dockerfile with every version passed as a build arg read from
# configs/upstream.lock.toml, so the image cannot drift from the lock.
# --print shows the command without building. IMAGE (recipe-dsv3-grpo:latest) names the result;
# --cuda builds docker/Dockerfile.cuda from configs/upstream.cuda.lock.toml (IMAGE_CUDA names it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
IMAGE="${IMAGE:-recipe-dsv3-grpo:latest}"
DOCKER="${DOCKER:-docker}"

print_only=0
cuda=0
for arg in "$@"; do
  case "$arg" in
    --print) print_only=1 ;;
    --cuda) cuda=1 ;;
    *) echo "usage: $(basename "$0") [--cuda] [--print]" >&2; exit 2 ;;
  esac
done
# --cuda: the NVIDIA image (docker/Dockerfile.cuda) from the CUDA variant of the lock.
if ((cuda)); then
  DOCKERFILE="$ROOT/docker/Dockerfile.cuda"
  LOCK="$ROOT/configs/upstream.cuda.lock.toml"
  IMAGE="${IMAGE_CUDA:-recipe-dsv3-grpo-cuda:latest}"
else
  DOCKERFILE="$ROOT/docker/Dockerfile"
  LOCK="$ROOT/configs/upstream.lock.toml"
fi

# build-arg name -> lock field. Python's tomllib reads the lock (3.11+, no third-party package).
mapfile -t BUILD_ARGS < <("$PYTHON" - "$LOCK" "$cuda" <<'PY'
import sys, tomllib
c = tomllib.load(open(sys.argv[1], "rb"))["components"]
if sys.argv[2] == "1":
    args = {
        "TORCH_VERSION": c["torch"]["version"],
        "TORCHVISION_VERSION": c["torchvision"]["version"],
        "TORCHAUDIO_VERSION": c["torchaudio"]["version"],
        "XFORMERS_VERSION": c["xformers"]["version"],
        "VLLM_VERSION": c["vllm"]["version"],
        "MEGATRON_CORE_VERSION": c["megatron_core"]["version"],
        "TRANSFORMER_ENGINE_VERSION": c["transformer_engine"]["version"],
        "FLASH_ATTN_VERSION": c["flash_attn"]["version"],
        "TORCH_MEMORY_SAVER_VERSION": c["torch_memory_saver"]["version"],
    }
else:
    args = {
        "CANN_TAG": c["cann"]["ref"].lower(),
        "TORCH_VERSION": c["torch"]["version"],
        "TORCH_NPU_VERSION": c["torch_npu"]["version"],
        "VLLM_VERSION": c["vllm"]["version"],
        "VLLM_SDIST_SHA256": c["vllm"]["sdist_sha256"],
        "VLLM_ASCEND_VERSION": c["vllm_ascend"]["version"],
        "MEGATRON_CORE_VERSION": c["megatron_core"]["version"],
    }
for k, v in args.items():
    print("--build-arg")
    print(f"{k}={v}")
PY
)
if ((${#BUILD_ARGS[@]} == 0)); then
  echo "error: could not read build args from $LOCK" >&2
  exit 1
fi
CMD=("$DOCKER" build -f "$DOCKERFILE" -t "$IMAGE" "${BUILD_ARGS[@]}" "$ROOT")
if ((print_only)); then
  printf '%q ' "${CMD[@]}"
  printf '\n'
  exit 0
fi
exec "${CMD[@]}"
