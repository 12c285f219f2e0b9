"""A request's KV moved between two ranks' paged caches through vLLM 0.9.1's real KVCacheManager and
Request (verl_patches/rollout/long_tail/kv_blocks.py): the rows arrive bit for bit in other blocks, the source's
blocks go back to its pool, and a full pool or a bad layout is an error naming it.

Stand-in, declared: the cache tensors are host tensors in vLLM's MLA layout (the worker's, which on a
device live in its memory); no scheduler, worker or device transfer takes part.
"""

from __future__ import annotations

import pytest
import torch

from verl_patches.rollout.long_tail import kv_blocks as kb

LAYERS, BLOCK, WIDTH, BLOCKS = 3, 4, 40, 12  # width: kv_lora_rank 32 + rope 8 (the tiny model's)


def _manager():
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=WIDTH, dtype=torch.bfloat16, use_mla=True)
    tensors = [KVCacheTensor(size=BLOCKS * spec.page_size_bytes, shared_by=[n]) for n in names]
    cfg = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=tensors,
                        kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)])
    # Prefix caching off, as the recipe's rollout runs.
    return KVCacheManager(cfg, max_model_len=64, enable_caching=False)


def _request(rid, prompt, output=()):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    r = Request(rid, list(prompt), None, None, None, SamplingParams(max_tokens=16), eos_token_id=1)
    if output:
        r.append_output_token_ids(list(output))
    return r


def _caches():
    return [torch.zeros(BLOCKS, BLOCK, WIDTH, dtype=torch.bfloat16) for _ in range(LAYERS)]


def test_a_requests_kv_moves_bit_for_bit_into_other_blocks():
    src, dst = _manager(), _manager()
    src_kv, dst_kv = _caches(), _caches()
    prompt, output = list(range(5, 12)), [40, 41, 42]  # 10 tokens: 3 blocks of 4
    # Another request holds the destination's first blocks: the moved one gets other block ids.
    assert dst.allocate_slots(_request("other", range(20, 29)), 9) is not None
    req = _request("r0", prompt, output)
    assert src.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens - 1  # the last sampled token is not computed yet
    src_ids = src.get_block_ids("r0")[0]
    g = torch.Generator().manual_seed(0)
    for c in src_kv:  # the whole cache random: rows of other blocks must not leak in
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    want = [c[torch.tensor(src_ids)].reshape(-1, WIDTH)[:9].clone() for c in src_kv]
    free_before = src.block_pool.get_num_free_blocks()

    payload = kb.export_request(src, req, src_kv)
    assert src.block_pool.get_num_free_blocks() == free_before + len(src_ids)  # the source let them go
    moved = _request("r0", prompt, output)
    dst_ids = kb.import_request(dst, moved, payload, dst_kv)
    assert moved.num_computed_tokens == 9 and set(dst_ids).isdisjoint(dst.get_block_ids("other")[0])
    assert dst_ids != src_ids
    got = kb.read_rows(dst_kv, dst_ids, 9)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert kb.move_bytes(dst_kv, 9) == LAYERS * 9 * WIDTH * 2 == sum(r.numel() * r.element_size() for r in got)
    # The next decode step allocates the next slot on the destination as for any running request.
    assert dst.allocate_slots(moved, 1) is not None


def test_a_full_pool_and_bad_layouts_are_named():
    dst, kv = _manager(), _caches()
    assert dst.allocate_slots(_request("hog", range(5, 45)), 40) is not None  # 10 of 12 blocks
    payload = {"num_tokens": 12, "rows": [torch.zeros(12, WIDTH, dtype=torch.bfloat16)] * LAYERS}
    with pytest.raises(kb.KVBlocksError, match="no free KV blocks for 12 tokens"):
        kb.import_request(dst, _request("big", range(5, 17)), payload, kv)
    with pytest.raises(kb.KVBlocksError, match="MLA layout"):
        kb.read_rows([torch.zeros(2, 3)], [0], 1)
    with pytest.raises(kb.KVBlocksError, match="need 2 blocks"):
        kb.read_rows(kv, [0], 5)
    with pytest.raises(kb.KVBlocksError, match="do not fit"):
        kb.write_rows(kv, [0], [torch.zeros(2, WIDTH, dtype=torch.float32)] * LAYERS)
