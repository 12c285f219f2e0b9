"""vLLM's model-class inspection in the calling process (CPU platform only).

Upstream: vllm/model_executor/models/registry.py:_LazyRegisteredModel.inspect_model_cls reads a model
class's interfaces (is it multimodal, pooling, does it support pipeline parallelism, ...) in a fresh
interpreter (``python -m vllm.model_executor.models.registry``), so that importing the model's module
cannot initialise CUDA in the process that will later fork vLLM's workers. Every process that builds a
vLLM ModelConfig pays it once: the interpreter imports vLLM whole and runs the general plugins (this
overlay's prelude among them). Measured on the 2-core CI machine: 13 s of CPU per process, while the
inspected import itself is about a second. On the CPU platform there is no device runtime to
initialise, so the replacement imports the class here and reads the same ``_ModelInfo`` from it
(vLLM's own ``_ModelInfo.from_model_cls``, which the subprocess calls too). Every Ray worker of a tiny
run and every test rank that builds a vLLM config saves the interpreter.
"""

from __future__ import annotations

from typing import Any

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def inspect_model_cls(self: Any) -> Any:
    """The model class's ``_ModelInfo``, read in this process (``self``: vLLM's _LazyRegisteredModel)."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from vllm.model_executor.models.registry import _ModelInfo

    return _ModelInfo.from_model_cls(self.load_model_cls())


PATCHES = [
    Patch(
        feature="cpu_platform",
        id="cpu.vllm.inspect_model_in_process",
        target="vllm.model_executor.models.registry:_LazyRegisteredModel.inspect_model_cls",
        kind="replace",
        phases=("driver", "worker", "engine_core"),
        upstream="vllm",
        versions="==0.9.1",
        fingerprint=Fingerprint("def inspect_model_cls(self) -> _ModelInfo", "c87a38e177fbc04e"),
        replacement=f"{__name__}:inspect_model_cls",
        flag="the CPU platform (no device runtime to protect)",
        why="Each process that builds a vLLM model config starts an interpreter to read the model class's "
            "interfaces (13 s of CPU on the CI machine), only to keep CUDA uninitialised in the caller; the "
            "CPU platform has no CUDA. Every tiny-run worker and every test rank building a vLLM config pays it.",
        remove_when="vLLM caches the inspected model info across processes, or inspects in-process on "
                    "platforms without a device runtime.",
        platforms=("cpu",),
    ),
]
