"""Run the HF -> Megatron converter in a fresh process and report its peak host memory above the post-import baseline.

Usage: python rss_probe.py HF_DIR OUT_DIR; prints JSON {baseline, peak, delta} in bytes. The peak is this
process's VmHWM, reset after the imports (not ru_maxrss, which a forked child inherits from its parent).
"""

import json
import sys
from pathlib import Path


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    # Everything the converter imports, before the baseline: imports are a constant, not model memory.
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.checkpoint.filesystem  # noqa: F401
    import tqdm  # noqa: F401

    from verl_patches.tools import hf_to_mcore
    from verl_patches.tools.mcore_layout import CheckpointLayout, dcp_classes

    dcp_classes()
    # "5" resets the peak-RSS counter (VmHWM) to the current RSS (Linux proc(5), clear_refs).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = status_kb("VmRSS")
    hf_to_mcore.convert(Path(sys.argv[1]), Path(sys.argv[2]), CheckpointLayout(2, 2, 2, None, True), progress=False, verify=True)
    peak = status_kb("VmHWM")
    print(json.dumps({"baseline": baseline, "peak": peak, "delta": peak - baseline}))


if __name__ == "__main__":
    main()
