"""Patch overlay for GRPO post-training of DeepSeek-V3 with verl, Megatron and vLLM.

Importing this package (or any module of it but ``prelude_patch``) changes nothing;
``from verl_patches import prelude_patch`` applies the patches of the current process.
"""

import importlib
import sys

__version__ = "0.1.0"


def lazy_names(package: str, where: dict[str, str]):
    """``(__all__, __getattr__, __dir__)`` for ``package`` whose public names, each in the module ``where``
    gives, are imported on first use (PEP 562): reading the package needs none of its modules' imports
    (the doctor reads the patch catalogue without torch). The one implementation of the subpackages' facades."""
    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return sorted(where), __getattr__, __dir__
