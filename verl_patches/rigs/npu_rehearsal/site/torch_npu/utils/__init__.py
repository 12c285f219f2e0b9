"""STAND-IN for ``torch_npu.utils`` (NPU rehearsal platform): only ``collect_env``, imported on demand."""

from verl_patches.rigs import npu_rehearsal as _platform


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise _platform.missing_operator(f"torch_npu.utils.{name}")
