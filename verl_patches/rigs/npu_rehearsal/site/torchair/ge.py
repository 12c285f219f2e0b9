"""STAND-IN for ``torchair.ge`` (NPU rehearsal platform): the names graph-mode converters are annotated with.
No GE graph is built on the host: the classes cannot be instantiated and every operation raises."""

from __future__ import annotations


class _GraphOnly:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"torchair.ge.{type(self).__name__}: GE graph mode is not available on the NPU "
                                  "rehearsal platform (the torchair stand-in compiles no graph)")


class Tensor(_GraphOnly):
    pass


class TensorSpec(_GraphOnly):
    pass


class DataType:
    """GE data types: referenced in converter bodies only, which never run on the host."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    # AttributeError, as for any missing attribute: MindSpeed's patch manager probes every module with hasattr.
    raise AttributeError(f"torchair.ge.{name}: GE graph mode is not available on the NPU rehearsal platform")
