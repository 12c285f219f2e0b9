"""STAND-IN for ``torch_npu.npu`` / ``torch.npu`` (NPU rehearsal platform): the device API on the host.

Declared answers, each the host's own:
- one device, the host: ``TENSOR_DEVICE_TYPE`` (the overlay's accelerator facade reads it; no torch_npu name)
  says the device's tensors are host tensors; ``current_device()`` answers the index ``set_device`` recorded (0 by default), as
  torch_npu does; transfer_to_npu makes a tensor asked for on that index (or on ``npu`` / ``cuda``) on the host;
- streams and events are the program order (the host runs synchronously): waiting, recording and
  synchronising return at once; ``Event(enable_timing=True).elapsed_time`` measures host wall time;
- memory figures are the host's: nothing is cached (``memory_allocated`` and the like answer 0, as the CPU
  platform's do), ``mem_get_info`` the host's (or its cgroup's) free and total bytes;
- the generator is the host's default generator (every host op draws from it);
- ``set_compile_mode`` records the mode (there is no NPU graph compiler on the host), and
  ``is_current_stream_capturing`` answers False (no graph is captured on the host);
Any other name raises AttributeError naming it.
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch
from torch._streambase import _EventBase, _StreamBase

from verl_patches.rigs import npu_rehearsal as _platform
from verl_patches.base.accelerator import host_mem_info

_state = {"device": 0, "compile_mode": None}
TENSOR_DEVICE_TYPE = "cpu"  # a tensor made "on the NPU" is a host tensor (transfer_to_npu's stand-in)


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def init() -> None:
    return None


def device_count() -> int:
    return 1


def current_device() -> int:
    return _state["device"]


def set_device(device: Any) -> None:
    if isinstance(device, torch.device):
        device = device.index or 0
    elif isinstance(device, str):
        device = int(device.split(":")[1]) if ":" in device else 0
    _state["device"] = int(device)


def get_device_name(device: Any = None) -> str:
    return "NPU rehearsal (host)"


def get_device_properties(device: Any = None) -> SimpleNamespace:
    return SimpleNamespace(name=get_device_name(), total_memory=host_mem_info()[1], multi_processor_count=1)


def _lazy_call(callable: Callable[[], Any], **kwargs: Any) -> None:
    callable()  # torch_npu queues the call until the device is initialised; the host is always initialised


class device:
    """``torch_npu.npu.device(idx)``: selects the device for a block; the host has one."""

    def __init__(self, device: Any) -> None:
        self.idx = device

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return False


def synchronize(device: Any = None) -> None:
    return None  # the host runs in program order


def empty_cache() -> None:
    return None  # no caching allocator on the host


def memory_allocated(device: Any = None) -> int:
    return 0


def max_memory_allocated(device: Any = None) -> int:
    return 0


def memory_reserved(device: Any = None) -> int:
    return 0


def max_memory_reserved(device: Any = None) -> int:
    return 0


def reset_peak_memory_stats(device: Any = None) -> None:
    return None


def reset_max_memory_allocated(device: Any = None) -> None:
    return None


def memory_stats(device: Any = None) -> dict[str, int]:
    return {"allocated_bytes.all.current": 0, "allocated_bytes.all.peak": 0,
            "reserved_bytes.all.current": 0, "reserved_bytes.all.peak": 0}


def mem_get_info(device: Any = None) -> tuple[int, int]:
    return host_mem_info()


class Stream(_StreamBase):
    """A stream that is the program order (synchronous host). torch's stream base class, as torch.cuda's
    streams have it (torch._dynamo checks that torch.cuda.Stream, which transfer_to_npu maps here, is one)."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = device
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> "Event":
        event = event if event is not None else Event()
        event.record(self)
        return event

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Stream)  # one stream: the program order

    def __hash__(self) -> int:
        return hash(Stream)


class Event(_EventBase):
    """An event on the program order; with enable_timing it records host wall time."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "Event") -> float:
        if not (self.enable_timing and end.enable_timing) or self._t is None or end._t is None:
            raise RuntimeError("torch.npu.Event.elapsed_time (NPU rehearsal stand-in): both events must be created "
                               "with enable_timing=True and recorded")
        return (end._t - self._t) * 1000.0


_DEFAULT_STREAM = Stream()


def current_stream(device: Any = None) -> Stream:
    return _DEFAULT_STREAM


def default_stream(device: Any = None) -> Stream:
    return _DEFAULT_STREAM


@contextlib.contextmanager
def stream(stream: Any) -> Iterator[None]:
    yield  # one stream, the program order


# The host's generator itself: torch.manual_seed seeds torch.cuda (which transfer_to_npu maps here) in turn.
def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def seed() -> None:
    torch.default_generator.seed()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device: Any = None) -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
    torch.set_rng_state(new_state)


default_generators = (torch.default_generator,)


def is_current_stream_capturing() -> bool:
    return False  # the host captures no graph (torch_npu: whether an NPUGraph capture is under way)


def set_compile_mode(jit_compile: bool = False) -> None:
    _state["compile_mode"] = bool(jit_compile)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise _platform.missing_operator(f"torch.npu.{name}")
