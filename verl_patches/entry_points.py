"""The entry points that reach every process, and what they run: apply the patches of the current
process phase (``apply_prelude``, verl_patches/prelude.py). Importing this module applies nothing
(``prelude_patch`` is the one module whose import does).

Three ways in, all idempotent: ``from verl_patches import prelude_patch`` (the line users add
to verl's worker module, which every Ray worker imports), vLLM's general-plugin entry point
(vLLM calls it in each process it starts), and a Ray ``worker_process_setup_hook``.
"""

from __future__ import annotations

from verl_patches.prelude import apply_prelude


def vllm_plugin() -> None:
    """vLLM general plugin (entry point group ``vllm.general_plugins``)."""
    apply_prelude()


def ray_setup_hook() -> None:
    """For ``ray.init(runtime_env={"worker_process_setup_hook": "verl_patches.entry_points.ray_setup_hook"})``."""
    apply_prelude()
