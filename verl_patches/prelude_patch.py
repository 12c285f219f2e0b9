"""The single hook. ``from verl_patches import prelude_patch`` applies this process's patches.

This is the only module of the package whose import changes anything. Put the line at the
end of verl/workers/megatron_workers.py (``python -m verl_patches hook install`` does it).
One line on stderr per process says what was applied (Ray forwards it to the driver's log).
"""

import sys

from verl_patches.prelude import apply_prelude

APPLIED: list[str] = apply_prelude()

if APPLIED:
    from verl_patches.base import accelerator
    from verl_patches.core.phase import current_phase

    print(f"verl_patches: applied {len(APPLIED)} patch(es) for the {current_phase()} phase on the "
          f"{accelerator.device_type()} platform (python -m verl_patches patches lists them)",
          file=sys.stderr, flush=True)
    from verl_patches.rigs import npu_rehearsal

    if npu_rehearsal.selected():
        print(f"verl_patches: {npu_rehearsal.describe()}", file=sys.stderr, flush=True)
