"""STAND-IN for ``torch_npu._C`` (NPU rehearsal platform): only what the path reads (``_distributed_c10d``)."""

from verl_patches.rigs import npu_rehearsal as _platform

from . import _distributed_c10d  # noqa: F401


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise _platform.missing_operator(f"torch_npu._C.{name}")
