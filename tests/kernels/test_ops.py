"""The ``sdkiln`` ops against their plain formulas, on every device present; schema, fake, autograd
and dispatch checks."""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import sdkiln.kernels as K
from sdkiln.kernels import registry
from sdkiln.kernels.int4 import pack_int4
from sdkiln.kernels.ops import elementwise, fp8, int8
from sdkiln.kernels.platform import DISPATCH_KEYS
from sdkiln.metrics import sqnr_db

# Tolerances, stated once (STYLE habit 12).
# Float ops against the plain torch formula computed in fp32 from the same inputs, by input dtype;
# in bf16/fp16 both sides round the same fp32 value once, so they differ by at most one ulp.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
}
# Exact paths use torch.equal: rope against diffusers, mul_add, int8 quantization, and w8a8_linear
# (int32 accumulation plus the documented fp32 dequantization) against an int64 matmul.
# Quantized against float, signal-to-quantization-noise ratio on Gaussian data:
QUANTIZE_MIN_SQNR_DB = 35.0
W8A8_VS_FLOAT_MIN_SQNR_DB = 30.0

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def randn(*shape, device, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
def test_rms_norm(device, dtype, with_weight):
    x = randn(2, 5, 64, device=device, dtype=dtype)
    w = randn(64, device=device, dtype=dtype) if with_weight else None
    expected = F.rms_norm(x.float(), (64,), None if w is None else w.float(), eps=1e-6).to(dtype)
    torch.testing.assert_close(K.rms_norm(x, w, eps=1e-6), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("mod_shape", ["B,D", "B,1,D"])
def test_layer_norm_modulate(device, dtype, mod_shape):
    x = randn(2, 7, 32, device=device, dtype=dtype)
    scale, shift = randn(2, 32, device=device, dtype=dtype), randn(2, 32, device=device, dtype=dtype)
    normed = F.layer_norm(x.float(), (32,), eps=1e-6)
    expected = (normed * (1 + scale.float()[:, None]) + shift.float()[:, None]).to(dtype)
    if mod_shape == "B,1,D":
        scale, shift = scale[:, None], shift[:, None]
    torch.testing.assert_close(K.layer_norm_modulate(x, scale, shift, eps=1e-6), expected, **TOL[dtype])


def rope_freqs(seq: int, dim: int, interleaved: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [S, D] laid out as diffusers lays them out for each convention."""
    angles = torch.arange(seq).float()[:, None] / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat([angles, angles], -1)
    return angles.cos().to(device), angles.sin().to(device)


def rope_by_hand(x, cos, sin, interleaved):
    x = x.float()
    if interleaved:
        rotated = torch.empty_like(x)
        rotated[..., 0::2] = -x[..., 1::2]
        rotated[..., 1::2] = x[..., 0::2]
    else:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half_split"])
def test_rope(device, dtype, interleaved):
    x = randn(2, 3, 6, 16, device=device, dtype=dtype)
    cos, sin = rope_freqs(6, 16, interleaved, device)
    expected = rope_by_hand(x, cos, sin, interleaved).to(dtype)
    torch.testing.assert_close(K.rope(x, cos, sin, interleaved), expected, **TOL[dtype])


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half_split"])
def test_rope_equals_diffusers(device, interleaved):
    """interleaved is use_real_unbind_dim=-1, half-split is -2; [B, S, H, D] takes cos [S, 1, D]."""
    from diffusers.models.embeddings import apply_rotary_emb

    unbind_dim = -1 if interleaved else -2
    cos, sin = rope_freqs(6, 16, interleaved, device)
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(2, 3, 6, 16, device=device, dtype=dtype)
        expected = apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=unbind_dim)
        assert torch.equal(K.rope(x, cos, sin, interleaved), expected)
        x_bshd = x.transpose(1, 2)
        expected = apply_rotary_emb(
            x_bshd, (cos, sin), use_real=True, use_real_unbind_dim=unbind_dim, sequence_dim=1
        )
        assert torch.equal(K.rope(x_bshd, cos[:, None], sin[:, None], interleaved), expected)


def test_elementwise_operands_may_not_grow_x():
    x = randn(1, 3, 8, device="cpu")
    with pytest.raises(ValueError, match=r"layer_norm_modulate: .* to \(2, 3, 8\)"):
        K.layer_norm_modulate(x, randn(2, 8, device="cpu"), randn(2, 8, device="cpu"))
    cos = randn(2, 1, 3, 8, device="cpu")
    with pytest.raises(ValueError, match=r"rope: .* to \(2, 1, 3, 8\)"):
        K.rope(x[None], cos, cos)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gelu_tanh(device, dtype):
    x = randn(4, 33, device=device, dtype=dtype, scale=3.0)
    xf = x.float()
    formula = 0.5 * xf * (1 + torch.tanh(math.sqrt(2 / math.pi) * (xf + 0.044715 * xf**3)))
    out = K.gelu_tanh(x)
    torch.testing.assert_close(out, formula.to(dtype), **TOL[dtype])
    torch.testing.assert_close(out, F.gelu(x, approximate="tanh"), **TOL[dtype])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_mul_add(device, dtype):
    gate = randn(2, 1, 16, device=device, dtype=dtype)
    branch, residual = (
        randn(2, 5, 16, device=device, dtype=dtype),
        randn(2, 5, 16, device=device, dtype=dtype),
    )
    out = K.mul_add(gate, branch, residual)
    assert out.dtype == dtype
    assert torch.equal(out, (gate.float() * branch.float() + residual.float()).to(dtype))


def test_mul_add_promotes_dtypes(device):
    x = randn(3, 4, device=device, dtype=torch.bfloat16)
    y, z = randn(3, 4, device=device), randn(4, device=device, dtype=torch.bfloat16)
    out = K.mul_add(x, y, z)
    assert out.dtype == torch.float32
    assert torch.equal(out, x.float() * y + z.float())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_per_token_int8(device, dtype):
    x = randn(3, 4, 64, device=device, dtype=dtype, scale=3.0)
    x[1, 2] = 0
    q, s = K.quantize_per_token_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (3, 4, 1)

    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127
    scale[scale == 0] = 1
    assert torch.equal(s, scale)
    assert torch.equal(q, torch.clamp(torch.round(xf / scale), -127, 127).to(torch.int8))

    assert torch.equal(q[1, 2], torch.zeros_like(q[1, 2])) and s[1, 2].item() == 1.0
    nonzero = torch.ones(3, 4, dtype=torch.bool)
    nonzero[1, 2] = False
    assert (q.abs().amax(-1)[nonzero] == 127).all()
    assert sqnr_db(xf, q.float() * s) > QUANTIZE_MIN_SQNR_DB


def test_quantize_rounds_half_to_even_and_guards_underflow(device):
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5], [1e-44, 0, 0, 0, 0, 0]], device=device)
    q, s = K.quantize_per_token_int8(x)
    assert q.tolist() == [[127, 0, 2, 2, 0, -2], [0, 0, 0, 0, 0, 0]]
    assert s.flatten().tolist() == [1.0, 1.0]


def quantized_linear(m, k, n, device):
    """Float x [2, m, k], weight [n, k], bias [n], and their int8 quantization (per token, per channel)."""
    x, w, b = randn(2, m, k, device=device), randn(n, k, device=device, scale=0.05), randn(n, device=device)
    (xq, xs), (wq, ws) = K.quantize_per_token_int8(x), K.quantize_per_token_int8(w)
    return x, w, b, xq, xs, wq, ws


def w8a8_by_hand(xq, xs, wq, ws, bias, out_dtype):
    """The documented formula, with the int32 accumulation done independently as an int64 matmul."""
    acc = xq.reshape(-1, xq.shape[-1]).cpu().long() @ wq.cpu().long().T
    assert acc.abs().max() < 2**31
    y = acc.to(xq.device).float() * xs.reshape(-1, 1)
    y = y * ws.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).reshape(*xq.shape[:-1], -1)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_w8a8_linear_is_exact(device, out_dtype, with_bias):
    _, _, b, xq, xs, wq, ws = quantized_linear(4, 384, 48, device)
    bias = b.to(out_dtype) if with_bias else None
    out = K.w8a8_linear(xq, xs, wq, ws, bias, out_dtype)
    assert out.dtype == out_dtype and out.shape == (2, 4, 48)
    assert torch.equal(out, w8a8_by_hand(xq, xs, wq, ws, bias, out_dtype))
    assert torch.equal(K.w8a8_linear(xq, xs, wq, ws.flatten(), bias, out_dtype), out)
    assert torch.equal(K.w8a8_linear(xq[:1, :1], xs[:1, :1], wq, ws, bias, out_dtype), out[:1, :1])


def test_w8a8_linear_vs_float_linear(device):
    x, w, b, xq, xs, wq, ws = quantized_linear(16, 256, 64, device)
    assert sqnr_db(F.linear(x, w, b), K.w8a8_linear(xq, xs, wq, ws, b)) > W8A8_VS_FLOAT_MIN_SQNR_DB


def test_int8_matmul_fp32_chunks_is_exact(device):
    """The exact path for devices without _int_mm: ragged K over several chunks, and the extremes."""
    a = torch.randint(-128, 128, (5, 2500), dtype=torch.int8)
    b = torch.randint(-128, 128, (7, 2500), dtype=torch.int8)
    a[0], b[0] = -128, -128
    expected = a.long() @ b.long().T
    assert expected[0, 0] == 2500 * 128 * 128
    for matmul in (int8.int8_matmul_fp32_chunks, int8.int8_matmul):
        out = matmul(a.to(device), b.to(device))
        assert out.dtype == torch.int32
        assert torch.equal(out.cpu().long(), expected)


def test_w8a8_linear_rejects_bad_inputs():
    xq, xs = torch.zeros(2, 8, dtype=torch.int8), torch.ones(2, 1)
    wq, ws = torch.zeros(3, 8, dtype=torch.int8), torch.ones(3, 1)
    with pytest.raises(ValueError, match="x_q must be torch.int8"):
        K.w8a8_linear(xq.float(), xs, wq, ws)
    with pytest.raises(ValueError, match=r"weight must be \[N, K\]"):
        K.w8a8_linear(xq, xs, wq[:, :4], ws)
    with pytest.raises(ValueError, match="x_scale"):
        K.w8a8_linear(xq, xs[:1], wq, ws)
    with pytest.raises(ValueError, match="weight_scale"):
        K.w8a8_linear(xq, xs, wq, ws[:2])
    k = int8.W8A8_MAX_K + 1
    with pytest.raises(ValueError, match="int32 accumulator can overflow"):
        K.w8a8_linear(
            torch.zeros(1, k, dtype=torch.int8), xs[:1], torch.zeros(1, k, dtype=torch.int8), ws[:1]
        )


def masked_logits(q, k, mask, scale):
    logits = q.float() @ k.float().transpose(-1, -2) * scale
    if mask is None:
        return logits
    return logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.float()


def sdpa_bshd(q, k, v, **kwargs):
    """F.scaled_dot_product_attention on [B, S, H, D] tensors (it takes [B, H, S, D])."""
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), **kwargs)
    return out.transpose(1, 2)


def logits_bshd(q, k, mask, scale):
    """The masked logits [B, H, Sq, Sk] of [B, S, H, D] tensors, in fp32."""
    return masked_logits(q.transpose(1, 2), k.transpose(1, 2), mask, scale)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
def test_attention(device, dtype, mask_kind):
    """[B, S, H, D] in, [B, Sq, H, Dv] and an fp32 log-sum-exp [B, Sq, H] out; masks broadcast to
    [B, H, Sq, Sk] as SDPA's do."""
    q = randn(2, 5, 3, 16, device=device, dtype=dtype)
    k, v = randn(2, 7, 3, 16, device=device, dtype=dtype), randn(2, 7, 3, 8, device=device, dtype=dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, 5, 7, device=device) > 0.4
        mask[..., 0] = True
    elif mask_kind == "additive":
        mask = randn(1, 3, 5, 7, device=device, dtype=dtype)
    out, lse = K.attention(q, k, v, mask)
    assert out.dtype == dtype and out.shape == (2, 5, 3, 8) and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (2, 5, 3)
    float_mask = mask.float() if mask_kind == "additive" else mask
    expected = sdpa_bshd(q.float(), k.float(), v.float(), attn_mask=float_mask)
    torch.testing.assert_close(out, expected.to(dtype), **TOL[dtype])
    logits = logits_bshd(q, k, mask, 1 / math.sqrt(16))
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1).transpose(1, 2), **TOL[torch.float32])


def test_attention_scale_and_fully_masked_rows(device):
    q, k, v = (randn(1, 4, 2, 8, device=device) for _ in range(3))
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool, device=device)
    mask[..., 2, :] = False
    out, lse = K.attention(q, k, v, mask, scale=0.3)
    expected = sdpa_bshd(q, k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    assert (out[:, 2] == 0).all() and (lse[:, 2] == -math.inf).all()
    expected_lse = torch.logsumexp(logits_bshd(q, k, mask, 0.3), -1).transpose(1, 2)
    torch.testing.assert_close(lse, expected_lse, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("length", [64, 70], ids=["whole_blocks", "short_last_block"])
def test_block_sparse_attention_cpu_kernel(dtype, length):
    """The CPU kernel (gathered kept blocks on torch's CPU flash kernel) against the dense formula
    under the mask the kept lists stand for, with rows keeping every, some and no key block."""
    from sdkiln.kernels.ops.sparse_attention import dense_mask

    K.load_device_kernels("cpu")
    b, h, d, block = 2, 3, 16, 16
    q, k, v = (randn(b, length, h, d, device="cpu", dtype=dtype) for _ in range(3))
    n = math.ceil(length / block)
    kept = torch.full((b, h, n, n), -1, dtype=torch.int32)
    for i in range(b):
        for j in range(h):
            for qb in range(n):
                count = (i + j + qb) % (n + 1)  # 0 (nothing kept) ... n (dense)
                kept[i, j, qb, -count or n :] = torch.randperm(n)[:count].int()  # padding first
    assert K.implementation("block_sparse_attention", "cpu", q, k, v, kept, block, None) == "flash_gather"
    out, lse = K.block_sparse_attention(q, k, v, kept, block)
    mask = dense_mask(kept, block, length, length)
    expected = sdpa_bshd(q.float(), k.float(), v.float(), attn_mask=mask).nan_to_num(0.0)
    torch.testing.assert_close(out, expected.to(dtype), **TOL[dtype])
    logits = logits_bshd(q, k, mask, 1 / math.sqrt(d))
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1).transpose(1, 2), **TOL[dtype])


def test_attention_refuses_mismatched_heads():
    q = randn(1, 4, 2, 8, device="cpu")
    with pytest.raises(ValueError, match=r"attention: q \[B, Sq, H, D\]"):
        K.attention(q, randn(1, 4, 3, 8, device="cpu"), randn(1, 4, 3, 8, device="cpu"))


def op_samples(device) -> dict[str, tuple]:
    """One argument tuple per op; float inputs of differentiable ops require grad."""

    def leaf(*shape, dtype=torch.float32):
        return randn(*shape, device=device, dtype=dtype).requires_grad_()

    cos, sin = rope_freqs(4, 8, True, device)
    xq, xs = int8.quantize_per_token_int8_reference(randn(3, 16, device=device))
    wq, ws = int8.quantize_per_token_int8_reference(randn(5, 16, device=device))
    fp8_x = fp8.fp8_quantize_per_token_reference(randn(3, 16, device=device))
    fp8_w = fp8.fp8_quantize_per_token_reference(randn(5, 16, device=device))
    int4 = torch.randint(-8, 8, (5, 32), dtype=torch.int8, device=device)
    return {
        "rms_norm": (leaf(2, 3, 8), leaf(8), 1e-6),
        "layer_norm_modulate": (leaf(2, 3, 8), leaf(2, 8), leaf(2, 8), 1e-6),
        "rope": (leaf(1, 2, 4, 8), cos, sin, True),
        "gelu_tanh": (leaf(3, 8, dtype=torch.bfloat16),),
        "mul_add": (leaf(2, 1, 8), leaf(2, 3, 8), leaf(2, 3, 8)),
        "quantize_per_token_int8": (randn(3, 16, device=device),),
        "w8a8_linear": (xq, xs, wq, ws, randn(5, device=device), torch.bfloat16),
        "attention": (leaf(1, 3, 2, 8), leaf(1, 5, 2, 8), leaf(1, 5, 2, 8), None, None),
        "fp8_block_attention": (
            randn(1, 3, 2, 8, device=device),
            randn(1, 5, 2, 8, device=device),
            randn(1, 5, 2, 8, device=device),
            None,
            None,
            True,
        ),
        "quantized_attention": (
            randn(1, 3, 2, 8, device=device),
            randn(1, 5, 2, 8, device=device),
            randn(1, 5, 2, 8, device=device),
            None,
            None,
            "int8",
            "fp8",
            True,
        ),
        "quantize_per_tensor_int8": (
            randn(3, 16, device=device),
            torch.tensor([0.02], device=device),
            torch.tensor([-3.0], device=device),
        ),
        "w8a8_static_linear": (
            xq,
            wq,
            randn(5, device=device).abs(),
            torch.randint(-1000, 1000, (5,), dtype=torch.int32, device=device),
            torch.bfloat16,
        ),
        "fp8_quantize_per_token": (randn(3, 16, device=device, dtype=torch.bfloat16),),
        "fp8_linear": (*fp8_x, *fp8_w, None, torch.float32),
        "weight_only_linear": (
            randn(3, 32, device=device, dtype=torch.bfloat16),
            pack_int4(int4),
            randn(5, 2, device=device),
            randn(5, device=device, dtype=torch.bfloat16),
            16,
        ),
        "rms_norm_quantize": (randn(2, 3, 8, device=device), randn(8, device=device), 1e-6, torch.int8),
        "layer_norm_modulate_quantize": (
            randn(2, 3, 8, device=device),
            randn(2, 8, device=device),
            randn(2, 8, device=device),
            1e-6,
            torch.float8_e4m3fn,
        ),
        "lora_add": (
            randn(2, 3, 8, device=device),
            randn(4, 8, device=device),
            randn(6, 4, device=device),
            torch.rand(4, device=device),
            randn(2, 3, 6, device=device),
        ),
        "block_sparse_attention": (
            randn(1, 5, 2, 8, device=device),
            randn(1, 5, 2, 8, device=device),
            randn(1, 5, 2, 8, device=device),
            torch.tensor([[[[0, -1], [1, 0]], [[1, -1], [-1, -1]]]], dtype=torch.int32, device=device),
            4,
            None,
        ),
    }


@pytest.mark.parametrize("name", K.op_names())
def test_opcheck(device, name):
    """Schema, fake (for torch.compile), autograd registration and AOT dispatch of each op.

    test_schema compares inputs before and after with torch.allclose, which has no float8 kernel,
    so ops with float8 inputs skip it; test_fp8_weight_only_ops checks they neither mutate nor alias.
    """
    checks = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    args = op_samples(device)[name]
    if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args):
        checks = checks[1:]
    torch.library.opcheck(getattr(torch.ops.sdkiln, name).default, args, test_utils=checks)


def test_gradients_match_the_formulas(device):
    x, w = randn(2, 3, 32, device=device).requires_grad_(), randn(32, device=device).requires_grad_()
    g = randn(2, 3, 32, device=device)
    got = torch.autograd.grad(K.rms_norm(x, w), (x, w), g)
    expected = torch.autograd.grad(F.rms_norm(x, (32,), w, eps=1e-6), (x, w), g)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float32])

    q, k, v = (randn(1, 4, 2, 8, device=device).requires_grad_() for _ in range(3))
    out, lse = K.attention(q, k, v)
    got = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    ref_out = sdpa_bshd(q, k, v)
    ref_lse = torch.logsumexp(logits_bshd(q, k, None, 1 / math.sqrt(8)), -1)
    expected = torch.autograd.grad(ref_out.sum() + ref_lse.sum(), (q, k, v))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_quantized_ops_refuse_backward():
    x = randn(4, 16, device="cpu").requires_grad_()
    _, s = K.quantize_per_token_int8(x)
    with pytest.raises(RuntimeError, match="no gradient"):
        s.sum().backward()
    xq, xs = int8.quantize_per_token_int8_reference(x.detach())
    wq, ws = int8.quantize_per_token_int8_reference(randn(3, 16, device="cpu"))
    out = K.w8a8_linear(xq, xs, wq, ws, randn(3, device="cpu").requires_grad_())
    with pytest.raises(RuntimeError, match="no gradient"):
        out.sum().backward()


@pytest.mark.parametrize("name", K.op_names())
def test_implementation_agrees_with_the_dispatcher(name):
    qualname = f"sdkiln::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeExplicitAutograd")
    for device_type, key in DISPATCH_KEYS.items():
        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)
        assert bool(K.kernels(name, device_type)) == has_kernel
    unconditional = [k.name for k in K.kernels(name, "cpu") if k.supports is None]
    assert K.implementation(name, "cpu") == (unconditional or ["reference"])[0]


@pytest.fixture
def mul_add_kernels():
    """Registers test kernels of mul_add by name; removes whatever is left of them afterwards."""
    added = []

    def add(device_type, name, fn, **kwargs):
        K.register_kernel("mul_add", device_type, name=name, **kwargs)(fn)
        added.append((device_type, name))

    yield add
    for device_type, name in added:
        if any(k.name == name for k in K.kernels("mul_add", device_type)):
            K.remove_kernel("mul_add", device_type, name)


def test_a_registered_kernel_runs_where_registered_and_is_reported(mul_add_kernels):
    calls = []
    x, y, z = (randn(3, 4, device="cpu") for _ in range(3))

    def counting(x, y, z):
        calls.append(x.device.type)
        return elementwise.mul_add_reference(x, y, z)

    def never(x, y, z):
        raise AssertionError("the cuda kernel ran on CPU tensors")

    mul_add_kernels("cpu", "counting", counting)
    mul_add_kernels("cuda", "never", never)
    assert K.implementation("mul_add", "cpu") == "counting"
    assert K.implementation("mul_add", "cuda") == "never"
    assert K.implementation("mul_add", "npu") == "reference"
    assert torch.equal(K.mul_add(x, y, z), x * y + z)
    assert calls == ["cpu"]
    with pytest.raises(ValueError, match="already has the cpu kernel 'counting'"):
        K.register_kernel("mul_add", "cpu", name="counting")(counting)
    K.remove_kernel("mul_add", "cpu", "counting")
    K.remove_kernel("mul_add", "cuda", "never")
    assert K.implementation("mul_add", "cpu") == K.implementation("mul_add", "cuda") == "reference"
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("sdkiln::mul_add", "CPU")
    K.mul_add(x, y, z)
    assert calls == ["cpu"]


def test_kernels_are_tried_by_priority_and_fall_back_by_what_they_support(mul_add_kernels):
    """A shape-limited kernel above a general one above the reference: each input runs the first
    kernel that supports it, and implementation() with the same arguments names that one."""
    ran = []

    def kernel(name):
        def fn(x, y, z):
            ran.append(name)
            return elementwise.mul_add_reference(x, y, z)

        return fn

    def only_rows_of_8(x, y, z):
        return x.shape[-1] == 8

    def not_bfloat16(x, y, z):
        return x.dtype != torch.bfloat16

    mul_add_kernels("cpu", "general", kernel("general"), priority=1, supports=not_bfloat16)
    mul_add_kernels("cpu", "rows8", kernel("rows8"), priority=5, supports=only_rows_of_8)
    assert [k.name for k in K.kernels("mul_add", "cpu")] == ["rows8", "general"]
    cases = {
        "rows8": randn(2, 8, device="cpu"),
        "general": randn(2, 6, device="cpu"),
        "reference": randn(2, 6, device="cpu", dtype=torch.bfloat16),
    }
    for expected, x in cases.items():
        assert K.implementation("mul_add", "cpu", x, x, x) == expected
        ran.clear()
        torch.testing.assert_close(K.mul_add(x, x, x), elementwise.mul_add_reference(x, x, x), rtol=0, atol=0)
        assert ran == ([] if expected == "reference" else [expected])
    # without arguments, only a kernel that declares no predicate is certain to run
    assert K.implementation("mul_add", "cpu") == "reference"
    K.remove_kernel("mul_add", "cpu", "rows8")
    assert K.implementation("mul_add", "cpu", *(cases["rows8"],) * 3) == "general"


def test_unknown_op_or_device_type_is_an_error():
    with pytest.raises(KeyError, match="unknown sdkiln op 'softmax'"):
        K.implementation("softmax", "cpu")
    with pytest.raises(ValueError, match="unknown device type 'tpu'"):
        K.register_kernel("rms_norm", "tpu", name="x")
    with pytest.raises(KeyError, match="no cpu kernel 'x' to remove"):
        K.remove_kernel("rms_norm", "cpu", "x")
    with pytest.raises(ValueError, match="unknown device type 'tpu'"):
        K.load_device_kernels("tpu")


def test_device_kernels_load_only_when_asked():
    """The CUDA kernel modules import and register on request, also without a GPU, and say which
    kernel runs on which arguments; ``import sdkiln.kernels`` alone registered nothing for CUDA."""
    code = (
        "import sdkiln.kernels as K, sys\n"
        "assert not any(K.kernels(op, 'cuda') for op in K.op_names())\n"
        "assert 'sdkiln.kernels.cuda' not in sys.modules\n"
        "assert K.load_device_kernels('cuda') == ['sdkiln.kernels.cuda', 'sdkiln.kernels.triton']\n"
        "assert K.load_device_kernels('cuda') == ['sdkiln.kernels.cuda', 'sdkiln.kernels.triton']\n"
        "print([k.name for k in K.kernels('fp8_linear', 'cuda')])\n"
    )
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['scaled_mm', 'triton']"
    assert K.load_device_kernels("cpu") == ["sdkiln.kernels.cpu"]


def test_reimport_keeps_the_registrations():
    lib = registry._LIB
    importlib.reload(registry)
    importlib.reload(elementwise)
    assert registry._LIB is lib
    x = randn(2, 8, device="cpu")
    assert torch.equal(elementwise.gelu_tanh(x), elementwise.gelu_tanh_reference(x))
    assert K.implementation("gelu_tanh", "cpu") == "reference"
    assert K.op_names() == registry.op_names()


def test_ops_compile_without_graph_breaks():
    """The fakes let dynamo + AOTAutograd trace a DiT-like block in one graph."""

    def block(x, scale, shift, gate, cos, sin, wq, ws):
        h = K.layer_norm_modulate(x, scale, shift)
        heads = K.rope(h.unflatten(-1, (2, 8)), cos[:, None], sin[:, None])  # [B, S, H, D]
        attn, _ = K.attention(heads, heads, heads)
        hq, hs = K.quantize_per_token_int8(K.gelu_tanh(attn.flatten(2)))
        return K.mul_add(gate, K.w8a8_linear(hq, hs, wq, ws), K.rms_norm(x))

    cos, sin = rope_freqs(4, 8, True, "cpu")
    wq, ws = int8.quantize_per_token_int8_reference(randn(16, 16, device="cpu"))
    args = (randn(2, 4, 16, device="cpu"), randn(2, 16, device="cpu"), randn(2, 16, device="cpu"))
    args += (randn(2, 1, 16, device="cpu"), cos, sin, wq, ws)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(*args), block(*args))


def test_lora_add_is_the_low_rank_branch_added_once():
    """fp32: the plain formula within the fp32 tolerance; bf16: one rounding of the fp32 result; a
    zero scale (a padded or switched-off rank) adds exactly nothing; bad shapes are one error."""
    from sdkiln.kernels.ops.lora import lora_add_reference

    x, base = randn(2, 5, 16, device="cpu"), randn(2, 5, 12, device="cpu")
    a, b, scale = (
        randn(6, 16, device="cpu"),
        randn(12, 6, device="cpu"),
        torch.tensor([1.0, 1.0, 0.5, 0.5, 0.0, 0.0]),
    )
    want = base + ((x @ a.t()) * scale) @ b.t()
    torch.testing.assert_close(torch.ops.sdkiln.lora_add(x, a, b, scale, base), want, **TOL[torch.float32])
    half = [t.bfloat16() for t in (x, a, b)]
    got = torch.ops.sdkiln.lora_add(*half, scale, base.bfloat16())
    assert got.dtype == torch.bfloat16 and torch.equal(got, lora_add_reference(*half, scale, base.bfloat16()))
    assert torch.equal(torch.ops.sdkiln.lora_add(x, a, b, torch.zeros(6), base), base)
    with pytest.raises(ValueError, match=r"lora_add: need lora_a \[R, K\]"):
        lora_add_reference(x, a[:, :8], b, scale, base)
    with pytest.raises(ValueError, match="scale must be a float32 vector"):
        lora_add_reference(x, a, b, scale.double(), base)
