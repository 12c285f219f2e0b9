"""Load a converted checkpoint into a real megatron-core 0.12 GPTModel (MLA + MoE, local spec) on CPU; print a JSON verdict.

Run as a script in its own process (it initialises torch.distributed). Fakes, only where CPU cannot run the real thing:
torch.cuda.current_device/synchronize return CPU answers, and the parameter-free core attention is a stub (the local
DotProductAttention in 0.12.1 does not accept MLA's arguments); every module holding weights is megatron's own.
"""

import json
import os
import sys
from pathlib import Path

import torch


def build_model(cfg: dict):
    # The binding tests' builder: megatron-core's own modules, local spec, SequentialMLP experts.
    from verl_patches.rigs.testing.live_models import build_megatron_deepseek

    return build_megatron_deepseek(cfg, torch.bfloat16, grouped=False)


def main(ckpt: str, hf: str) -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[3] if len(sys.argv) > 3 else "29517")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import StrictHandling

    ps.initialize_model_parallel(1, 1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from verl_patches.tools.hf_to_mcore import HFSource, build, load_hf_index, unit_plan, units

    cfg, weight_map = load_hf_index(Path(hf))
    model = build_model(cfg)
    for p in model.parameters():
        p.data.zero_()
    # What verl's load_mcore_dist_weights does.
    dist_checkpointing.load(model.sharded_state_dict(), ckpt, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    sd = model.state_dict()
    # Megatron's SequentialMLP holds experts as local_experts.<i>; our names use the checkpoint's expert axis.
    from contextlib import ExitStack

    src = HFSource(Path(hf), weight_map)
    checked, bad, covered = 0, [], set()
    for unit in units(cfg):
        with ExitStack() as stack:
            plan = unit_plan(cfg, unit, "local")
            get = src.open([s for _, srcs, _ in plan for s in srcs], stack)
            for name, srcs, how in plan:
                want = build(how, srcs, get)
                if ".experts.experts." in name:
                    base, leaf = name.split(".experts.experts.")
                    keys = [f"{base}.experts.local_experts.{x}.{leaf}" for x in range(want.shape[0])]
                    got = torch.stack([sd[k] for k in keys])
                    covered.update(keys)
                else:
                    got = sd[name]
                    covered.add(name)
                checked += 1
                if not torch.equal(got.to(want.dtype), want):
                    bad.append(name)
    params = {k for k, v in sd.items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    print(json.dumps({"checked": checked, "bad": bad, "model_tensors": len(params),
                      "not_covered": sorted(params - covered)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
