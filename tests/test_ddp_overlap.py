"""The recipe's DDP overlap settings (verl_patches/train/ddp_overlap.py): read one way, turned into megatron-core's
DistributedDataParallelConfig with what it needs, and refused by name where they cannot work. The
multi-process proof on real megatron-core is tests/patches/verl/test_ddp_overlap.py."""

from __future__ import annotations

import contextlib
import types

import pytest
from omegaconf import OmegaConf

from verl_patches.train import ddp_overlap as D
from verl_patches.config import settings


def _worker(**recipe):
    return OmegaConf.create({"rollout": {"recipe": recipe}})


def test_default_is_upstreams_ddp():
    o = D.DdpOverlap.from_worker(_worker())
    assert o == D.DdpOverlap(False, False) and not o.on
    assert D.ddp_config_values(o, use_distributed_optimizer=True, num_chunks=1) == {
        "grad_reduce_in_fp32": True, "use_distributed_optimizer": True, "overlap_grad_reduce": False,
        "overlap_param_gather": False, "align_param_gather": False}


def test_the_recipe_keys_become_the_ddp_config_and_are_real_fields():
    from megatron.core.distributed import DistributedDataParallelConfig

    o = D.DdpOverlap.from_worker(_worker(overlap_grad_reduce=True, overlap_param_gather=True))
    one = D.ddp_config_values(o, use_distributed_optimizer=True, num_chunks=1)
    assert one["overlap_grad_reduce"] and one["overlap_param_gather"] and not one["align_param_gather"]
    # Virtual pipeline chunks: the interleaved schedule dispatches the gathers through param_sync_func.
    assert D.ddp_config_values(o, use_distributed_optimizer=True, num_chunks=2)["align_param_gather"]
    cfg = DistributedDataParallelConfig(**one)
    assert cfg.overlap_grad_reduce and cfg.overlap_param_gather and cfg.use_distributed_optimizer


def test_param_gather_without_the_distributed_optimizer_is_refused_by_name():
    o = D.DdpOverlap(overlap_param_gather=True)
    with pytest.raises(D.DdpOverlapError, match="overlap_param_gather needs actor_rollout_ref.actor.megatron."
                                                "use_distributed_optimizer=True"):
        D.ddp_config_values(o, use_distributed_optimizer=False, num_chunks=1)
    # The gradient overlap alone works without it (all-reduce buckets).
    assert D.ddp_config_values(D.DdpOverlap(overlap_grad_reduce=True), use_distributed_optimizer=False,
                               num_chunks=1)["overlap_grad_reduce"]
    with pytest.raises(D.DdpOverlapError, match="use_distributed_optimizer must be true or false"):
        D.ddp_config_values(o, use_distributed_optimizer="yes", num_chunks=1)


@pytest.mark.parametrize("key", D.KEYS)
def test_a_quoted_boolean_is_named(key):
    with pytest.raises(settings.SettingsError, match=rf"recipe\.{key} must be true or false, got the string 'true'"):
        D.DdpOverlap.from_worker(_worker(**{key: "true"}))


class _Chunk:
    def __init__(self, **ddp):
        self.ddp_config = types.SimpleNamespace(**{"overlap_grad_reduce": False, "overlap_param_gather": False,
                                                   "align_param_gather": False, **ddp})

    @contextlib.contextmanager
    def no_sync(self):
        yield

    def start_grad_sync(self, *a):
        pass

    def start_param_sync(self, *a, **k):
        pass


def test_the_schedules_hooks_are_set_as_megatrons_training_loop_sets_them():
    cfg = types.SimpleNamespace(no_sync_func=None, grad_sync_func=None, param_sync_func=None)
    c = _Chunk(overlap_grad_reduce=True, overlap_param_gather=True)
    assert D.wire_sync_funcs(cfg, [c]) == ["grad_sync_func", "no_sync_func"]
    assert cfg.no_sync_func.fn == c.no_sync and cfg.grad_sync_func.fn == c.start_grad_sync and cfg.param_sync_func is None
    with cfg.no_sync_func():  # the hook calls through
        pass
    two = [_Chunk(overlap_grad_reduce=True, overlap_param_gather=True, align_param_gather=True) for _ in range(2)]
    cfg2 = types.SimpleNamespace(no_sync_func=None, grad_sync_func=None, param_sync_func=None)
    assert D.wire_sync_funcs(cfg2, two) == ["grad_sync_func", "no_sync_func", "param_sync_func"]
    assert isinstance(cfg2.param_sync_func, list) and [h.fn for h in cfg2.param_sync_func] == [x.start_param_sync for x in two]


@pytest.mark.parametrize("chunks", [1, 2])
def test_the_wired_config_survives_verls_checkpoint_dict(chunks):
    """verl's MegatronCheckpointManager.save_checkpoint: asdict(transformer_config) (a deep copy of every
    value), then drops callables and writes JSON. A bound DDP method would deep-copy its module."""
    import dataclasses
    import json

    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    cs = [_Chunk(overlap_grad_reduce=True, overlap_param_gather=True, align_param_gather=chunks > 1)
          for _ in range(chunks)]
    for c in cs:
        c.buffer = torch.ones(2, requires_grad=True) * 2  # a non-leaf tensor: deepcopy refuses it
    with pytest.raises(RuntimeError, match="deepcopy"):
        import copy

        copy.deepcopy(cs[0].no_sync)
    D.wire_sync_funcs(tc, cs)
    d = dataclasses.asdict(tc)
    assert all(callable(d[k]) for k in ("no_sync_func", "grad_sync_func"))
    from megatron.core.transformer.enums import AttnBackend

    # verl's filter: dtypes and the attention backend as strings, callables dropped; the rest is JSON.
    json.dumps({k: str(v) if isinstance(v, (torch.dtype, AttnBackend)) else v for k, v in d.items() if not callable(v)})
    if chunks > 1:
        with pytest.raises(TypeError, match="per-chunk sync hooks"):
            tc.param_sync_func()


def test_a_hook_someone_else_set_is_not_replaced():
    cfg = types.SimpleNamespace(no_sync_func=contextlib.nullcontext, grad_sync_func=None, param_sync_func=None)
    with pytest.raises(D.DdpOverlapError, match="no_sync_func is already set"):
        D.wire_sync_funcs(cfg, [_Chunk(overlap_grad_reduce=True)])


def test_pending_communication_names_each_unsettled_bucket():
    group = types.SimpleNamespace(grad_reduce_handle=object(), param_gather_handle=None, param_gather_dispatched=False)
    chunk = _Chunk(overlap_param_gather=True, use_distributed_optimizer=True)
    chunk.bucket_groups, chunk.expert_parallel_bucket_groups = [group], []
    problems = D.pending_communication([chunk])
    assert problems == ["chunk 0 DDP bucket group 0: a gradient reduce is in flight (finish_grad_sync not reached)",
                        "chunk 0 DDP bucket group 0: parameters not gathered since the last optimizer step "
                        "(verl_patches.train.ddp_overlap.complete_param_gather was not run)"]
    with pytest.raises(D.DdpOverlapError, match="moving: megatron-core's overlapped DDP communication is not settled"):
        D.check_settled([chunk], "moving")
    group.grad_reduce_handle, group.param_gather_dispatched = None, True
    assert D.pending_communication([chunk]) == []
