"""One facade over the accelerator (Ascend NPU, CUDA GPU, or CPU), resolved at call time.

Every device-specific call in the overlay goes through here, so the same engine code
runs on HCCL, NCCL and gloo. Importing this module imports neither torch_npu nor CUDA.
``VERL_PATCHES_DEVICE=npu|cuda|cpu`` forces a choice (tests use it to run the CPU path on a
GPU machine).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from types import SimpleNamespace
from typing import Any, Iterator

import torch

from verl_patches.base import env

DEVICE_TYPES = ("npu", "cuda", "cpu")
_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


def _npu_available() -> bool:
    # torch_npu is looked up, never imported, unless it is installed: importing it
    # off Ascend fails, and importing it at all changes torch's behaviour.
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def device_type() -> str:
    """'npu', 'cuda' or 'cpu': the forced value if set, else the first one available."""
    forced = env.get("VERL_PATCHES_DEVICE")
    if forced:
        return forced
    if _npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def tensor_device_type() -> str:
    """The device type of the tensors the accelerator holds: ``device_type()``, except where the device module
    declares otherwise (``TENSOR_DEVICE_TYPE``): the NPU rehearsal platform's stand-in holds them on the host."""
    return getattr(device_module(), "TENSOR_DEVICE_TYPE", None) or device_type()


def dist_backend() -> str:
    """The torch.distributed backend for the device: hccl, nccl or gloo."""
    return _BACKENDS[device_type()]


class _CpuDeviceModule(SimpleNamespace):
    """What the overlay needs of torch.cuda / torch.npu, for a CPU run.

    Memory statistics are zero: CPU tensors live in host memory, which the offload
    engine's ledger accounts for itself. Streams are absent (None): work is synchronous.
    The device's generator is the host's default generator: on CPU every op draws from it.
    """

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "CPU"

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        return host_mem_info()


_CPU = _CpuDeviceModule()


def device_module() -> Any:
    """torch.npu, torch.cuda, or a CPU stand-in with the same small surface."""
    kind = device_type()
    if kind == "npu":
        return torch.npu  # type: ignore[attr-defined]
    if kind == "cuda":
        return torch.cuda
    return _CPU


def current_device() -> torch.device:
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, device_module().current_device())


def set_device(local_rank: int) -> torch.device:
    """Bind this process to its local device (no-op on CPU) and return it."""
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    device_module().set_device(local_rank)
    return torch.device(kind, local_rank)


def synchronize() -> None:
    device_module().synchronize()


def empty_cache() -> None:
    device_module().empty_cache()


def memory_allocated() -> int:
    return int(device_module().memory_allocated())


def max_memory_allocated() -> int:
    return int(device_module().max_memory_allocated())


def memory_reserved() -> int:
    return int(device_module().memory_reserved())


def max_memory_reserved() -> int:
    """The caching allocator's reserved peak since the last reset (0 on CPU: nothing is reserved)."""
    return int(device_module().max_memory_reserved())


def reset_peak_memory_stats() -> None:
    device_module().reset_peak_memory_stats()


def mem_get_info() -> tuple[int, int]:
    """(free, total) bytes of device memory; on CPU, of host memory."""
    kind = device_type()
    if kind == "cpu":
        return host_mem_info()
    return tuple(int(x) for x in device_module().mem_get_info())  # type: ignore[return-value]


# The container's memory cgroup, v2 then v1: (directory, limit file, usage file, stat file).
CGROUP_MEMORY_FILES = (
    ("/sys/fs/cgroup", "memory.max", "memory.current", "memory.stat"),
    ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat"),
)


def _machine_mem_info() -> tuple[int, int]:
    """(available, total) bytes of the whole machine, from /proc/meminfo."""
    info: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_inactive_file(path: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                key, _, val = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    return int(val)
    except OSError:
        pass
    return 0


def host_mem_info() -> tuple[int, int]:
    """(available, total) host bytes, bounded by the container's memory cgroup if it has one.

    /proc/meminfo shows the whole machine inside a container, and pinning past the cgroup's
    limit gets the process killed instead of a clear error. Reclaimable page cache
    (inactive_file) counts as available, as the kernel would reclaim it.
    """
    avail, total = _machine_mem_info()
    for root, limit_f, usage_f, stat_f in CGROUP_MEMORY_FILES:
        limit, usage = _read_int(os.path.join(root, limit_f)), _read_int(os.path.join(root, usage_f))
        if limit is None or usage is None or limit >= total:
            continue
        free_in_cgroup = limit - usage + _cgroup_inactive_file(os.path.join(root, stat_f))
        return max(0, min(avail, free_in_cgroup)), limit
    return avail, total


def host_empty_cache() -> None:
    """Hand cached freed pinned host blocks back to the OS. CUDA only: torch_npu keeps its own
    host cache, and on CPU nothing is pinned."""
    if device_type() == "cuda" and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


def pin_memory_supported() -> bool:
    """Whether page-locked host buffers can be made (they need a device runtime)."""
    return device_type() != "cpu"


def new_stream() -> Any:
    """A side stream on the current device, or None on CPU (work runs in order)."""
    kind = device_type()
    if kind == "cpu":
        return None
    return device_module().Stream()


def current_stream() -> Any:
    if device_type() == "cpu":
        return None
    return device_module().current_stream()


@contextlib.contextmanager
def stream(s: Any) -> Iterator[None]:
    """Run the block on stream ``s`` (a no-op for None)."""
    if s is None:
        yield
        return
    with device_module().stream(s):
        yield


def new_event() -> Any:
    """An event for cross-stream ordering, or None on CPU."""
    if device_type() == "cpu":
        return None
    return device_module().Event()


# How much a profiler session records (recipe.profile.level): torch_npu's ProfilerLevel.Level0/1/2 on NPU; on every
# device, level1 adds the ops' input shapes and level2 their call stacks and memory.
PROFILER_LEVELS = ("level0", "level1", "level2")


def profiler(directory: str, worker_name: str, level: str = "level0") -> Any:
    """A profiler session: a context manager that records from entering to leaving and writes its trace into
    ``directory`` on leaving, its files named after ``worker_name``.

    NPU: torch_npu's profiler (CPU and NPU activities, ``experimental_config`` at torch_npu's ProfilerLevel of
    ``level``), written by torch_npu's tensorboard_trace_handler: a folder ``<worker_name>_..._ascend_pt`` that
    MindStudio Insight opens (its ASCEND_PROFILER_OUTPUT/trace_view.json is a chrome trace). CUDA and the CPU:
    torch's profiler (CPU activity, and CUDA's on CUDA), written as a gzipped chrome trace
    ``<worker_name>.<ms>.pt.trace.json.gz`` that Perfetto (ui.perfetto.dev) and chrome://tracing open."""
    if level not in PROFILER_LEVELS:
        raise ValueError(f"profiler level {level!r}: the levels are {list(PROFILER_LEVELS)}")
    depth = PROFILER_LEVELS.index(level)
    shapes, deep = depth >= 1, depth >= 2
    kind = device_type()
    if kind == "npu":
        # Lazy: torch_npu exists only on Ascend (or as the NPU rehearsal platform's stand-in); device_type() said
        # "npu", so it is installed and imported already (_npu_available).
        import torch_npu

        npu = torch_npu.profiler
        config = npu._ExperimentalConfig(profiler_level=getattr(npu.ProfilerLevel, f"Level{depth}"))
        return npu.profile(activities=[npu.ProfilerActivity.CPU, npu.ProfilerActivity.NPU],
                           on_trace_ready=npu.tensorboard_trace_handler(directory, worker_name=worker_name),
                           record_shapes=shapes, profile_memory=deep, with_stack=deep, experimental_config=config)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if kind == "cuda"
                                                          else [])
    return torch.profiler.profile(
        activities=activities, record_shapes=shapes, profile_memory=deep, with_stack=deep,
        on_trace_ready=torch.profiler.tensorboard_trace_handler(directory, worker_name=worker_name, use_gzip=True))


def profiler_label(name: str) -> Any:
    """A named range in the trace of the session recording now (a context manager; records nothing without one):
    torch's record_function, which torch_npu's profiler records too."""
    return torch.profiler.record_function(name)


def describe() -> dict[str, Any]:
    """What was resolved, for logs and benchmark headers."""
    kind = device_type()
    out: dict[str, Any] = {"device_type": kind, "backend": _BACKENDS[kind], "torch": torch.__version__}
    if kind != "cpu":
        mod = device_module()
        out["device_count"] = int(mod.device_count())
        out["device_name"] = str(mod.get_device_name(mod.current_device()))
    return out
