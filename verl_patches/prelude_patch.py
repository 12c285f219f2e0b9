"""The single hook. ``from verl_patches import prelude_patch`` applies this process's patches.

This is the only module of the package whose import changes anything. Put the line at the
end of verl/workers/megatron_workers.py (``python -m verl_patches hook install`` does it).
"""

from verl_patches.prelude import apply_prelude

APPLIED: list[str] = apply_prelude()
