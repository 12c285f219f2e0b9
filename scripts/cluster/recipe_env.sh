#!/usr/bin/env bash
# The recipe's runtime environment: every variable of the reference's launch scripts, what reads
# it (package and version) and why, in one table that docs/RECIPE.md "Environment parity" repeats
# (tests/recipe/test_env.py checks they agree). Sourced by bringup.sh; nothing runs on source.
# recipe_env_apply exports the defaults for this DEVICE; a variable already in the environment
# keeps its value (its source is printed as "environment"), checked against the row's pattern.

# Run instead of sourced: say how it is used, define nothing, run nothing.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  usage="usage: source scripts/cluster/recipe_env.sh (from bash; bringup.sh sources it). It defines functions and runs nothing.
A launcher's options: bash scripts/train_deepseekv3_256die_random_init.sh --help"
  if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then echo "$usage"; exit 0; fi
  echo "$usage" >&2
  exit 2
fi

# Fields are separated by | (so no field may contain one).
# NAME|REFERENCE VALUE|WHERE (any, npu, cuda)|OUR DEFAULT|PATTERN|READ BY|WHY
# OUR DEFAULT "-": not set, nothing in the pinned stack reads it (WHY says what replaces it);
# "@jemalloc", "@node_ip", "@socket_ifname", "@cuda_lock": computed on the node.
recipe_env_table() {
  cat <<'TABLE'
HCCL_OP_EXPANSION_MODE|AIV|npu|AIV|^[A-Z_]+$|CANN 8.2.RC1 HCCL|collectives are expanded and run on the AI Vector cores; the reference credits it for part of its rollout speed-up (162 -> 419 tokens/s per device)
TASK_QUEUE_ENABLE|2|npu|2|^[0-2]$|torch_npu 2.5.1.post1|level-2 operator dispatch queue: host-side launch overlaps device execution
PYTORCH_NPU_ALLOC_CONF|expandable_segments:True|npu|expandable_segments:False|^.+$|torch_npu 2.5.1.post1 caching allocator|expandable segments off, unlike the reference: graph mode builds the rollout weights and KV cache in vLLM-Ascend's CaMem pool, and expandable segments do not work with such a pool (vLLM-Ascend's sleep mode, the same pool, is reported to free nothing with them); with graph mode and recipe.offload the config check and the rollout refuse True (docs/RECIPE.md, Expandable segments)
HCCL_BUFFSIZE|300|npu|300|^[0-9]+$|CANN 8.2.RC1 HCCL|MB of buffer per communicator; the MoE all-to-alls of EP256 need more than the 200 MB default
HCCL_CONNECT_TIMEOUT|600|npu|1800|^[0-9]+$|CANN 8.2.RC1 HCCL|seconds to set up a communicator; the reference's 600 s, raised because 256 dies build the training groups and every vLLM DP domain in one go
HCCL_EXEC_TIMEOUT|600|npu|600|^[0-9]+$|CANN 8.2.RC1 HCCL|seconds a collective waits for its peers before failing
HCCL_IF_BASE_PORT|64247|npu|64247|^[0-9]+$|CANN 8.2.RC1 HCCL|first host port HCCL listens on; above the ranges Ray and the vLLM DP domain take
HCCL_HOST_SOCKET_PORT_RANGE|auto|npu|auto|^.+$|CANN 8.2.RC1 HCCL|host ports HCCL may use for its socket connections
HCCL_SOCKET_IFNAME|@socket_ifname|npu|@socket_ifname|^.+$|CANN 8.2.RC1 HCCL|the interface that reaches the other nodes
LCAL_COMM_ID|127.0.0.1:27001|npu|127.0.0.1:27001|^.+$|CANN 8.2.RC1 NNAL (ATB's LCAL communicator)|address of the node-local communicator the ATB kernels of vLLM-Ascend use
ASCEND_LAUNCH_BLOCKING|0|npu|0|^[01]$|torch_npu 2.5.1.post1|0: kernels launch asynchronously (1 is for debugging and is slow)
ASCEND_GLOBAL_LOG_LEVEL|3|npu|3|^[0-4]$|CANN 8.2.RC1 log|errors only
ASCEND_SLOG_PRINT_TO_STDOUT|0|npu|0|^[01]$|CANN 8.2.RC1 log|CANN logs go to files, not the job's output
ASCEND_GLOBAL_EVENT_ENABLE|0|npu|0|^[01]$|CANN 8.2.RC1 log|no event log
VLLM_ASCEND_ENABLE_TOPK_OPTIMIZE|1|npu|1|^[01]$|vllm-ascend 0.9.1 (envs.py, its sampler patch)|fused top-k / top-p sampling on the NPU
VLLM_ASCEND_MODEL_EXECUTE_TIME_OBSERVE|0|npu|0|^[01]$|vllm-ascend 0.9.1 (envs.py)|no per-step timing logs
VLLM_VERSION|0.9.1|npu|0.9.1|^[0-9]+\.[0-9]+\.[0-9]+$|vllm-ascend 0.9.1 (envs.py, utils.vllm_version_is)|vLLM built as pure Python reports 0.9.1+empty, which vLLM-Ascend's version checks would not take for 0.9.1; the lock's vLLM version
VLLM_ASCEND_ACL_OP_INIT_MODE|0|npu|-|-|nothing in vllm-ascend 0.9.1|the reference's vLLM-Ascend 0.9.1rc2 read it; the pinned release does not
CUDA_DEVICE_MAX_CONNECTIONS|1|any|1|^[0-9]+$|megatron-core 0.12.1 (parallel_state), verl 0.4.1 (megatron_workers), torch_npu 2.5.1.post1|one hardware queue, so communication kernels start in program order, as megatron's sequence parallel and its overlaps assume
VLLM_USE_V1|1|any|1|^[01]$|vllm 0.9.1 (envs.py)|the V1 engine, which the recipe's engine-core and KV-cache patches target
VLLM_HOST_IP|-|any|@node_ip|^[0-9a-fA-F.:]+$|vllm 0.9.1 (envs.py, get_ip)|the address each vLLM DP master advertises; it must be the node's address on the interface the other nodes reach
GLOO_SOCKET_IFNAME|@socket_ifname|any|@socket_ifname|^.+$|torch 2.5.1 (gloo)|the interface gloo binds to (CPU groups, Ray collective fallbacks)
NCCL_SOCKET_IFNAME|-|cuda|@socket_ifname|^.+$|NCCL (torch 2.7.0's CUDA build)|the interface NCCL's bootstrap and socket transport bind to; the CUDA counterpart of HCCL_SOCKET_IFNAME
VERL_PATCHES_LOCK|-|cuda|@cuda_lock|^.+\.toml$|verl_patches (core/lock.py: doctor, prelude)|the CUDA variant of the lock (torch 2.7.0 for vLLM 0.9.1's CUDA build), so the doctor and the patches' version checks compare with what this image installs
RAY_DEDUP_LOGS|0|any|0|^[01]$|ray 2.46.0 (ray_constants)|every worker's log lines are shown, not folded
HYDRA_FULL_ERROR|1|any|1|^[01]$|hydra-core 1.3.2|full stack trace on a configuration error
MALLOC_MMAP_THRESHOLD_|512768|any|512768|^[0-9]+$|glibc malloc|allocations above 500 KB map their own pages and return them on free (where jemalloc is not preloaded)
LD_PRELOAD|/usr/local/lib/libjemalloc.so.2|any|@jemalloc|^.*$|ld.so (jemalloc 5)|jemalloc as the host allocator: less fragmentation across hundreds of steps of large host buffers; not set when the library is missing (a note says so)
RECIPE_OPEN_FILES|32768|any|32768|^[0-9]+$|this launcher (ulimit -n)|Ray, gloo and HCCL open many sockets and files per process; the soft limit is raised to this, or to the hard limit if lower
TP_SOCKET_IFNAME|@socket_ifname|any|-|-|torch 2.5.1 TensorPipe (RPC only)|nothing the recipe runs uses torch's RPC
VLLM_ENABLE_GRAPH_MODE|1|any|-|-|nothing in vllm / vllm-ascend 0.9.1|read by the reference's own rollout patch; here TorchAir graph mode is engine_kwargs...torchair_graph_config.enabled in the YAML
VLLM_ENABLE_MC2|1|any|-|-|nothing in vllm-ascend 0.9.1|read by the reference's vLLM-Ascend 0.9.1rc2; the release chooses MC2 from its fused-MoE state itself
VLLM_DP_SIZE|128 / 64|any|-|-|vllm 0.9.1 (envs.py), set per DP group by the recipe's rollout constructor|one value cannot serve every DP group; recipe.vllm_dp in the YAML gives size, instances and ports
VLLM_ENABLE_FIX_ROUTE|1 / 0|any|-|-|nothing in vllm / vllm-ascend 0.9.1|the reference's own switch; here recipe.fixed_routing in the YAML (docs/RECIPE.md, Fixed routing)
D2D_DATA_TRANSFER|1|any|-|-|nothing in the pinned stack|the reference's own switch; here recipe.tensor_cache in the YAML
PRINT_MEMORY|1|any|-|-|nothing in the pinned stack|the reference's own memory log; here the offload engine's ledger
PROFILE_UPDATE|0|any|-|-|nothing in the pinned stack|the reference's own profiling switch (its update only); here recipe.profile in the YAML: chosen stages (rollout, old and reference log-prob, update, the switch's phases), steps and ranks, at torch_npu's profiler levels on NPU, torch's profiler on CUDA and CPU (docs/TINY_RUN.md, Profiles)
WORLD_SIZE|256|any|-|-|verl 0.4.1 sets it per worker|the launcher must not fix it for every process
MASTER_PORT|29444|any|-|-|verl 0.4.1 sets it per worker group|the reference's Ray port; here RAY_PORT
ASCEND_NPU_SLEEP_DISABLE|-|any|-|-|nothing found in the pinned stack (vllm, vllm-ascend, verl, megatron-core, MindSpeed)|named by the issue that asked for parity; no reader was found, so it is not set
VLLM_DISABLE_MEMORY_POOL|-|any|-|-|nothing found in the pinned stack (vllm, vllm-ascend, verl, megatron-core, MindSpeed)|named by the issue that asked for parity; no reader was found, so it is not set
TABLE
}

# The first jemalloc that exists, for this machine's architecture first.
recipe_env_jemalloc() {
  local cand
  for cand in "/usr/lib/$(uname -m)-linux-gnu/libjemalloc.so.2" /usr/local/lib/libjemalloc.so.2 /usr/lib64/libjemalloc.so.2; do
    if [[ -f "$cand" ]]; then echo "$cand"; return 0; fi
  done
}

# The IPv4 address of SOCKET_IFNAME, else the first global address.
recipe_env_node_ip() {
  local ip=""
  if command -v ip >/dev/null 2>&1 && [[ -n "${SOCKET_IFNAME:-}" ]]; then
    ip="$(ip -o -4 addr show dev "$SOCKET_IFNAME" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')"
  fi
  if [[ -z "$ip" ]] && declare -F bringup_local_ips >/dev/null; then
    ip="$(bringup_local_ips | head -n1)"
  fi
  echo "$ip"
}

# Export this DEVICE's variables (an existing value wins); fills RECIPE_ENV_NAMES / _SOURCES / _READERS
# and RECIPE_ENV_UNSET for recipe_env_print. Returns 2 on a value that does not match its pattern.
recipe_env_apply() {
  local device="${1:-${DEVICE:-npu}}"
  local name _ref where default pattern reader why value origin bad=0
  RECIPE_ENV_NAMES=() RECIPE_ENV_SOURCES=() RECIPE_ENV_READERS=() RECIPE_ENV_UNSET=() RECIPE_ENV_NOTES=()
  while IFS='|' read -r name _ref where default pattern reader why; do
    [[ -n "$name" ]] || continue
    if [[ "$where" != any && "$where" != "$device" ]]; then continue; fi
    if [[ "$default" == - ]]; then RECIPE_ENV_UNSET+=("$name"); continue; fi
    if printenv "$name" >/dev/null 2>&1; then
      value="$(printenv "$name")" origin=environment
    else
      case "$default" in
        @jemalloc) value="$(recipe_env_jemalloc)" ;;
        @node_ip) value="$(recipe_env_node_ip)" ;;
        @socket_ifname) value="${SOCKET_IFNAME:-}" ;;
        @cuda_lock) value="${RECIPE_ROOT:-.}/configs/upstream.cuda.lock.toml" ;;
        *) value="$default" ;;
      esac
      origin="recipe default"
      if [[ -z "$value" ]]; then
        RECIPE_ENV_NOTES+=("$name not set: no value found on this node (${why%%;*})")
        continue
      fi
    fi
    if ! [[ "$value" =~ $pattern ]]; then
      echo "error: $name='$value' ($origin) does not match $pattern: $why" >&2
      bad=1
      continue
    fi
    export "$name=$value"
    RECIPE_ENV_NAMES+=("$name") RECIPE_ENV_SOURCES+=("$origin") RECIPE_ENV_READERS+=("$reader")
  done < <(recipe_env_table)
  ((bad == 0)) || return 2
  recipe_env_open_files
}

# ulimit -n: raise the soft limit to RECIPE_OPEN_FILES, or to the hard limit if that is lower.
recipe_env_open_files() {
  local want="${RECIPE_OPEN_FILES:-32768}" hard soft
  soft="$(ulimit -Sn)" hard="$(ulimit -Hn)"
  if [[ "$hard" != unlimited ]] && ((hard < want)); then
    RECIPE_ENV_NOTES+=("open files: hard limit $hard is below RECIPE_OPEN_FILES=$want; soft limit raised to $hard")
    want="$hard"
  fi
  if [[ "$soft" == unlimited ]] || ((soft >= want)); then return 0; fi
  ulimit -Sn "$want" 2>/dev/null || RECIPE_ENV_NOTES+=("open files: could not raise the soft limit from $soft to $want")
}

recipe_env_print() {
  local i
  for i in "${!RECIPE_ENV_NAMES[@]}"; do
    printf '  %s=%q  [%s; read by %s]\n' "${RECIPE_ENV_NAMES[$i]}" "$(printenv "${RECIPE_ENV_NAMES[$i]}")" \
           "${RECIPE_ENV_SOURCES[$i]}" "${RECIPE_ENV_READERS[$i]}"
  done
  printf '  open files (ulimit -n): %s\n' "$(ulimit -Sn)"
  if ((${#RECIPE_ENV_UNSET[@]})); then
    printf '  not set by the launcher (docs/RECIPE.md, Environment parity, says why and what replaces each): %s\n' \
           "${RECIPE_ENV_UNSET[*]}"
  fi
  for i in "${RECIPE_ENV_NOTES[@]}"; do printf '  note: %s\n' "$i"; done
}
