"""The CPU generation stand-in (verl_patches/rigs/cpu/engine.py) returns the sampled tokens' log-probs in
vLLM's form and with vLLM 0.9.1's V1 definition: log-softmax in float32 of the raw logits, before
temperature and top-k / top-p. Checked against an independent full-sequence forward of transformers'
DeepseekV3 (no KV cache, no padding) over the same tokens.

Stand-in: the generator's model loading (_Generator._load_hf gathers the rollout shards of every
rank; here the model is built directly) and vLLM's config object (only hf_config is read).
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from tests.helpers import REPO
from verl_patches.rigs.cpu import engine

PROMPTS = [[5, 17, 42, 9], [3, 8], [11, 12, 13, 14, 15, 16]]  # different lengths


def _model(dtype):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = json.loads((REPO / "configs" / "model" / "tiny_deepseek_v3.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version", "torch_dtype")}
    cfg["num_hidden_layers"] = 2
    config = DeepseekV3Config(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # sharper distributions than the initialisation's near-uniform ones
        model.lm_head.weight.mul_(40)
    return model


def _params(**kw):
    from vllm import SamplingParams

    base = dict(n=2, temperature=0.7, top_k=20, top_p=0.9, max_tokens=6, ignore_eos=True, logprobs=0)
    base.update(kw)
    return SamplingParams(**base)


def _generator(model):
    gen = object.__new__(engine._Generator)
    gen.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(
        hf_config=types.SimpleNamespace(eos_token_id=1, pad_token_id=0)),
        scheduler_config=types.SimpleNamespace(max_num_seqs=256))
    gen._load_hf = lambda: model
    return gen


# float32: the cached incremental forward and the full one differ in summation order only (2.6e-6
# measured on an AMD EPYC, 4.05e-6 on an AVX-512 Intel Xeon: the kernels choose the order by shape).
# bfloat16 (the tiny run's dtype): identical here (0 measured); the bound leaves room for a different
# rounding of the two forwards.
TOL_BF16 = 1e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, TOL_BF16)])
def test_sampled_logprobs_are_log_softmax_of_the_raw_logits(dtype, tol):
    from vllm.sequence import Logprob

    model = _model(dtype)
    params = _params()
    torch.manual_seed(1)
    outputs = _generator(model).generate(PROMPTS, [params] * len(PROMPTS))
    checked, worst = 0, 0.0
    for prompt, out in zip(PROMPTS, outputs):
        assert len(out.outputs) == params.n
        for sample in out.outputs:
            tokens = list(sample.token_ids)
            assert len(sample.logprobs) == len(tokens) == params.max_tokens
            # verl's read (vllm_rollout_spmd.py): logprobs[i][token_ids[i]].logprob
            got = torch.tensor([sample.logprobs[i][t].logprob for i, t in enumerate(tokens)])
            assert all(isinstance(d[t], Logprob) and list(d) == [t] for d, t in zip(sample.logprobs, tokens))
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(got, want, rtol=0, atol=tol)
            tempered = torch.log_softmax(logits.float() / params.temperature, -1).gather(
                -1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
            assert (got - tempered).abs().max() > 0.05  # before temperature, as vLLM's V1 sampler
            worst = max(worst, float((got - want).abs().max()))
            ranks = [sample.logprobs[i][t].rank for i, t in enumerate(tokens)]
            if dtype == torch.float32:  # (bfloat16 ties and near-ties reorder)
                # The rank counts the tokens above the sampled one; a token within the forwards'
                # difference (tol) of it may fall on either side, so the rank lies in a band.
                for i in range(len(tokens)):
                    full = torch.log_softmax(logits[i].float(), -1)
                    low, high = int((full > want[i] + tol).sum()) + 1, int((full > want[i] - tol).sum()) + 1
                    assert low <= ranks[i] <= high, (i, ranks[i], low, high)
            assert all(r <= params.top_k for r in ranks)  # top-k sampled
            assert sample.cumulative_logprob == pytest.approx(float(got.sum()), rel=1e-6)
            checked += 1
    assert checked == len(PROMPTS) * params.n
    print(f"{dtype}: largest |stand-in - full forward| log-prob difference {worst:.2e}")


def test_no_logprobs_unless_asked():
    outputs = _generator(_model(torch.float32)).generate(PROMPTS[:1], [_params(logprobs=None, n=1)])
    assert outputs[0].outputs[0].logprobs is None and outputs[0].outputs[0].cumulative_logprob is None
