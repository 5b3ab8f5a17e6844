"""Every Triton kernel against its op's pure-torch reference, through the op's dispatcher.

On a machine without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set in
conftest.py before they are imported) on CPU tensors: the ``triton_on`` fixture registers each
"cuda" Triton kernel as a "cpu" kernel of its op for the test's duration, so the call goes through
``torch.ops.sdkiln.<op>`` and its ``supports()`` exactly as on a GPU. On a GPU the same bodies run
on CUDA tensors, with a second set of shapes at FLUX scale (``gpu`` marker).

Tolerances, stated once (STYLE habit 12):
* exact (``torch.equal``) where the reference is exact: per-token and per-tensor quantization
  (alone and fused after a norm: values and scales), the int8 GEMMs in every output dtype, and the
  float ops in bfloat16/float16, whose kernels compute in fp32 and round once to nearest even as
  the references do (their fp32 sums may differ in order: exactness is asserted on the quantized
  results, SQNR on the float ones);
* SQNR >= 35 dB (kernel vs reference) for everything computed by an fp32 reduction or matmul whose
  order differs from the reference's: norms, attention, fp8 and weight-only GEMMs.
* fused norm + quantize: the kernel's fp32 norm may differ from the reference's in the last bit,
  which can move a value across a rounding boundary: at most one step, in at most 1% of values.
"""

import math

import pytest
import torch

import sdkiln.kernels as K
from sdkiln.kernels.int4 import pack_int4
from sdkiln.kernels.ops.sparse_attention import dense_mask
from sdkiln.metrics import sqnr_db

triton = pytest.importorskip("triton", reason="triton is installed by the test extra (make test)")
if not torch.cuda.is_available() and not __import__("os").environ.get("TRITON_INTERPRET"):
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)
import sdkiln.kernels.triton as T  # noqa: E402

KERNEL_VS_REFERENCE_MIN_SQNR_DB = 35.0
FUSED_QUANT_MAX_FLIPPED = 0.01
HALF = [torch.float32, torch.bfloat16, torch.float16]
OPS = [op for op in K.op_names() if any(k.name == T.KERNEL_NAME for k in K.kernels(op, "cuda"))]

DEVICES = [
    pytest.param(
        "cpu", id="interpreter", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="GPU present")
    ),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")],
    ),
]


@pytest.fixture(params=DEVICES)
def triton_on(request):
    """The device the Triton kernels run on; on CPU they are registered there for the test."""
    device = torch.device(request.param)
    added, own = [], []
    if device.type == "cpu":
        own = [(op, k) for op in OPS for k in K.kernels(op, "cpu")]  # the CPU's own kernels step aside
        for op, k in own:
            K.remove_kernel(op, "cpu", k.name)
        for op in OPS:
            kernel = next(k for k in K.kernels(op, "cuda") if k.name == T.KERNEL_NAME)
            K.register_kernel(op, "cpu", T.KERNEL_NAME, priority=kernel.priority, supports=kernel.supports)(
                kernel.fn
            )
            added.append(op)
    yield device
    for op in added:
        K.remove_kernel(op, "cpu", T.KERNEL_NAME)
    for op, k in own:
        K.register_kernel(op, "cpu", k.name, priority=k.priority, supports=k.supports)(k.fn)


def run(op: str, device: torch.device, *args):
    """``sdkiln::<op>`` on ``args``, after asserting that the Triton kernel is what runs."""
    assert K.implementation(op, device.type, *args) == T.KERNEL_NAME, op
    return getattr(torch.ops.sdkiln, op).default(*args)


def reference(op: str, *args):
    return K.registry._OPS[op].reference(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))


def close(got, want) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert sqnr_db(want.float().cpu(), got.float().cpu()) >= KERNEL_VS_REFERENCE_MIN_SQNR_DB


def test_every_triton_kernel_is_covered():
    """The list this module tests is every op with a Triton kernel; a new kernel needs a test here, and
    a new op a kernel or a reason in ``REFERENCE_ONLY``."""
    tested = {
        "rms_norm", "layer_norm_modulate", "quantize_per_token_int8", "fp8_quantize_per_token",
        "rms_norm_quantize", "layer_norm_modulate_quantize", "gelu_tanh", "mul_add", "rope",
        "quantize_per_tensor_int8", "w8a8_linear", "w8a8_static_linear", "fp8_linear",
        "weight_only_linear", "attention", "block_sparse_attention", "lora_add", "quantized_attention",
    }  # fmt: skip
    assert set(OPS) == tested
    assert all(T.REFERENCE_ONLY.values())
    assert set(K.op_names()) == tested | set(T.REFERENCE_ONLY)  # every other op has a Triton kernel


@pytest.mark.parametrize("dtype", HALF)
def test_norms_and_elementwise(triton_on, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 40, generator=g).to(dtype).to(triton_on)
    weight = torch.randn(40, generator=g).to(dtype).to(triton_on)
    scale, shift = (torch.randn(2, 40, generator=g).to(dtype).to(triton_on) for _ in range(2))
    close(run("rms_norm", triton_on, x, weight, 1e-6), reference("rms_norm", x, weight, 1e-6))
    close(run("rms_norm", triton_on, x, None, 1e-5), reference("rms_norm", x, None, 1e-5))
    for sc, sh in [(scale, shift), (scale[:, None], shift[0])]:  # per sample; and mixed broadcasts
        close(
            run("layer_norm_modulate", triton_on, x, sc, sh, 1e-6),
            reference("layer_norm_modulate", x, sc, sh, 1e-6),
        )
    close(run("gelu_tanh", triton_on, x), reference("gelu_tanh", x))
    gate = scale[:, None]
    for args in [(gate, x, x), (x, x, shift[0]), (x, x, x)]:
        assert torch.equal(run("mul_add", triton_on, *args).cpu(), reference("mul_add", *args))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_rope(triton_on, interleaved, layout):
    g = torch.Generator().manual_seed(1)
    b, h, s, d = 2, 3, 7, 16
    x = torch.randn(b, h, s, d, generator=g).bfloat16().to(triton_on)
    cos, sin = (torch.randn(s, d, generator=g).to(triton_on) for _ in range(2))
    if layout == "BSHD":  # diffusers' dispatch layout: the table broadcasts as [S, 1, D]
        x, cos, sin = x.transpose(1, 2).contiguous(), cos[:, None], sin[:, None]
    assert torch.equal(
        run("rope", triton_on, x, cos, sin, interleaved).cpu(), reference("rope", x, cos, sin, interleaved)
    )


@pytest.mark.parametrize("dtype", HALF)
def test_quantization_is_exact(triton_on, dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 5, 64, generator=g) * 3).to(dtype).to(triton_on)
    x[0, 0] = 0  # an all-zero row: scale 1
    for op in ("quantize_per_token_int8", "fp8_quantize_per_token"):
        got, want = run(op, triton_on, x), reference(op, x)
        assert all(torch.equal(a.cpu().view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a.cpu(),
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                   for a, b in zip(got, want, strict=True)), op  # fmt: skip
    scale, offset = torch.tensor([0.0173], device=triton_on), torch.tensor([-3.0], device=triton_on)
    assert torch.equal(
        run("quantize_per_tensor_int8", triton_on, x, scale, offset).cpu(),
        reference("quantize_per_tensor_int8", x, scale, offset),
    )


def test_edge_values_round_as_torch_does(triton_on):
    """Signed zeros, tiny negatives, float8 ties and subnormals, values at e4m3's top, NaN and
    infinities: the explicit rounding (kernels/triton/rounding.py) must give torch's bits."""
    specials = [0.0, -0.0, -1e-4, 1e-4, 448.0, -447.0, 440.0, 200.0, 17.0, 2.0**-9, 3 * 2.0**-10, 0.3]
    row = torch.tensor(specials + [1.0] * (16 - len(specials)))
    x = torch.stack([row, row * 448.0 / 448.0, -row]).to(triton_on)  # absmax 448: scale 1, values as they are
    got, want = run("fp8_quantize_per_token", triton_on, x), reference("fp8_quantize_per_token", x)
    assert torch.equal(got[0].cpu().view(torch.uint8), want[0].view(torch.uint8))
    nan_inf = torch.tensor([[float("nan"), float("inf"), -float("inf"), -0.0, 1.0, 2.0, 3.0, 4.0]]).to(
        triton_on
    )
    for dtype in (torch.bfloat16, torch.float16):
        y = run("gelu_tanh", triton_on, nan_inf.to(dtype)).cpu()
        ref = reference("gelu_tanh", nan_inf.to(dtype))
        assert torch.isnan(y[0, 0]) and torch.equal(y[0, 1:].isinf(), ref[0, 1:].isinf())
        out = run("mul_add", triton_on, nan_inf.to(dtype), nan_inf.to(dtype), nan_inf.to(dtype)).cpu()
        assert torch.equal(out.isnan(), reference("mul_add", *(nan_inf.to(dtype),) * 3).isnan())


def test_mul_add_broadcasts_as_torch(triton_on):
    """A 2-D operand of a 3-D x broadcasts as [1, S, D] (torch's rule), not per sample (adaLN's)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 8, generator=g).to(triton_on)
    for y in (torch.randn(3, 8, generator=g), torch.randn(8, generator=g), torch.randn(2, 1, 8, generator=g)):
        y = y.to(triton_on)
        assert torch.equal(run("mul_add", triton_on, x, y, x).cpu(), reference("mul_add", x, y, x))
        assert torch.equal(run("mul_add", triton_on, y, x, x).cpu(), reference("mul_add", y, x, x))


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", HALF)
def test_fused_norm_quantize(triton_on, dtype, qdtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 11, 48, generator=g).to(dtype).to(triton_on)
    weight = torch.randn(48, generator=g).to(dtype).to(triton_on)
    scale, shift = (torch.randn(2, 48, generator=g).to(dtype).to(triton_on) for _ in range(2))
    for op, args in [
        ("rms_norm_quantize", (x, weight, 1e-6, qdtype)),
        ("layer_norm_modulate_quantize", (x, scale, shift, 1e-6, qdtype)),
    ]:
        (q, s), (rq, rs) = run(op, triton_on, *args), reference(op, *args)
        torch.testing.assert_close(s.cpu(), rs, rtol=1e-6, atol=0)
        if qdtype == torch.int8:
            steps = (q.cpu().int() - rq.int()).abs()
        else:  # adjacent float8 values of one sign have adjacent codes
            steps = (q.cpu().view(torch.uint8).int() - rq.view(torch.uint8).int()).abs()
        assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) <= FUSED_QUANT_MAX_FLIPPED, op


def _int8(shape, g):
    return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)


@pytest.mark.parametrize("out_dtype", HALF)
def test_int8_gemms_are_exact(triton_on, out_dtype):
    g = torch.Generator().manual_seed(4)
    m, k, n = 37, 80, 24  # none a multiple of the tile
    x_q, weight = _int8((2, m, k), g).to(triton_on), _int8((n, k), g).to(triton_on)
    x_scale = (torch.rand(2, m, 1, generator=g) * 1e-2).to(triton_on)
    weight_scale = (torch.rand(n, 1, generator=g) * 1e-2).to(triton_on)
    bias = torch.randn(n, generator=g).to(out_dtype).to(triton_on)
    for b in (bias, None):
        args = (x_q, x_scale, weight, weight_scale, b, out_dtype)
        assert torch.equal(run("w8a8_linear", triton_on, *args).cpu(), reference("w8a8_linear", *args))
    deq_scale = (torch.rand(n, generator=g) * 1e-4).to(triton_on)
    quant_bias = torch.randint(-5000, 5000, (n,), generator=g, dtype=torch.int32).to(triton_on)
    args = (x_q, weight, deq_scale, quant_bias, out_dtype)
    assert torch.equal(
        run("w8a8_static_linear", triton_on, *args).cpu(), reference("w8a8_static_linear", *args)
    )


def test_fp8_linear(triton_on):
    if triton_on.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9")
    g = torch.Generator().manual_seed(5)
    x_q, x_scale = K.ops.fp8.fp8_quantize_per_token_reference(torch.randn(2, 19, 64, generator=g))
    weight, weight_scale = K.ops.fp8.fp8_quantize_per_token_reference(torch.randn(40, 64, generator=g))
    bias = torch.randn(40, generator=g)
    args = tuple(a.to(triton_on) for a in (x_q, x_scale, weight, weight_scale, bias)) + (torch.float32,)
    if triton_on.type == "cuda":  # scaled_mm outranks it where it applies (bf16 out): here fp32 out
        assert K.implementation("fp8_linear", "cuda", *args) == T.KERNEL_NAME
    close(run("fp8_linear", triton_on, *args), reference("fp8_linear", *args))


@pytest.mark.parametrize("m", [3, 70])  # fused dequant-GEMM; dequantize, then the dense GEMM
@pytest.mark.parametrize("bits,group_size", [(8, 0), (4, 0), (4, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_linear(triton_on, m, bits, group_size, dtype):
    g = torch.Generator().manual_seed(6)
    n, k = 24, 64
    x = torch.randn(m, k, generator=g).to(dtype).to(triton_on)
    groups = k // group_size if group_size else 1
    scale = (torch.rand(n, groups, generator=g) * 0.1).to(triton_on)
    if bits == 8:
        weight = _int8((n, k), g)
    else:
        weight = pack_int4(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8))
    bias = torch.randn(n, generator=g).to(dtype).to(triton_on)
    args = (x, weight.to(triton_on), scale, bias, group_size)
    close(run("weight_only_linear", triton_on, *args), reference("weight_only_linear", *args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sq,sk", [(37, 37), (20, 45)])
def test_attention(triton_on, dtype, sq, sk):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, sq, 3, 16, generator=g).to(dtype).to(triton_on)
    k, v = (torch.randn(2, sk, 3, 16, generator=g).to(dtype).to(triton_on) for _ in range(2))
    out, lse = run("attention", triton_on, q, k, v, None, 0.3)
    ref_out, ref_lse = reference("attention", q, k, v, None, 0.3)
    close(out, ref_out)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)
    # the seam's layout: [B, S, H, D] views of a [B, H, S, D] tensor are read in place
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    close(
        run("attention", triton_on, qt, k, v, None, None)[0], reference("attention", q, k, v, None, None)[0]
    )
    mask = torch.ones(1, 1, sq, sk, dtype=torch.bool, device=triton_on)
    assert K.implementation("attention", triton_on.type, q, k, v, mask, None) == K.registry.REFERENCE


def test_block_sparse_attention(triton_on):
    g = torch.Generator().manual_seed(8)
    b, s, h, d, block = 2, 45, 3, 16, 16
    q, k, v = (torch.randn(b, s, h, d, generator=g).bfloat16().to(triton_on) for _ in range(3))
    n = math.ceil(s / block)
    kept = torch.full((b, h, n, 2), -1, dtype=torch.int32)
    for i in range(b):
        for j in range(h):
            for qb in range(n):
                chosen = torch.randperm(n, generator=g)[: int(torch.randint(0, 3, (), generator=g))]
                kept[i, j, qb, : len(chosen)] = chosen.int()
    kept = kept.to(triton_on)
    out, lse = run("block_sparse_attention", triton_on, q, k, v, kept, block, None)
    ref_out, ref_lse = reference("block_sparse_attention", q, k, v, kept, block, None)
    close(out, ref_out)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)  # -inf where nothing is kept
    # and what it stands for: dense attention under the block mask
    dense, _ = reference("attention", q, k, v, dense_mask(kept.cpu(), block, s, s), None)
    close(out, dense)


@pytest.mark.parametrize(
    "qk,pv,rotate,dtype",
    [
        ("int8", "fp8", True, torch.bfloat16),
        ("int8", "fp8", False, torch.float32),
        ("int8", "int8", True, torch.float16),
        ("int8", "float", False, torch.bfloat16),
        ("fp8", "fp8", True, torch.bfloat16),
    ],
)
def test_quantized_attention(triton_on, qk, pv, rotate, dtype):
    """Two key blocks of 64 (the quantization's, and P's), queries off the kernel's tiles, K offset per
    channel (what the smoothing removes). The INT8 logits are the reference's bit for bit (the kernel writes them on
    request); the FP8 logits (an fp32 sum on the tensor cores, float64 in the reference) and the output
    (P quantized against the running maximum, the reference's against the final one) at SQNR."""
    from sdkiln.kernels.ops.quantized_attention import quantize_inputs, quantized_logits
    from sdkiln.kernels.triton.quantized_attention import launch

    g = torch.Generator().manual_seed(9)
    b, sq, sk, h, d = 1, 150, 100, 2, 32
    q = torch.randn(b, sq, h, d, generator=g)
    k = torch.randn(b, sk, h, d, generator=g) + 3.0 * torch.randn(d, generator=g)
    v = torch.randn(b, sk, h, d, generator=g)
    q, k, v = (t.to(dtype).to(triton_on) for t in (q, k, v))
    out, lse = run("quantized_attention", triton_on, q, k, v, None, None, qk, pv, rotate)
    ref_out, ref_lse = reference("quantized_attention", q, k, v, None, None, qk, pv, rotate)
    close(out, ref_out)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-4, atol=1e-4)
    _, _, logits = launch(q, k, v, None, qk, pv, rotate, logits=True)
    want = quantized_logits(quantize_inputs(*(t.cpu() for t in (q, k, v)), None, qk, pv, rotate))
    if qk == "int8":
        assert torch.equal(logits.cpu(), want)
    else:
        close(logits, want)
    mask = torch.ones(1, 1, sq, sk, dtype=torch.bool, device=triton_on)
    assert K.implementation("quantized_attention", triton_on.type, q, k, v, mask, None, qk, pv, rotate) == (
        K.registry.REFERENCE
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_flux_scale_shapes_on_gpu():
    """The kernels at FLUX.1-dev shapes (4096 image + 512 text tokens, hidden 3072, 24 heads x 128)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, 4608, 3072, device=dev, generator=g, dtype=torch.bfloat16)
    scale, shift = (torch.randn(1, 3072, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    close(
        run("layer_norm_modulate", dev, x, scale, shift, 1e-6),
        reference("layer_norm_modulate", x, scale, shift, 1e-6).to(dev),
    )
    q8 = run("layer_norm_modulate_quantize", dev, x, scale, shift, 1e-6, torch.int8)
    x_q, x_scale = q8
    w_q = torch.randint(-127, 128, (3072, 3072), device=dev, dtype=torch.int8)
    w_s = torch.rand(3072, 1, device=dev) * 1e-3
    args = (x_q, x_scale, w_q, w_s, None, torch.bfloat16)
    assert torch.equal(run("w8a8_linear", dev, *args).cpu(), reference("w8a8_linear", *args))
    q, k, v = (torch.randn(1, 4608, 24, 128, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(3))
    out, _ = run("attention", dev, q, k, v, None, None)
    close(
        out,
        torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(
            1, 2
        ),
    )
    # quantized attention at FLUX's sequence and head dim (4 of the 24 heads: the float64 reference)
    from sdkiln.kernels.ops.quantized_attention import quantize_inputs, quantized_logits
    from sdkiln.kernels.triton.quantized_attention import launch

    q, k, v = (t[:, :, :4].contiguous() for t in (q, k, v))
    args = (None, None, "int8", "fp8", True)
    close(
        run("quantized_attention", dev, q, k, v, *args)[0],
        reference("quantized_attention", q, k, v, *args)[0],
    )
    _, _, logits = launch(q, k, v, None, "int8", "fp8", True, logits=True)
    # from the same quantized inputs (the rotation's matmul on the GPU rounds as the GPU does)
    assert torch.equal(logits, quantized_logits(quantize_inputs(q, k, v, None, "int8", "fp8", True)))


@pytest.mark.parametrize("dtype", HALF)
def test_lora_add(triton_on, dtype):
    """Ranks below, at and between tl.dot's 16 (padded), rows and columns off the tiles, zero scales."""
    g = torch.Generator().manual_seed(0)
    for rank, rows, n, k in [(4, 5, 40, 24), (16, 70, 130, 96), (24, 33, 64, 200)]:
        x = torch.randn(rows, k, generator=g).to(dtype).to(triton_on)
        a = (torch.randn(rank, k, generator=g) / k**0.5).to(dtype).to(triton_on)
        b = torch.randn(n, rank, generator=g).to(dtype).to(triton_on)
        scale = torch.rand(rank, generator=g).to(triton_on)
        base = torch.randn(rows, n, generator=g).to(dtype).to(triton_on)
        close(run("lora_add", triton_on, x, a, b, scale, base), reference("lora_add", x, a, b, scale, base))
    off = run("lora_add", triton_on, x, a, b, torch.zeros_like(scale), base)
    assert torch.equal(off.cpu(), base.cpu())  # a zero scale adds exactly nothing
