"""The NPU path on the NPU rehearsal platform in verl 0.4.1's worker order, run as its own process (see
npu_path_build.py for why a process of its own).

The order of a Ray rank of the recipe: verl's worker module imported (verl decides its device: npu), the overlay's
prelude at its end (the line `hook install` adds there: the worker phase's records for the rehearsal, then
MindSpeed-LLM's adaptor, verl_patches.prelude.apply_prelude), then verl's own
ActorRolloutRefWorker.__init__ (torch.distributed on "hccl" -- gloo under the stand-in --, megatron's parallel
groups, set_random_seed -> megatron-core's model_parallel_cuda_manual_seed), then the build's first step,
_init_hf_config_and_tf_config (the binding: Megatron's global arguments from verl's config through MindSpeed-LLM's
parser, MindSpeed-LLM's features re-selected from that command line), verl's init_mcore_model with MindSpeed-LLM's
spec, and verl's megatron actor module imported (its pad/unpad helpers). One forward and backward in bf16
(Float16Module, as verl's get_model wraps it). Prints one JSON line. Run with the stand-in's site on PYTHONPATH
(tests/npu_rehearsal/test_platform.py).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def config(model_dir: Path):
    import verl
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/ppo_megatron_trainer.yaml")
    OmegaConf.set_struct(cfg, False)
    for key, value in {"data.max_prompt_length": 32, "data.max_response_length": 32,
                       "actor_rollout_ref.model.path": str(model_dir),
                       "actor_rollout_ref.actor.megatron.sequence_parallel": False,
                       "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.rollout.n": 1,
                       "actor_rollout_ref.rollout.recipe": {"megatron": {}}}.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg.actor_rollout_ref


def build_model(model_dir: Path | None = None):
    """The NPU model as verl's worker builds it (the order above), for the HF model directory ``model_dir``
    (default: a fresh one holding the tiny config); returns (what was seen on the way, the worker, the model,
    the HF config)."""
    os.environ.setdefault("VERL_PATCHES_PHASE", "worker")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(key, value)  # what Ray's worker group sets for verl's Worker (env:// rendezvous)
    if model_dir is None:
        model_dir = Path(tempfile.mkdtemp(prefix="npu_path_model_"))
        (model_dir / "config.json").write_text((REPO / "configs/model/tiny_deepseek_v3.json").read_text())

    import verl.workers.megatron_workers as workers  # verl decides its device here (npu under the stand-in)
    from verl_patches import prelude_patch  # the hook line at the end of verl's worker module

    from verl.utils import device

    seen = {"verl_device": device.get_device_name(), "applied": prelude_patch.APPLIED,
            "mindspeed_llm_at_rank_start": "mindspeed_llm" in sys.modules}
    import torch

    worker = workers.ActorRolloutRefWorker(config(model_dir), role="actor_rollout")  # seeds megatron-core
    from megatron.core import tensor_parallel

    seen["rng_tracker"] = sorted(tensor_parallel.get_cuda_rng_tracker().get_states())
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = types.SimpleNamespace(bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"], pad_token_id=1)
    worker._init_hf_config_and_tf_config(str(model_dir), tok, torch.bfloat16, {}, {}, False)
    import verl.workers.actor.megatron_actor  # noqa: F401  (the records the prelude applied there imported it)
    from verl.models.mcore.registry import init_mcore_model

    model = init_mcore_model(worker.tf_config, worker.hf_config, pre_process=True, post_process=True)
    return seen, worker, model, cfg


def main() -> None:
    import torch

    seen, worker, model, cfg = build_model()
    classes = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()})
    from megatron.core.transformer.module import Float16Module
    from megatron.training import get_args

    wrapped = Float16Module(worker.tf_config, model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (1, 16), generator=g)
    mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
    out = wrapped(input_ids=ids, position_ids=torch.arange(16).unsqueeze(0), attention_mask=mask)
    out.float().logsumexp(-1).mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    import flash_attn

    print("RESULT " + json.dumps({
        **seen, "classes": classes, "shape": list(out.shape), "finite": bool(torch.isfinite(out).all()),
        "no_grad": no_grad, "params": {n: list(p.shape) for n, p in model.named_parameters()},
        "seq_length": get_args().seq_length, "spec": list(get_args().spec),
        "flash_attn_is_package": hasattr(flash_attn, "__path__"),
    }))


if __name__ == "__main__":
    main()
