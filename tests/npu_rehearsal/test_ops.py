"""The rehearsal platform's torch_npu operators and MindSpeed kernels, each against a plain-torch
reference written independently from the documentation: explicit per-row / per-head / per-token
loops or the textbook formula, never the module's own code path. fp32 comparisons use tight
tolerances; bf16 ones (the path runs bf16) allow bf16 rounding of the output. Backwards are checked
with gradcheck in float64 on tiny shapes and against autograd of the reference.
"""

import inspect
import math
import re

import pytest
import torch

from verl_patches.rigs.npu_rehearsal import ops

EXERCISED: set = set()
"""What the tests below exercise: torch_npu names and "builder:function" MindSpeed kernels."""


def exercises(*names):
    """Records what the decorated test exercises; each operator's name (a kernel's function name)
    must appear in the test's body, so a record cannot stand for a test that never calls it."""
    def record(test):
        source = inspect.getsource(test)
        body = source[re.search(r"^\s*def ", source, re.MULTILINE).start():]
        for name in names:
            assert name.split(":")[-1] in body, f"{test.__name__} records {name} but never names it"
        EXERCISED.update(names)
        return test
    return record


def close(actual, expected, dtype=torch.float32):
    tol = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-10, 1e-10),
           torch.bfloat16: (2e-2, 2e-2)}[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol[0], atol=tol[1])


def gradcheck(fn, inputs):
    """torch's gradcheck (float64 inputs), fast mode: a random projection of the Jacobian."""
    return torch.autograd.gradcheck(fn, inputs, fast_mode=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --------------------------------------------------------------------------- RMSNorm

def rms_norm_reference(x, gamma, eps):
    """Per row of the normalised trailing dims: x / sqrt(||x||^2 / n + eps) * gamma."""
    lead = x.shape[:x.dim() - gamma.dim()]
    rows = x.double().reshape(-1, gamma.numel())
    out = []
    for row in rows:
        rms = math.sqrt(float(torch.dot(row, row)) / row.numel() + eps)
        out.append(row / rms * gamma.double().reshape(-1))
    return torch.stack(out).reshape(*lead, *gamma.shape)


@exercises("npu_rms_norm")
@pytest.mark.parametrize("gamma_dims", [1, 2])
def test_rms_norm_matches_reference(gamma_dims):
    x = torch.randn(3, 4, 6)
    gamma = torch.randn(x.shape[3 - gamma_dims:])
    y, rstd = ops.npu_rms_norm(x, gamma, epsilon=1e-5)
    close(y, rms_norm_reference(x, gamma, 1e-5))
    assert rstd.dtype == torch.float32
    assert rstd.shape == x.shape[:3 - gamma_dims] + (1,) * gamma_dims
    mean_square = x.reshape(*x.shape[:3 - gamma_dims], -1).square().mean(-1)
    close(rstd.reshape(mean_square.shape), 1 / torch.sqrt(mean_square + 1e-5))
    xb, gb = x.bfloat16(), gamma.bfloat16()
    yb = ops.npu_rms_norm(xb, gb)[0]
    assert yb.dtype == torch.bfloat16
    close(yb, rms_norm_reference(xb, gb, 1e-6), torch.bfloat16)


@exercises("npu_rms_norm")
def test_rms_norm_backward():
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    gamma = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda a, g: ops.npu_rms_norm(a, g, 1e-3)[0], (x, gamma))


@exercises("npu_rms_norm")
def test_rms_norm_rejects_bad_input():
    with pytest.raises(ValueError, match="gamma's shape"):
        ops.npu_rms_norm(torch.randn(2, 4), torch.randn(3))
    with pytest.raises(ValueError, match="epsilon"):
        ops.npu_rms_norm(torch.randn(2, 4), torch.randn(4), epsilon=-1.0)


# --------------------------------------------------------------------------- rotary

def rope_reference(x, cos, sin, interleaved):
    """Element by element: each rotated pair (a, b) becomes (a cos - b sin, b cos + a sin)."""
    cos, sin = cos.expand_as(x), sin.expand_as(x)
    d = x.shape[-1]
    out = torch.zeros_like(x)
    pairs = [(2 * j, 2 * j + 1) for j in range(d // 2)] if interleaved else \
        [(j, j + d // 2) for j in range(d // 2)]
    for a, b in pairs:
        out[..., a] = x[..., a] * cos[..., a] - x[..., b] * sin[..., a]
        out[..., b] = x[..., b] * cos[..., b] + x[..., a] * sin[..., b]
    return out


def _angles(s, d, dtype=torch.float32):
    theta = torch.randn(s, 1, 1, d, dtype=dtype)
    return theta.cos(), theta.sin()


@exercises("npu_rotary_mul")
@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_matches_reference(mode):
    x = torch.randn(5, 2, 3, 8)
    cos, sin = _angles(5, 8)
    out = ops.npu_rotary_mul(x, cos, sin, rotary_mode=mode)
    close(out, rope_reference(x, cos, sin, mode == "interleave"))
    if mode == "half":
        close(ops.npu_rotary_mul(x, cos, sin), out)
    close(ops.npu_rotary_mul(x.bfloat16(), cos.bfloat16(), sin.bfloat16(), mode),
          rope_reference(x, cos, sin, mode == "interleave"), torch.bfloat16)


@exercises("npu_rotary_mul")
def test_rotary_mul_backward():
    x = torch.randn(3, 1, 2, 4, dtype=torch.float64, requires_grad=True)
    cos, sin = _angles(3, 4, torch.float64)
    assert gradcheck(lambda t: ops.npu_rotary_mul(t, cos, sin), (x,))


@exercises("npu_rotary_mul")
def test_rotary_mul_rejects_bad_input():
    cos, sin = _angles(5, 8)
    with pytest.raises(ValueError, match="rotary_mode"):
        ops.npu_rotary_mul(torch.randn(5, 2, 3, 8), cos, sin, rotary_mode="full")
    with pytest.raises(ValueError, match="4 dimensions"):
        ops.npu_rotary_mul(torch.randn(5, 3, 8), cos, sin)
    with pytest.raises(ValueError, match="broadcast"):
        ops.npu_rotary_mul(torch.randn(4, 2, 3, 8), cos, sin)


@exercises("npu_rotary_position_embedding",
           "npu_rotary_position_embedding:npu_rotary_position_embedding")
@pytest.mark.parametrize("mode", [0, 1])
def test_rotary_position_embedding_matches_reference(mode):
    x = torch.randn(2, 3, 5, 6)
    theta = torch.randn(1, 1, 5, 6)
    kernel = ops.MINDSPEED_KERNELS["npu_rotary_position_embedding"]["npu_rotary_position_embedding"]
    for fn in (ops.OPERATORS["npu_rotary_position_embedding"], kernel):
        close(fn(x, theta.cos(), theta.sin(), mode),
              rope_reference(x, theta.cos(), theta.sin(), mode == 1))
    xd = torch.randn(2, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    angle = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    assert gradcheck(
        lambda t: kernel(t, angle.cos(), angle.sin(), mode), (xd,))
    with pytest.raises(ValueError, match="mode must be 0"):
        kernel(x, theta.cos(), theta.sin(), 2)
    with pytest.raises(ValueError, match="even"):
        kernel(torch.randn(1, 1, 5, 5), torch.randn(1, 1, 5, 5), torch.randn(1, 1, 5, 5))


# --------------------------------------------------------------------------- SwiGLU

def swiglu_reference(x, dim):
    half = x.shape[dim] // 2
    a, b = x.narrow(dim, 0, half), x.narrow(dim, half, half)
    return a / (1 + torch.exp(-a)) * b


@exercises("npu_swiglu", "npu_swiglu_backward")
@pytest.mark.parametrize("dim", [-1, 0])
def test_swiglu_and_its_backward_match_reference(dim):
    x = torch.randn(4, 6, requires_grad=True)
    out = ops.npu_swiglu(x, dim=dim)
    expected = swiglu_reference(x, dim)
    close(out, expected)
    close(ops.npu_swiglu(x.bfloat16(), dim), expected.detach(), torch.bfloat16)
    grad = torch.randn_like(expected)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    close(ops.npu_swiglu_backward(grad, x.detach(), dim), expected_grad)
    xd = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: ops.npu_swiglu(t, dim=dim), (xd,))


@exercises("npu_swiglu", "npu_swiglu_backward")
def test_swiglu_rejects_bad_input():
    with pytest.raises(ValueError, match="even"):
        ops.npu_swiglu(torch.randn(2, 5))
    with pytest.raises(ValueError, match="dim must be"):
        ops.npu_swiglu(torch.randn(2, 4), dim=2)
    with pytest.raises(ValueError, match="halved"):
        ops.npu_swiglu_backward(torch.randn(2, 4), torch.randn(2, 4))


# --------------------------------------------------------------------------- scaled masked softmax

def masked_softmax_reference(x, mask, scale):
    z = x.double() * scale
    z = torch.where(mask.expand_as(z), torch.full_like(z, -10000.0), z)
    e = torch.exp(z - z.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


@exercises("npu_scaled_masked_softmax")
def test_scaled_masked_softmax_matches_reference():
    x = torch.randn(2, 2, 32, 64)
    mask = torch.rand(1, 2, 32, 64) < 0.3
    mask[0, 0, 3] = True  # a fully hidden row: uniform over the -10000 fills
    out = ops.npu_scaled_masked_softmax(x, mask, 0.5, False)
    close(out, masked_softmax_reference(x, mask, 0.5))
    close(out[:, 0, 3], torch.full((2, 64), 1 / 64))
    # The fill is the constant -10000, not -inf: it outweighs visible scores far below it.
    low = torch.full((1, 1, 32, 32), -30000.0)
    low_mask = torch.zeros(1, 1, 32, 32, dtype=torch.bool)
    low_mask[..., 5] = True
    close(ops.npu_scaled_masked_softmax(low, low_mask, 1.0)[0, 0, :, 5], torch.ones(32))
    triu = torch.ones(32, 64, dtype=torch.bool).triu(1).view(1, 1, 32, 64)
    zeros = torch.zeros(2, 2, 32, 64, dtype=torch.bool)
    close(ops.npu_scaled_masked_softmax(x, zeros, 0.5, True), masked_softmax_reference(x, triu, 0.5))
    close(ops.npu_scaled_masked_softmax(x.bfloat16(), mask, 0.5),
          masked_softmax_reference(x.bfloat16(), mask, 0.5), torch.bfloat16)
    xd = torch.randn(1, 1, 32, 32, dtype=torch.float64, requires_grad=True)
    md = torch.rand(1, 1, 32, 32) < 0.5
    assert gradcheck(lambda t: ops.npu_scaled_masked_softmax(t, md, 0.7), (xd,))


@exercises("npu_scaled_masked_softmax")
def test_scaled_masked_softmax_rejects_bad_input():
    x = torch.randn(1, 1, 32, 32)
    with pytest.raises(ValueError, match="divisible by 32"):
        ops.npu_scaled_masked_softmax(torch.randn(1, 1, 16, 32), torch.zeros(1, 1, 16, 32).bool())
    with pytest.raises(ValueError, match="bool"):
        ops.npu_scaled_masked_softmax(x, torch.zeros(1, 1, 32, 32))
    with pytest.raises(ValueError, match="broadcast"):
        ops.npu_scaled_masked_softmax(x, torch.zeros(2, 1, 32, 32).bool())


# --------------------------------------------------------------------------- fused attention

BIG = ops.INT_MAX


def head_index(layout, b, n, s, d):
    """The raw index of (batch b, head n, position s) in a tensor of `layout` (head dim d)."""
    return {"BSH": lambda: (b, s, slice(n * d, (n + 1) * d)),
            "SBH": lambda: (s, b, slice(n * d, (n + 1) * d)),
            "BSND": lambda: (b, s, n), "BNSD": lambda: (b, n, s),
            "TND": lambda: (s, n)}[layout]()


def allowed(i, j, s1, s2, mode, pre, nxt, mask_value):
    """Whether query i may see key j, from the torch_npu sparse_mode table (within one sequence)."""
    if mode == 0:
        if mask_value is None:
            return True
        return not mask_value and -pre <= j - i <= nxt
    if mode == 1:
        return not mask_value
    if mode == 2:
        return j <= i
    if mode == 3:
        return j <= i + s2 - s1
    return -pre <= j - i - (s2 - s1) <= nxt


def attention_reference(q, k, v, heads, layout, scale, mode=0, mask=None, pre=BIG, nxt=BIG,
                        qlens=None, kvlens=None):
    """Row by row: out[b, n, i] = sum_j softmax_j(scale <q_i, k_j> over visible j) v_j, and the
    row's max and exp-sum. Returns (out in `layout`, max[b][n][i], sum[b][n][i])."""
    if layout in ("BSH", "SBH"):
        batch = q.shape[0] if layout == "BSH" else q.shape[1]
        d = q.shape[2] // heads
        kv_heads = k.shape[2] // d
        dv = v.shape[2] // kv_heads
    else:
        batch = 1 if layout == "TND" else q.shape[0]
        d, dv = q.shape[-1], v.shape[-1]
        kv_heads = k.shape[1] if layout in ("TND", "BNSD") else k.shape[2]
    group = heads // kv_heads
    if layout == "TND":
        seqs = list(zip([0] + qlens[:-1], qlens, [0] + kvlens[:-1], kvlens))
    else:
        s1 = {"BSH": q.shape[1], "SBH": q.shape[0], "BSND": q.shape[1], "BNSD": q.shape[2]}[layout]
        s2 = {"BSH": k.shape[1], "SBH": k.shape[0], "BSND": k.shape[1], "BNSD": k.shape[2]}[layout]
        seqs = [(0, s1, 0, s2)]
    out_shape = list(q.shape)
    out_shape[-1] = out_shape[-1] // d * dv
    rows, maxes, sums = {}, {}, {}
    for b in range(batch):
        for n in range(heads):
            for q0, q1, k0, k1 in seqs:
                for i in range(q1 - q0):
                    qi = q[head_index(layout, b, n, q0 + i, d)].double()
                    scores, values = [], []
                    for j in range(k1 - k0):
                        mask_value = None
                        if mask is not None and mode in (0, 1):
                            m = mask if mask.dim() == 2 else mask[b if mask.shape[0] > 1 else 0,
                                                                  n if mask.shape[1] > 1 else 0]
                            mask_value = bool(m[i, j])
                        if allowed(i, j, q1 - q0, k1 - k0, mode, pre, nxt, mask_value):
                            kj = k[head_index(layout, b, n // group, k0 + j, d)].double()
                            scores.append(scale * torch.dot(qi, kj))
                            values.append(v[head_index(layout, b, n // group, k0 + j, dv)].double())
                    key = (b, n, q0 + i)
                    if not scores:
                        rows[key] = torch.zeros(dv, dtype=torch.float64)
                        maxes[key], sums[key] = -math.inf, 0.0
                        continue
                    s = torch.stack(scores)
                    top = s.max()
                    e = torch.exp(s - top)
                    rows[key] = (e[:, None] * torch.stack(values)).sum(0) / e.sum()
                    maxes[key], sums[key] = float(top), float(e.sum())
    out = torch.zeros(out_shape, dtype=torch.float64)
    for (b, n, s), row in rows.items():
        out[head_index(layout, b, n, s, dv)] = row
    return out, maxes, sums


def _stat(stat, layout, b, n, s):
    value = stat[s, n] if layout == "TND" else stat[b, n, s]
    assert torch.all(value == value[0]), "the 8 copies of a row statistic differ"
    return float(value[0])


def compressed_mask():
    return torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def _qkv(layout, b=2, n=4, n_kv=2, s1=4, s2=4, d=8, dv=8, t=None, dtype=torch.float32):
    if layout == "BSH":
        shapes = (b, s1, n * d), (b, s2, n_kv * d), (b, s2, n_kv * dv)
    elif layout == "SBH":
        shapes = (s1, b, n * d), (s2, b, n_kv * d), (s2, b, n_kv * dv)
    elif layout == "BSND":
        shapes = (b, s1, n, d), (b, s2, n_kv, d), (b, s2, n_kv, dv)
    elif layout == "BNSD":
        shapes = (b, n, s1, d), (b, n_kv, s2, d), (b, n_kv, s2, dv)
    else:
        shapes = (t[0], n, d), (t[1], n_kv, d), (t[1], n_kv, dv)
    return [torch.randn(shape, dtype=dtype) for shape in shapes]


CASES = [
    # layout, sparse_mode, mask kind, pre, next, s1, s2
    ("BSH", 0, None, BIG, BIG, 4, 4),
    ("SBH", 0, None, BIG, BIG, 3, 5),
    ("BSND", 0, None, BIG, BIG, 4, 4),
    ("BNSD", 0, None, BIG, BIG, 4, 4),
    ("SBH", 0, "full", 1, 0, 5, 5),
    ("BSND", 0, "batch", BIG, BIG, 4, 5),
    ("BNSD", 1, "heads", BIG, BIG, 4, 5),
    ("BSH", 2, "compressed", BIG, BIG, 3, 5),
    ("SBH", 3, "compressed", BIG, BIG, 3, 5),
    ("BNSD", 3, "compressed", BIG, BIG, 5, 3),  # rows 0, 1 see no key
    ("BSND", 4, "compressed", 2, 1, 4, 5),
]


def _mask(kind, b, n, s1, s2):
    if kind == "full":
        return torch.zeros(s1, s2, dtype=torch.bool)
    if kind == "batch":
        return torch.rand(b, 1, s1, s2) < 0.3
    if kind == "heads":
        return (torch.rand(b, n, s1, s2) < 0.3).to(torch.uint8)
    return compressed_mask() if kind == "compressed" else None


@exercises("npu_fusion_attention")
@pytest.mark.parametrize("layout,mode,mask_kind,pre,nxt,s1,s2", CASES)
def test_fusion_attention_matches_reference(layout, mode, mask_kind, pre, nxt, s1, s2):
    q, k, v = _qkv(layout, s1=s1, s2=s2, dv=6)
    mask = _mask(mask_kind, 2, 4, s1, s2)
    out, smax, ssum, sout, seed, offset, numels = ops.npu_fusion_attention(
        q, k, v, 4, layout, atten_mask=mask, scale=0.3, pre_tockens=pre, next_tockens=nxt,
        sparse_mode=mode)
    expected, maxes, sums = attention_reference(q, k, v, 4, layout, 0.3, mode, mask, pre, nxt)
    close(out, expected)
    assert smax.dtype == ssum.dtype == torch.float32 and smax.shape == (2, 4, s1, 8)
    for (b, n, s), value in maxes.items():
        assert _stat(smax, layout, b, n, s) == pytest.approx(value, rel=1e-5, abs=1e-5)
        assert _stat(ssum, layout, b, n, s) == pytest.approx(sums[(b, n, s)], rel=1e-5, abs=1e-5)
    assert sout.numel() == 0 and (seed, offset, numels) == (0, 0, 0)


TND_CASES = [(0, BIG, BIG, [2, 7, 10], [2, 7, 10]), (2, BIG, BIG, [2, 7, 10], [3, 5, 9]),
             (3, BIG, BIG, [2, 7, 10], [3, 5, 9]), (4, 1, 0, [3, 7, 10], [3, 7, 10])]


@exercises("npu_fusion_attention")
@pytest.mark.parametrize("mode,pre,nxt,qlens,kvlens", TND_CASES)
def test_fusion_attention_tnd_matches_reference(mode, pre, nxt, qlens, kvlens):
    q, k, v = _qkv("TND", t=(qlens[-1], kvlens[-1]))
    mask = compressed_mask() if mode else None
    out, smax, ssum = ops.npu_fusion_attention(
        q, k, v, 4, "TND", atten_mask=mask, scale=0.25, pre_tockens=pre, next_tockens=nxt,
        sparse_mode=mode, actual_seq_qlen=qlens, actual_seq_kvlen=kvlens)[:3]
    expected, maxes, sums = attention_reference(q, k, v, 4, "TND", 0.25, mode, None, pre, nxt,
                                                qlens, kvlens)
    close(out, expected)
    assert smax.shape == (qlens[-1], 4, 8)
    for (b, n, s), value in maxes.items():
        assert _stat(smax, "TND", b, n, s) == pytest.approx(value, rel=1e-5, abs=1e-5)
        assert _stat(ssum, "TND", b, n, s) == pytest.approx(sums[(b, n, s)], rel=1e-5, abs=1e-5)


@exercises("npu_fusion_attention")
def test_fusion_attention_bf16_within_rounding():
    q, k, v = _qkv("SBH", dtype=torch.bfloat16)
    out = ops.npu_fusion_attention(q, k, v, 4, "SBH", atten_mask=compressed_mask(), scale=0.35,
                                   sparse_mode=2)[0]
    assert out.dtype == torch.bfloat16
    close(out, attention_reference(q, k, v, 4, "SBH", 0.35, 2)[0], torch.bfloat16)


GRAD_CASES = [("BSH", 0, None, BIG, BIG, None), ("SBH", 2, "compressed", BIG, BIG, None),
              ("BNSD", 1, "heads", BIG, BIG, None), ("BSND", 4, "compressed", 1, 1, None),
              ("TND", 3, "compressed", BIG, BIG, ([2, 5], [3, 5]))]


@exercises("npu_fusion_attention", "npu_fusion_attention_grad")
@pytest.mark.parametrize("layout,mode,mask_kind,pre,nxt,lens", GRAD_CASES)
def test_fusion_attention_grad_matches_reference_autograd(layout, mode, mask_kind, pre, nxt, lens):
    kwargs = {}
    if lens:
        q, k, v = _qkv("TND", t=(lens[0][-1], lens[1][-1]), dv=6)
        kwargs = dict(actual_seq_qlen=lens[0], actual_seq_kvlen=lens[1])
    else:
        q, k, v = _qkv(layout, s1=4, s2=5, dv=6)
    mask = _mask(mask_kind, 2, 4, 4, 5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, smax, ssum = ops.npu_fusion_attention(
        q, k, v, 4, layout, atten_mask=mask, scale=0.4, pre_tockens=pre, next_tockens=nxt,
        sparse_mode=mode, **kwargs)[:3]
    dy = torch.randn_like(out)
    expected = attention_reference(q, k, v, 4, layout, 0.4, mode, mask, pre, nxt,
                                   *(lens or (None, None)))[0]
    ref_grads = torch.autograd.grad(expected, (q, k, v), dy.double())
    dq, dk, dv, dpse = ops.npu_fusion_attention_grad(
        q.detach(), k.detach(), v.detach(), dy, 4, layout, atten_mask=mask, softmax_max=smax,
        softmax_sum=ssum, attention_in=out.detach(), scale_value=0.4, pre_tockens=pre,
        next_tockens=nxt, sparse_mode=mode, **kwargs)
    for got, want in zip((dq, dk, dv), ref_grads):
        close(got, want)
    assert dpse.numel() == 0
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dy), ref_grads):
        close(got, want)  # autograd through the forward, as MindSpeed's attention uses it


@exercises("npu_fusion_attention")
def test_fusion_attention_gradcheck():
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 3, 2, dtype=torch.float64, requires_grad=True)
    mask = compressed_mask()
    assert gradcheck(
        lambda a, b, c: ops.npu_fusion_attention(a, b, c, 2, "BNSD", atten_mask=mask, scale=0.5,
                                                 sparse_mode=2)[0], (q, k, v))


@exercises("npu_fusion_attention", "npu_fusion_attention_grad")
def test_fusion_attention_dropout_is_replayed_by_the_grad():
    q, k, v = (t.requires_grad_() for t in _qkv("BNSD", s1=4, s2=4))
    out, smax, ssum, _, seed, offset, numels = ops.npu_fusion_attention(
        q, k, v, 4, "BNSD", scale=0.3, keep_prob=0.5)
    assert numels == 2 * 4 * 4 * 4
    full = ops.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.3)[0]
    assert not torch.allclose(out, full)
    dy = torch.randn_like(out)
    grads = ops.npu_fusion_attention_grad(
        q.detach(), k.detach(), v.detach(), dy, 4, "BNSD", softmax_max=smax, softmax_sum=ssum,
        attention_in=out.detach(), scale_value=0.3, keep_prob=0.5, seed=seed, offset=offset,
        numels=numels)
    for got, want in zip(grads[:3], torch.autograd.grad(out, (q, k, v), dy)):
        close(got, want)


@exercises("npu_fusion_attention", "npu_fusion_attention_grad")
def test_fusion_attention_rejects_bad_input():
    q, k, v = _qkv("BSH")
    fa = ops.npu_fusion_attention
    with pytest.raises(ValueError, match="input_layout"):
        fa(q, k, v, 4, "BHS")
    with pytest.raises(ValueError, match="sparse_mode must be 0..4"):
        fa(q, k, v, 4, "BSH", sparse_mode=6)
    with pytest.raises(ValueError, match="compressed atten_mask"):
        fa(q, k, v, 4, "BSH", sparse_mode=3)
    with pytest.raises(ValueError, match="compressed causal mask"):
        fa(q, k, v, 4, "BSH", sparse_mode=2, atten_mask=torch.zeros(2048, 2048, dtype=torch.bool))
    with pytest.raises(ValueError, match="heads"):
        fa(q, k, v, 5, "BSH")
    with pytest.raises(ValueError, match="atten_mask's shape"):
        fa(q, k, v, 4, "BSH", atten_mask=torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="sparse_mode 1"):
        fa(q, k, v, 4, "BSH", sparse_mode=1)
    with pytest.raises(ValueError, match="pse"):
        fa(q, k, v, 4, "BSH", pse=torch.zeros(1))
    with pytest.raises(ValueError, match="keep_prob"):
        fa(q, k, v, 4, "BSH", keep_prob=0.0)
    tq, tk, tv = _qkv("TND", t=(6, 6))
    with pytest.raises(ValueError, match="actual_seq_qlen is required"):
        fa(tq, tk, tv, 4, "TND")
    with pytest.raises(ValueError, match="must end at the token count 6"):
        fa(tq, tk, tv, 4, "TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 6])
    with pytest.raises(ValueError, match="TND' only"):
        fa(q, k, v, 4, "BSH", actual_seq_qlen=[4])
    out, smax, ssum = fa(q, k, v, 4, "BSH")[:3]
    with pytest.raises(ValueError, match="softmax_max must have shape"):
        ops.npu_fusion_attention_grad(q, k, v, out, 4, "BSH", softmax_max=smax[:1],
                                      softmax_sum=ssum, attention_in=out)


# --------------------------------------------------------------------------- grouped matmul

def grouped_rows_reference(x, weights, sizes, biases=None):
    """Row by row: row r of group e is x[r] @ weights[e] (+ bias[e]); rows past the groups are 0."""
    out = torch.zeros(x.shape[0], weights[0].shape[1], dtype=torch.float64)
    r = 0
    for e, size in enumerate(sizes):
        for _ in range(size):
            out[r] = x[r].double() @ weights[e].double()
            if biases is not None:
                out[r] = out[r] + biases[e].double()
            r += 1
    return out


@exercises("npu_grouped_matmul")
@pytest.mark.parametrize("group_list_type", [0, 1])
def test_grouped_matmul_m_axis_matches_reference(group_list_type):
    x = torch.randn(9, 4)
    weights = [torch.randn(4, 3) for _ in range(3)]
    sizes = [3, 0, 5]  # an empty group, and a row past the last group
    group_list = [3, 3, 8] if group_list_type == 0 else torch.tensor(sizes)
    y = ops.npu_grouped_matmul([x], weights, bias=None, group_list=group_list, split_item=2,
                               group_type=0, group_list_type=group_list_type)
    assert len(y) == 1
    close(y[0], grouped_rows_reference(x, weights, sizes))
    biases = [torch.randn(3) for _ in range(3)]
    pieces = ops.npu_grouped_matmul([x], torch.stack(weights), bias=biases, group_list=group_list,
                                    split_item=0, group_type=0, group_list_type=group_list_type)
    assert [p.shape[0] for p in pieces] == sizes
    close(torch.cat(pieces), grouped_rows_reference(x, weights, sizes, biases)[:8])
    yb = ops.npu_grouped_matmul([x.bfloat16()], [w.bfloat16() for w in weights],
                                group_list=group_list, split_item=2, group_type=0,
                                group_list_type=group_list_type)[0]
    assert yb.dtype == torch.bfloat16
    close(yb, grouped_rows_reference(x, weights, sizes), torch.bfloat16)


@exercises("npu_grouped_matmul")
def test_grouped_matmul_as_mindspeed_te_grouped_linear_calls_it():
    """Forward [x] @ per-expert W^T, dgrad with the [out, in] weights, K-axis wgrad: the three
    calls of MindSpeed's TE grouped linear, against autograd of a per-row reference."""
    x = torch.randn(7, 4, requires_grad=True)
    ori = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
    counts = torch.tensor([3, 4])
    y = ops.npu_grouped_matmul([x.detach()], [w.detach().T for w in ori], bias=None,
                               group_list=counts, split_item=2, group_type=0,
                               group_list_type=1)[0]
    expected = grouped_rows_reference(x, [w.T for w in ori], [3, 4])
    close(y, expected)
    grad_out = torch.randn(7, 3)
    ref = torch.autograd.grad(expected, [x] + ori, grad_out.double())
    dx = ops.npu_grouped_matmul([grad_out], [w.detach() for w in ori], bias=None,
                                group_list=counts, split_item=2, group_type=0,
                                group_list_type=1)[0]
    close(dx, ref[0])
    dw = ops.npu_grouped_matmul([x.detach().T], [grad_out], bias=None, group_list=counts,
                                split_item=3, group_type=2, group_list_type=1)[0]
    assert dw.shape == (2, 4, 3)
    for e in range(2):
        close(dw[e], ref[1 + e].T)


@exercises("npu_grouped_matmul")
def test_grouped_matmul_without_grouping():
    xs = [torch.randn(2, 3), torch.randn(4, 3)]
    ws = [torch.randn(3, 5), torch.randn(3, 5)]
    out = ops.npu_grouped_matmul(xs, ws, group_type=-1)
    for got, a, w in zip(out, xs, ws):
        close(got, torch.stack([row.double() @ w.double() for row in a]))
    single = ops.npu_grouped_matmul(xs, ws, split_item=3)
    close(single[0], torch.cat(out))


@exercises("npu_grouped_matmul")
def test_grouped_matmul_rejects_bad_input():
    x, ws = torch.randn(6, 4), [torch.randn(4, 3), torch.randn(4, 3)]
    gmm = ops.npu_grouped_matmul
    with pytest.raises(ValueError, match="2 weight groups"):
        gmm([x], ws, group_list=[6], split_item=2, group_type=0)
    with pytest.raises(ValueError, match="non-decreasing"):
        gmm([x], ws, group_list=[4, 2], split_item=2, group_type=0)
    with pytest.raises(ValueError, match="more than the 6"):
        gmm([x], ws, group_list=torch.tensor([4, 4]), split_item=2, group_type=0,
            group_list_type=1)
    with pytest.raises(ValueError, match="int64"):
        gmm([x], ws, group_list=torch.tensor([2, 6], dtype=torch.int32), split_item=2,
            group_type=0)
    with pytest.raises(ValueError, match="group_type must be"):
        gmm([x], ws, group_list=[2, 6], group_type=1)
    with pytest.raises(ValueError, match="quantised"):
        gmm([x], ws, group_list=[2, 6], group_type=0, scale=[torch.ones(3)])
    with pytest.raises(ValueError, match="needs split_item 3"):
        gmm([x.T], [torch.randn(6, 3)], group_list=[2, 6], split_item=2, group_type=2)


# --------------------------------------------------------------------------- MindSpeed GMM kernels

@exercises("grouped_matmul:npu_gmm", "grouped_matmul:npu_gmm_backward",
           "grouped_matmul:npu_gmm_backward_fusion", "grouped_matmul_v2:npu_gmm",
           "grouped_matmul_v2:npu_gmm_backward", "grouped_matmul_v2:npu_gmm_backward_fusion",
           "npu_groupmatmul_add_fp32:npu_groupmatmul_add_fp32")
@pytest.mark.parametrize("builder", ["grouped_matmul", "grouped_matmul_v2"])
def test_gmm_kernels_match_reference(builder):
    kernel = ops.MINDSPEED_KERNELS[builder]
    list_type = 0 if builder == "grouped_matmul" else 1
    x = torch.randn(8, 4, requires_grad=True)
    w = torch.randn(3, 4, 5, requires_grad=True)
    sizes = [2, 0, 6]
    group_list = [2, 2, 8] if list_type == 0 else torch.tensor(sizes)
    (y,) = kernel["npu_gmm"]([x.detach()], [w.detach()], [], group_list, 0, list_type)
    expected = grouped_rows_reference(x, list(w.unbind(0)), sizes)
    close(y, expected)
    grad = torch.randn(8, 5)
    ref_dx, ref_dw = torch.autograd.grad(expected, (x, w), grad.double())
    dx, dw, dbias = kernel["npu_gmm_backward"]([grad], [x.detach()], [w.detach()], group_list,
                                               list_type)
    close(dx[0], ref_dx)
    close(dw[0], ref_dw)
    assert dbias == []
    dx_only, no_dw, _ = kernel["npu_gmm_backward_fusion"]([grad], [w.detach()], group_list,
                                                          list_type)
    close(dx_only[0], ref_dx)
    assert no_dw == []
    # gradient-accumulation fusion: the weight gradient lands in main_grad (cumulative ends).
    main_grad = torch.ones(3 * 4, 5)
    ends = torch.tensor(sizes).cumsum(0)
    add = ops.MINDSPEED_KERNELS["npu_groupmatmul_add_fp32"]["npu_groupmatmul_add_fp32"]
    add(x.detach(), grad, ends, main_grad)
    close(main_grad.view(3, 4, 5), ref_dw + 1)
    with pytest.raises(ValueError, match="group_list_type"):
        kernel["npu_gmm"]([x.detach()], [w.detach()], [], group_list, 0, 1 - list_type)
    with pytest.raises(ValueError, match="group_type must be 0"):
        kernel["npu_gmm"]([x.detach()], [w.detach()], [], group_list, 2, list_type)
    with pytest.raises(ValueError, match="float32"):
        add(x.detach(), grad, ends, main_grad.bfloat16())
    with pytest.raises(ValueError, match=r"must be \[M, N\]"):
        kernel["npu_gmm_backward"]([grad[:, :4]], [x.detach()], [w.detach()], group_list, list_type)
    with pytest.raises(ValueError, match="weight's N"):
        kernel["npu_gmm_backward_fusion"]([grad[:, :4]], [w.detach()], group_list, list_type)


@exercises("npu_matmul_add_fp32:npu_matmul_add_fp32")
def test_matmul_add_fp32_accumulates_the_weight_gradient():
    kernel = ops.MINDSPEED_KERNELS["npu_matmul_add_fp32"]["npu_matmul_add_fp32"]
    grad_output, total_input = torch.randn(6, 3).bfloat16(), torch.randn(6, 4).bfloat16()
    main_grad = torch.randn(3, 4)
    expected = main_grad.double().clone()
    for t in range(6):  # one outer product per token
        expected += torch.outer(grad_output[t].double(), total_input[t].double())
    kernel(grad_output, total_input, main_grad)
    close(main_grad, expected)
    with pytest.raises(ValueError, match="must be float32"):
        kernel(grad_output, total_input, main_grad.bfloat16())
    with pytest.raises(ValueError, match=r"must be \[out, in\]"):
        kernel(grad_output, total_input, torch.zeros(4, 3))


# --------------------------------------------------------------------------- MoE routing-map permute

def routing_case(tokens=5, experts=4, topk=2, hidden=3):
    routing = torch.zeros(tokens, experts, dtype=torch.bool)
    for t in range(tokens):
        routing[t, torch.randperm(experts)[:topk]] = True
    return torch.randn(tokens, hidden), routing, torch.rand(tokens, experts)


def expert_major(routing):
    """[(token, expert)] in the permuted order the docs give: experts in order, tokens ascending."""
    return [(t, e) for e in range(routing.shape[1]) for t in range(routing.shape[0]) if routing[t, e]]


@exercises("npu_moe_token_permute_with_routing_map",
           "npu_moe_token_permute_with_routing_map_grad")
def test_permute_with_routing_map_matches_reference():
    tokens, routing, probs = routing_case()
    tokens.requires_grad_()
    probs.requires_grad_()
    permuted, permuted_probs, sorted_indices = ops.npu_moe_token_permute_with_routing_map(
        tokens, routing, probs=probs, num_out_tokens=10)
    order = expert_major(routing)
    expected = torch.stack([tokens[t] for t, _ in order])
    expected_probs = torch.stack([probs[t, e] for t, e in order])
    close(permuted, expected)
    close(permuted_probs, expected_probs)
    assert sorted_indices.dtype == torch.int32
    position = {pair: p for p, pair in enumerate(order)}
    token_major = [(t, e) for t in range(5) for e in range(4) if routing[t, e]]
    assert sorted_indices.tolist() == [position[pair] for pair in token_major]
    g, gp = torch.randn_like(expected), torch.randn_like(expected_probs)
    ref_tokens, ref_probs = torch.autograd.grad((expected, expected_probs), (tokens, probs), (g, gp))
    tokens_grad, probs_grad = ops.npu_moe_token_permute_with_routing_map_grad(
        g, gp, sorted_indices, routing, 4, 5, False)
    close(tokens_grad, ref_tokens)
    close(probs_grad, ref_probs)
    assert ops.npu_moe_token_permute_with_routing_map_grad(
        g, None, sorted_indices, routing, 4, 5, False)[1] is None
    assert ops.npu_moe_token_permute_with_routing_map(tokens, routing)[1] is None


@exercises("npu_moe_token_unpermute_with_routing_map", "_npu_moe_token_unpermute_with_routing_map",
           "npu_moe_token_unpermute_with_routing_map_grad")
@pytest.mark.parametrize("with_probs", [True, False])
def test_unpermute_with_routing_map_matches_reference(with_probs):
    tokens, routing, probs = routing_case()
    _, _, sorted_indices = ops.npu_moe_token_permute_with_routing_map(tokens, routing)
    order = expert_major(routing)
    permuted = torch.randn(len(order), 3, requires_grad=True)
    probs = probs.requires_grad_() if with_probs else None
    expected = torch.stack([
        sum(permuted[p] * (probs[t, e] if with_probs else 1.0)
            for p, (t, e) in enumerate(order) if t == token) for token in range(5)])
    kwargs = dict(probs=probs, routing_map=routing)
    out = ops.npu_moe_token_unpermute_with_routing_map(permuted, sorted_indices, (5, 3), **kwargs)
    close(out, expected)
    full = ops.OPERATORS["_npu_moe_token_unpermute_with_routing_map"](
        permuted, sorted_indices, torch.Size((5, 3)), **kwargs)
    close(full[0], expected)
    assert full[2].tolist() == [t for t, _ in order]  # permuted_token_id: each row's token
    grad = torch.randn(5, 3)
    wrt = (permuted, probs) if with_probs else (permuted,)
    ref = torch.autograd.grad(expected, wrt, grad)
    permuted_grad, probs_grad = ops.npu_moe_token_unpermute_with_routing_map_grad(
        grad, sorted_indices, sorted_indices, routing_map=routing,
        permuted_tokens=permuted.detach() if with_probs else None,
        probs=probs.detach() if with_probs else None, drop_and_pad=False,
        restore_shape=torch.Size((5, 3)))
    close(permuted_grad, ref[0])
    if with_probs:
        close(probs_grad, ref[1])
    else:
        assert probs_grad is None


@exercises("npu_moe_token_permute_with_routing_map", "npu_moe_token_unpermute_with_routing_map",
           "npu_moe_token_permute_with_routing_map_grad",
           "npu_moe_token_unpermute_with_routing_map_grad")
def test_routing_map_permute_rejects_bad_input():
    tokens, routing, probs = routing_case()
    uneven = routing.clone()
    uneven[0] = True
    with pytest.raises(ValueError, match="same number of experts"):
        ops.npu_moe_token_permute_with_routing_map(tokens, uneven)
    with pytest.raises(ValueError, match="drop_and_pad"):
        ops.npu_moe_token_permute_with_routing_map(tokens, routing, drop_and_pad=True)
    with pytest.raises(ValueError, match="topK 3"):
        ops.npu_moe_token_permute_with_routing_map(tokens, routing, num_out_tokens=15)
    with pytest.raises(ValueError, match="rows for"):
        ops.npu_moe_token_permute_with_routing_map(tokens[:4], routing)
    permuted, _, sorted_indices = ops.npu_moe_token_permute_with_routing_map(tokens, routing)
    with pytest.raises(ValueError, match="probs needs routing_map"):
        ops.npu_moe_token_unpermute_with_routing_map(permuted, sorted_indices, (5, 3), probs=probs)
    with pytest.raises(ValueError, match="hidden size"):
        ops.npu_moe_token_unpermute_with_routing_map(permuted, sorted_indices, (5, 4))
    with pytest.raises(ValueError, match=r"\(tokens_num, experts_num\)"):
        ops.npu_moe_token_permute_with_routing_map_grad(permuted, None, sorted_indices, routing,
                                                        3, 5, False)
    with pytest.raises(ValueError, match="drop_and_pad"):
        ops.npu_moe_token_unpermute_with_routing_map_grad(tokens, sorted_indices, sorted_indices,
                                                          drop_and_pad=True)


# --------------------------------------------------------------------------- MindSpeed index permute

def index_permute_reference(indices, num_out_tokens):
    """MindSpeed's npu_moe_token_permute as its C++ documents it (mindspeed/ops/csrc/cann/npu_moe_token_permute.cpp):
    the forward order is Megatron's, the flat (token, k) slots sorted by expert, stably; the rows kept are the
    first n (n = min(num_out_tokens, slots) when positive, else slots + num_out_tokens); sorted_indices is the
    aclnn operator's, not Megatron's: unsliced, one entry per slot, the row that slot lands in."""
    flat = indices.reshape(-1).tolist()
    slots = len(flat)
    forward = sorted(range(slots), key=lambda slot: flat[slot])  # Python's sort is stable
    rows = min(num_out_tokens, slots) if num_out_tokens > 0 else slots + num_out_tokens
    landing = [forward.index(slot) for slot in range(slots)]
    return forward[:rows], landing


def index_unpermute_reference(rows, landing, probs):
    """Token t sums, over its k, probs[t, k] times the row its slot t * topK + k landed in; a slot dropped by the
    permute (its row past the rows kept) adds nothing."""
    topk = probs.shape[1]
    out = []
    for t in range(len(landing) // topk):
        acc = torch.zeros(rows.shape[1], dtype=rows.dtype)
        for k in range(topk):
            row = landing[t * topk + k]
            if row < rows.shape[0]:
                acc = acc + probs[t, k] * rows[row]
        out.append(acc)
    return torch.stack(out)


@exercises("npu_moe_token_permute:npu_moe_token_permute",
           "npu_moe_token_unpermute:npu_moe_token_unpermute")
@pytest.mark.parametrize("num_out_tokens", [None, 0, 5, -3, 9])
def test_index_permute_and_unpermute_match_reference(num_out_tokens):
    permute = ops.MINDSPEED_KERNELS["npu_moe_token_permute"]["npu_moe_token_permute"]
    unpermute = ops.MINDSPEED_KERNELS["npu_moe_token_unpermute"]["npu_moe_token_unpermute"]
    tokens = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1]])
    kept, landing = index_permute_reference(indices, num_out_tokens or 0)
    permuted, sorted_indices = permute(tokens, indices, num_out_tokens)
    close(permuted, torch.stack([tokens[slot // 2] for slot in kept]), torch.float64)
    assert sorted_indices.dtype == torch.int32 and sorted_indices.tolist() == landing  # unsliced: 8 slots
    probs = torch.rand(4, 2, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(len(kept), 3, dtype=torch.float64, requires_grad=True)
    close(unpermute(rows, sorted_indices, probs, False, None), index_unpermute_reference(rows, landing, probs),
          torch.float64)
    assert gradcheck(lambda t: permute(t, indices, num_out_tokens)[0], (tokens,))
    assert gradcheck(lambda r, p: unpermute(r, sorted_indices, p), (rows, probs))
    if len(kept) == 8:  # round trip with weights summing to 1
        close(unpermute(permuted, sorted_indices, torch.full((4, 2), 0.5, dtype=torch.float64)), tokens,
              torch.float64)


def test_index_permute_and_unpermute_refuse_what_they_do_not_take():
    permute = ops.MINDSPEED_KERNELS["npu_moe_token_permute"]["npu_moe_token_permute"]
    unpermute = ops.MINDSPEED_KERNELS["npu_moe_token_unpermute"]["npu_moe_token_unpermute"]
    tokens, indices = torch.randn(4, 3), torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1]])
    permuted, sorted_indices = permute(tokens, indices)
    probs = torch.rand(4, 2)
    with pytest.raises(ValueError, match="num_out_tokens"):
        permute(tokens, indices, -9)
    with pytest.raises(ValueError, match="padded_mode"):
        permute(tokens, indices, None, True)
    with pytest.raises(ValueError, match="rows for 8 slots"):
        unpermute(torch.randn(9, 3), sorted_indices, probs)
    with pytest.raises(ValueError, match="multiple of topK"):
        unpermute(permuted, sorted_indices[:7], probs)
    with pytest.raises(ValueError, match="probs has 3 rows"):
        unpermute(permuted, sorted_indices, probs[:3])


# --------------------------------------------------------------------------- fused AdamW

@exercises("npu_apply_fused_adamw_v2:npu_apply_fused_adamw_v2")
@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, False), (False, True)])
def test_fused_adamw_v2_matches_torch_adamw(amsgrad, maximize):
    kernel = ops.MINDSPEED_KERNELS["npu_apply_fused_adamw_v2"]["npu_apply_fused_adamw_v2"]
    reference = torch.nn.Parameter(torch.randn(5, 3))
    optimizer = torch.optim.AdamW([reference], lr=0.01, betas=(0.8, 0.95), eps=1e-6,
                                  weight_decay=0.1, amsgrad=amsgrad, maximize=maximize)
    param = reference.detach().clone()
    m, v, vmax = torch.zeros_like(param), torch.zeros_like(param), torch.zeros_like(param)
    for step in range(1, 4):
        grad = torch.randn_like(param)
        reference.grad = grad.clone()
        optimizer.step()
        kernel(param, grad, m, v, vmax if amsgrad else None, step, 0.01, 0.8, 0.95, 0.1, 1e-6,
               amsgrad, maximize)
        close(param, reference.detach())
    with pytest.raises(ValueError, match="state_step"):
        kernel(param, grad, m, v, None, 0, 0.01, 0.8, 0.95, 0.1, 1e-6, False, False)
    with pytest.raises(ValueError, match="amsgrad needs"):
        kernel(param, grad, m, v, None, 1, 0.01, 0.8, 0.95, 0.1, 1e-6, True, False)


@exercises("npu_apply_adam_w")
@pytest.mark.parametrize("maximize", [False, True])
def test_apply_adam_w_matches_torch_adamw(maximize):
    """As MindSpeed-LLM's O2AdamW calls it: powers before the step, out=(param, m, v)."""
    reference = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = torch.optim.AdamW([reference], lr=0.02, betas=(0.9, 0.99), eps=1e-8,
                                  weight_decay=0.05, maximize=maximize)
    param = reference.detach().clone()
    m, v = torch.zeros_like(param), torch.zeros_like(param)
    for step in range(1, 4):
        grad = torch.randn_like(param)
        reference.grad = grad.clone()
        optimizer.step()
        result = ops.npu_apply_adam_w(0.9 ** (step - 1), 0.99 ** (step - 1), 0.02, 0.05, 0.9, 0.99,
                                      1e-8, grad, None, False, maximize, out=(param, m, v))
        assert result[0] is param
        close(param, reference.detach())
    with pytest.raises(ValueError, match="out="):
        ops.npu_apply_adam_w(1.0, 1.0, 0.02, 0.05, 0.9, 0.99, 1e-8, grad, None, False, False)
    with pytest.raises(ValueError, match="amsgrad needs max_grad_norm"):
        ops.npu_apply_adam_w(1.0, 1.0, 0.02, 0.05, 0.9, 0.99, 1e-8, grad, None, True, False,
                             out=(param, m, v))


# --------------------------------------------------------------------------- the tables

def test_every_operator_and_kernel_has_a_test():
    names = set(ops.OPERATORS) | {f"{builder}:{fn}" for builder, kernels in
                                  ops.MINDSPEED_KERNELS.items() for fn in kernels}
    assert names - EXERCISED == set(), "operators without a test"
    assert EXERCISED - names == set(), "tests name operators the tables do not hold"


DOCUMENTED_PARAMETERS = {
    # torch_npu / CANN documentation, and the mindspeed/ops wrappers' calls for the kernels.
    "npu_rms_norm": "self gamma epsilon=1e-06",
    "npu_rotary_mul": "input r1 r2 rotary_mode='half'",
    "npu_rotary_position_embedding": "x cos sin mode=0",
    "npu_swiglu": "input dim=-1",
    "npu_swiglu_backward": "grad_output input dim=-1",
    "npu_scaled_masked_softmax": "x mask scale=1.0 fixed_triu_mask=False",
    "npu_fusion_attention": "query key value head_num input_layout pse=None padding_mask=None "
                            "atten_mask=None scale=1.0 keep_prob=1.0 pre_tockens=2147483647 "
                            "next_tockens=2147483647 inner_precise=0 prefix=None "
                            "actual_seq_qlen=None actual_seq_kvlen=None sparse_mode=0 "
                            "gen_mask_parallel=True sync=False",
    "npu_fusion_attention_grad": "query key value dy head_num input_layout pse=None "
                                 "padding_mask=None atten_mask=None softmax_max=None "
                                 "softmax_sum=None softmax_in=None attention_in=None "
                                 "scale_value=1.0 keep_prob=1.0 pre_tockens=2147483647 "
                                 "next_tockens=2147483647 inner_precise=0 seed=0 offset=0 "
                                 "numels=0 prefix=None actual_seq_qlen=None "
                                 "actual_seq_kvlen=None sparse_mode=0 gen_mask_parallel=True "
                                 "sync=False",
    "npu_grouped_matmul": "x weight bias=None scale=None offset=None antiquant_scale=None "
                          "antiquant_offset=None per_token_scale=None group_list=None "
                          "activation_input=None activation_quant_scale=None "
                          "activation_quant_offset=None split_item=0 group_type=-1 "
                          "group_list_type=0 act_type=0 output_dtype=None",
    "npu_moe_token_permute_with_routing_map": "tokens routing_map probs=None num_out_tokens=None "
                                              "drop_and_pad=False",
    "npu_apply_adam_w": "beta1_power beta2_power lr weight_decay beta1 beta2 epsilon grad "
                        "max_grad_norm=None amsgrad=False maximize=False out=None",
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED_PARAMETERS))
def test_signatures_are_the_documented_ones(name):
    params = inspect.signature(ops.OPERATORS[name]).parameters.values()
    rendered = " ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                        for p in params)
    assert rendered == DOCUMENTED_PARAMETERS[name]


def test_not_implemented_tables_are_disjoint_from_the_implemented_ones():
    assert set(ops.NOT_IMPLEMENTED).isdisjoint(ops.OPERATORS)
    assert set(ops.MINDSPEED_KERNELS_NOT_IMPLEMENTED).isdisjoint(ops.MINDSPEED_KERNELS)
    for reason in [*ops.NOT_IMPLEMENTED.values(), *ops.MINDSPEED_KERNELS_NOT_IMPLEMENTED.values()]:
        assert reason.strip()


def test_tables_hold_only_callables_under_their_documented_names():
    for name, fn in ops.OPERATORS.items():
        assert callable(fn) and fn.__name__ == name
    for builder, kernels in ops.MINDSPEED_KERNELS.items():
        for name, fn in kernels.items():
            assert callable(fn) and fn.__name__ == name, (builder, name)
