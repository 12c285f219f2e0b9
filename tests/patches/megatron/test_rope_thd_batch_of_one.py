"""patch megatron.rope_thd_batch_of_one, on megatron-core 0.12.1's real rope_utils (CPU).

MindSpeed-LLM's latent attention hands packed sequences' rotary parts over as [tokens, 1, heads, dim]; the NPU's
rotary kernel (behind _apply_rotary_pos_emb_bshd there) takes 4-D pieces. Checked here: every piece the wrapped
helper hands on is 4-D, and the result is upstream's for the same RoPE, bit for bit; other shapes untouched. The
kernel itself runs only on the NPU (its documented shape rule is the rehearsal's stand-in's:
verl_patches/rigs/npu_rehearsal/ops/rotary.py, npu_rotary_position_embedding)."""

from __future__ import annotations

import pytest
import torch

from verl_patches.patches.megatron.patch_core_models_common_embeddings_rope_utils import wrap_apply_rotary_pos_emb_thd


@pytest.fixture
def rope(monkeypatch):
    ru = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: 0)
    seen = []
    bshd = ru._apply_rotary_pos_emb_bshd

    def recording(t, *args, **kwargs):
        seen.append(t.dim())
        return bshd(t, *args, **kwargs)

    monkeypatch.setattr(ru, "_apply_rotary_pos_emb_bshd", recording)
    return ru, seen


def test_a_batch_dimension_of_one_is_dropped_around_the_split(rope):
    ru, seen = rope
    g = torch.Generator().manual_seed(0)
    t = torch.randn(12, 1, 4, 8, generator=g)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    freqs = torch.randn(16, 1, 1, 8, generator=g)
    wrapped = wrap_apply_rotary_pos_emb_thd(ru._apply_rotary_pos_emb_thd)

    out = wrapped(t, cu, freqs)
    assert seen == [4, 4] and out.shape == t.shape
    assert torch.equal(out.squeeze(1), ru._apply_rotary_pos_emb_thd(t.squeeze(1), cu, freqs))
    seen.clear()
    with pytest.raises(RuntimeError):  # upstream with MindSpeed-LLM's shape: a 5-D piece, which it cannot take
        ru._apply_rotary_pos_emb_thd(t, cu, freqs, multi_latent_attention=True)
    assert seen[0] == 5

    seen.clear()
    three = t.squeeze(1)  # megatron-core's own latent attention: unchanged
    assert torch.equal(wrapped(three, cu, freqs), ru._apply_rotary_pos_emb_thd(three, cu, freqs)) and seen == [4, 4, 4, 4]
