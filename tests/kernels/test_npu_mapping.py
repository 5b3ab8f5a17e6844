"""The Ascend kernels against a recorded fake torch_npu: which torch_npu op each sdkiln op calls,
with which arguments, layouts and dtypes, and that the result matches the reference.

The fake implements each torch_npu op from its API reference (shapes and dtypes checked, the math
written from the documented formula), so a wrong transpose, scale shape or dtype fails here. It
cannot show that the real kernels behave as documented: that needs an Ascend machine
(``docs/ascend.md``). Ops whose NPU kernel is an aten op that torch_npu runs as one aclnn kernel
(``F.layer_norm``, ``torch.addcmul``) are checked through a spy on that aten op.

Tolerances, by what is compared: quantized values and scales are exact (given the normalized values
a fused norm + quantize kernel hands to ``npu_dynamic_quant``); float outputs, computed by the fake
exactly and rounded once where the reference rounds once too (or rounds once more, in x's dtype),
must reach ``KERNEL_VS_REFERENCE_MIN_SQNR_DB`` against the reference; attention's "attends to
nothing" rows (out 0, lse -inf) are exact.
"""

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sdkiln.kernels as K
from sdkiln.kernels import int4
from sdkiln.kernels.ops import (
    attention,
    elementwise,
    fp8_block_attention,
    fused,
    int8,
    lora,
    norm,
    rope,
    sparse_attention,
    weight_only,
)
from sdkiln.metrics import sqnr_db

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_torch_npu import FLOATS, HALF, FakeTorchNpu  # noqa: E402

# Kernel (through the fake) against the reference, signal-to-noise of the difference (STYLE habit 12).
KERNEL_VS_REFERENCE_MIN_SQNR_DB = 35.0
# fp8_block_attention through the fake against its reference, relative L2 error of the output, by dtype: both
# dequantize the same FP8 blocks and differ only in the softmax's precision (the fake float64, the
# reference fp32) before one rounding to the output dtype (the bounds of the Ascend linears' check).
FP8_BLOCK_REL_ERR = {torch.float16: 3e-4, torch.bfloat16: 3e-3}

NPU_KERNELS = {  # op -> its NPU kernels, in the order the dispatcher tries them
    "quantize_per_token_int8": ["torch_npu"],
    "w8a8_linear": ["torch_npu"],
    "quantize_per_tensor_int8": ["torch_npu"],
    "w8a8_static_linear": ["torch_npu"],
    "weight_only_linear": ["torch_npu"],
    "rms_norm": ["torch_npu"],
    "layer_norm_modulate": ["torch_npu"],
    "rope": ["torch_npu"],
    "gelu_tanh": ["torch_npu"],
    "mul_add": ["torch_npu"],
    "lora_add": ["torch_npu"],
    "rms_norm_quantize": ["torch_npu"],
    "layer_norm_modulate_quantize": ["torch_npu"],
    "attention": ["torch_npu"],
    "block_sparse_attention": ["torch_npu", "torch_npu_dense_mask"],
    "fp8_block_attention": ["torch_npu"],
}
NPU_MODULES = ("sdkiln.kernels.npu.quant", "sdkiln.kernels.npu.float_ops", "sdkiln.kernels.npu.attention")


def remove_npu_kernels() -> None:
    for op in K.op_names():
        for kernel in K.kernels(op, "npu"):
            K.remove_kernel(op, "npu", kernel.name)


@pytest.fixture
def npu(monkeypatch):
    """The fake in sys.modules and the kernel modules imported against it (which registers them);
    no kernel stays registered afterwards."""
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    for name in (*NPU_MODULES, "sdkiln.kernels.npu"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    remove_npu_kernels()
    assert K.load_device_kernels("npu") == ["sdkiln.kernels.npu"]
    yield fake, importlib.import_module("sdkiln.kernels.npu.quant")
    remove_npu_kernels()


@pytest.fixture
def on_cpu(npu):
    """The NPU kernels registered for the CPU too (same names, priorities and ``supports``), so
    ``torch.ops.sdkiln.<op>`` on CPU tensors goes through the dispatcher to them and the fake."""
    fake, _ = npu
    own = [(op, k) for op in K.op_names() for k in K.kernels(op, "cpu")]  # the CPU's kernels step aside
    for op, k in own:
        K.remove_kernel(op, "cpu", k.name)
    mirrored = [(op, k) for op in K.op_names() for k in K.kernels(op, "npu")]
    for op, k in mirrored:
        K.register_kernel(op, "cpu", k.name, priority=k.priority, supports=k.supports)(k.fn)
    yield fake
    for op, k in mirrored:
        K.remove_kernel(op, "cpu", k.name)
    for op, k in own:
        K.register_kernel(op, "cpu", k.name, priority=k.priority, supports=k.supports)(k.fn)


@pytest.fixture
def aten_calls(monkeypatch):
    """``F.layer_norm`` and ``torch.addcmul`` calls, recorded as (op, args, kwargs)."""
    calls = []

    def spy(name, fn):
        def recorded(*args, **kwargs):
            calls.append((name, args, kwargs))
            return fn(*args, **kwargs)

        return recorded

    monkeypatch.setattr(F, "layer_norm", spy("layer_norm", F.layer_norm))
    monkeypatch.setattr(torch, "addcmul", spy("addcmul", torch.addcmul))
    return calls


def assert_matches(expected: torch.Tensor, got: torch.Tensor) -> None:
    """The reference's contract (shape, dtype, contiguous) and its values within the stated SQNR."""
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous()
    assert sqnr_db(expected, got) > KERNEL_VS_REFERENCE_MIN_SQNR_DB


def test_kernels_register_for_npu_only_and_come_out_again(npu):
    assert K.load_device_kernels("npu") == ["sdkiln.kernels.npu"]  # a second load is harmless
    for op in K.op_names():
        assert [k.name for k in K.kernels(op, "npu")] == NPU_KERNELS.get(op, [])
        assert not {k.name for k in K.kernels(op, "cpu")} & set(NPU_KERNELS.get(op, []))
    remove_npu_kernels()
    assert all(K.implementation(op, "npu") == "reference" for op in K.op_names())


def test_every_op_has_an_npu_kernel_or_is_left_on_the_reference_by_name(npu):
    """A new op fails here until it gets an NPU kernel or a reason in ``REFERENCE_ONLY``."""
    reference_only = importlib.import_module("sdkiln.kernels.npu").REFERENCE_ONLY
    with_kernel = {op for op in K.op_names() if K.kernels(op, "npu")}
    assert set(reference_only) == {"fp8_quantize_per_token", "fp8_linear", "quantized_attention"}
    assert with_kernel.isdisjoint(reference_only) and all(reference_only.values())
    assert with_kernel | set(reference_only) == set(K.op_names())


@pytest.mark.parametrize("dtype", HALF)
def test_dynamic_quantization_is_npu_dynamic_quant(npu, dtype):
    fake, quant = npu
    x = torch.randn(2, 5, 64).to(dtype)
    q, scale = quant.quantize_per_token_int8(x)
    ((op, args, kwargs),) = fake.calls
    assert op == "npu_dynamic_quant" and args[0].shape == (10, 64)
    ref_q, ref_scale = int8.quantize_per_token_int8_reference(x)
    assert q.shape == x.shape and scale.shape == (2, 5, 1)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_w8a8_linear_is_npu_quant_matmul_with_pertoken_scale(npu, dtype, with_bias):
    fake, quant = npu
    x_q, x_scale = int8.quantize_per_token_int8_reference(torch.randn(3, 4, 96))
    w = torch.randint(-127, 128, (48, 96), dtype=torch.int8)
    w_scale = torch.rand(48, 1) / 100 + 1e-3
    bias = torch.randn(48).to(dtype) if with_bias else None
    y = quant.w8a8_linear(x_q, x_scale, w, w_scale, bias, dtype)
    ((op, args, kwargs),) = fake.calls
    x1, x2, scale = args
    assert op == "npu_quant_matmul"
    assert x1.shape == (12, 96) and x2.shape == (96, 48)
    assert x2.data_ptr() == w.data_ptr() and x2.stride() == (1, 96), (
        "the weight goes in as a view, not a copy"
    )
    assert scale.shape == (48,) and kwargs["pertoken_scale"].shape == (12,)
    assert kwargs["output_dtype"] == dtype and kwargs["offset"] is None
    assert (kwargs["bias"] is None) == (bias is None)
    expected = int8.w8a8_linear_reference(x_q, x_scale, w, w_scale, bias, dtype)
    assert y.shape == expected.shape == (3, 4, 48) and y.dtype == dtype
    assert sqnr_db(expected, y) > KERNEL_VS_REFERENCE_MIN_SQNR_DB


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_static_quantization_is_npu_quantize_with_int8_offset(npu, dtype):
    fake, quant = npu
    x = (torch.randn(2, 7, 64) * 3).to(dtype)
    scale, offset = torch.tensor([0.05]), torch.tensor([-17.0])
    q = quant.quantize_per_tensor_int8(x, scale, offset)
    ((op, args, _),) = fake.calls
    assert op == "npu_quantize" and args[0] is x and args[3:] == (torch.qint8, -1, True)
    assert args[1].shape == args[2].shape == (1,) and args[2].dtype == torch.int8
    # npu_quantize documents round(x / s + o), the reference's order too: equal, ties included.
    assert torch.equal(q, int8.quantize_per_tensor_int8_reference(x, scale, offset))


@pytest.mark.parametrize("dtype", HALF)
def test_w8a8_static_linear_is_npu_quant_matmul_with_int32_bias(npu, dtype):
    fake, quant = npu
    x_q = torch.randint(-128, 128, (3, 5, 64), dtype=torch.int8)
    w = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    deq = torch.rand(32) / 1000 + 1e-4
    quant_bias = torch.randint(-5000, 5000, (32,), dtype=torch.int32)
    y = quant.w8a8_static_linear(x_q, w, deq, quant_bias, dtype)
    ((op, args, kwargs),) = fake.calls
    assert op == "npu_quant_matmul" and args[0].shape == (15, 64)
    assert args[1].data_ptr() == w.data_ptr() and args[1].shape == (64, 32)
    assert args[2] is deq and kwargs["bias"] is quant_bias and kwargs["pertoken_scale"] is None
    assert kwargs["output_dtype"] == dtype
    expected = int8.w8a8_static_linear_reference(x_q, w, deq, quant_bias, dtype)
    assert y.shape == expected.shape == (3, 5, 32) and y.dtype == dtype
    assert sqnr_db(expected, y) > KERNEL_VS_REFERENCE_MIN_SQNR_DB


@pytest.mark.parametrize("group_size", [0, 32], ids=["w8a16", "w4a16_g32"])
@pytest.mark.parametrize("dtype", HALF)
def test_weight_only_linear_is_npu_weight_quant_batchmatmul(npu, dtype, group_size):
    fake, quant = npu
    n, k = 40, 64
    x = torch.randn(2, 3, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    if group_size:
        weight = int4.pack_int4(torch.randint(-8, 8, (n, k), dtype=torch.int8))
        scale = torch.rand(n, k // group_size) / 10 + 1e-2
    else:
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale = torch.rand(n, 1) / 100 + 1e-3
    y = quant.weight_only_linear(x, weight, scale, bias, group_size)
    names = [c[0] for c in fake.calls]
    call = fake.calls[-1]
    if group_size:
        assert names == ["npu_convert_weight_to_int4pack", "npu_weight_quant_batchmatmul"]
        assert fake.calls[0][1][0].shape == (n, k)  # int4 values one per int32, [N, K], packed by torch_npu
        assert call[1][1].shape == (k // 8, n)
    else:
        assert names == ["npu_weight_quant_batchmatmul"]
        assert call[1][1].data_ptr() == weight.data_ptr() and call[1][1].shape == (k, n)
    assert call[1][2].shape == ((k // group_size if group_size else 1), n)
    assert call[2]["antiquant_group_size"] == group_size
    expected = weight_only.weight_only_linear_reference(x, weight, scale, bias, group_size)
    assert y.shape == expected.shape and y.dtype == dtype
    assert sqnr_db(expected, y) > KERNEL_VS_REFERENCE_MIN_SQNR_DB


def test_float32_is_refused_not_rerouted(npu):
    _, quant = npu
    x_q, x_scale = int8.quantize_per_token_int8_reference(torch.randn(4, 32))
    w, w_scale = torch.ones(8, 32, dtype=torch.int8), torch.ones(8, 1)
    with pytest.raises(
        ValueError, match="w8a8_linear on Ascend: .*float16 or bfloat16 outputs, got torch.float32"
    ):
        quant.w8a8_linear(x_q, x_scale, w, w_scale, None, torch.float32)
    with pytest.raises(ValueError, match="quantize_per_token_int8 on Ascend"):
        quant.quantize_per_token_int8(torch.randn(4, 32))
    with pytest.raises(ValueError, match="w8a8_static_linear on Ascend"):
        quant.w8a8_static_linear(x_q, w, torch.ones(8), torch.zeros(8, dtype=torch.int32), torch.float32)
    with pytest.raises(ValueError, match="weight_only_linear on Ascend"):
        quant.weight_only_linear(torch.randn(4, 32), w, w_scale, None, 0)


# ---- float ops: torch.ops.sdkiln.<op> on CPU tensors, through the dispatcher to the NPU kernels ----


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "weight_dtype", [None, "same", torch.float32], ids=["no_weight", "weight_same", "weight_fp32"]
)
def test_rms_norm_is_npu_rms_norm(on_cpu, dtype, weight_dtype):
    fake = on_cpu
    x = torch.randn(2, 5, 64).to(dtype)
    weight = None
    if weight_dtype is not None:
        weight = (torch.rand(64) + 0.5).to(dtype if weight_dtype == "same" else weight_dtype)
    assert K.implementation("rms_norm", "cpu", x, weight, 1e-6) == "torch_npu"
    y = torch.ops.sdkiln.rms_norm(x, weight, 1e-6)
    ((op, (x_in, gamma), kwargs),) = fake.calls
    assert op == "npu_rms_norm" and x_in.data_ptr() == x.data_ptr() and kwargs == {"epsilon": 1e-6}
    assert gamma.shape == (64,)
    if weight is None:  # gamma is required: ones in x's dtype stand in
        assert gamma.dtype == dtype and torch.equal(gamma, torch.ones(64, dtype=dtype))
    else:  # same dtype as x, or float32 (an Atlas A2/A3 pairing)
        assert gamma.dtype == (dtype if weight.dtype == dtype else torch.float32)
    assert_matches(norm.rms_norm_reference(x, weight, 1e-6), y)


@pytest.mark.parametrize(
    "x_shape, weight_shape", [((64,), (64,)), ((2, 3, 64), (3, 64))], ids=["1d_input", "2d_weight"]
)
def test_rms_norm_outside_npu_rms_norm_runs_the_reference(on_cpu, x_shape, weight_shape):
    x, weight = torch.randn(x_shape).bfloat16(), torch.rand(weight_shape).bfloat16()
    assert K.implementation("rms_norm", "cpu", x, weight, 1e-6) == "reference"
    assert torch.equal(torch.ops.sdkiln.rms_norm(x, weight, 1e-6), norm.rms_norm_reference(x, weight, 1e-6))
    assert on_cpu.calls == []


@pytest.mark.parametrize("dtype", FLOATS)
def test_per_sample_modulation_is_the_layer_norms_affine(on_cpu, aten_calls, dtype):
    x = torch.randn(2, 7, 64).to(dtype)
    scale, shift = torch.randn(2, 64).to(dtype) / 4, torch.randn(2, 64).to(dtype)
    y = torch.ops.sdkiln.layer_norm_modulate(x, scale, shift, 1e-6)
    calls = list(aten_calls)
    assert [c[0] for c in calls] == ["layer_norm", "layer_norm"], "one LayerNorm per sample, no addcmul"
    for i, (_, (x_i, shape, weight, bias, eps), _) in enumerate(calls):
        assert torch.equal(x_i, x[i]) and shape == (64,) and eps == 1e-6
        assert weight.dtype == bias.dtype == dtype
        assert torch.equal(weight, (1 + scale[i].float()).to(dtype)) and torch.equal(bias, shift[i])
    assert on_cpu.calls == []
    assert_matches(norm.layer_norm_modulate_reference(x, scale, shift, 1e-6), y)


def test_one_modulation_for_every_sample_is_one_layer_norm(on_cpu, aten_calls):
    x = torch.randn(3, 5, 64).bfloat16()
    scale, shift = torch.randn(1, 1, 64).bfloat16() / 4, torch.randn(64).bfloat16()
    y = torch.ops.sdkiln.layer_norm_modulate(x, scale, shift, 1e-5)
    ((op, (x_in, _, weight, bias, _), _),) = list(aten_calls)
    assert op == "layer_norm" and x_in is x and weight.shape == bias.shape == (64,)
    assert_matches(norm.layer_norm_modulate_reference(x, scale, shift, 1e-5), y)


@pytest.mark.parametrize("dtype", HALF)
def test_token_wise_modulation_is_layer_norm_then_addcmul(on_cpu, aten_calls, dtype):
    x = torch.randn(2, 7, 64).to(dtype)
    scale, shift = torch.randn(2, 7, 64) / 4, torch.randn(2, 7, 64)  # float32 tables, rounded to x's dtype
    y = torch.ops.sdkiln.layer_norm_modulate(x, scale, shift, 1e-6)
    (ln, (add_op, (z, normed, factor), _)) = list(aten_calls)
    assert ln[0] == "layer_norm" and ln[1][0] is x and len(ln[1]) == 2 and ln[2] == {"eps": 1e-6}
    assert add_op == "addcmul" and z.dtype == normed.dtype == factor.dtype == dtype
    assert torch.equal(factor, (1 + scale).to(dtype))
    assert_matches(norm.layer_norm_modulate_reference(x, scale, shift, 1e-6), y)


ROPE_CASES = {  # x shape, cos/sin shape, interleaved, the 4-D table npu_rotary_mul gets
    "bnsd_half": ((2, 3, 16, 64), (16, 64), False, (1, 1, 16, 64)),
    "bnsd_interleave": ((2, 3, 16, 64), (16, 64), True, (1, 1, 16, 64)),
    "bsnd_interleave": ((2, 16, 3, 64), (16, 1, 64), True, (1, 16, 1, 64)),
    "bnsd_per_batch_half": ((2, 3, 16, 64), (2, 1, 16, 64), False, (2, 1, 16, 64)),
    "sbnd_half": ((16, 2, 3, 32), (16, 1, 1, 32), False, (16, 1, 1, 32)),
}


@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize(
    "dtype, table_dtype",
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float32)],
    ids=["bf16_fp32_tables", "fp16", "fp32"],
)
def test_rope_is_npu_rotary_mul(on_cpu, case, dtype, table_dtype):
    x_shape, table_shape, interleaved, table_4d = ROPE_CASES[case]
    x = torch.randn(x_shape).to(dtype)
    angles = torch.rand(table_shape) * 6
    cos, sin = angles.cos().to(table_dtype), angles.sin().to(table_dtype)
    assert K.implementation("rope", "cpu", x, cos, sin, interleaved) == "torch_npu"
    y = torch.ops.sdkiln.rope(x, cos, sin, interleaved)
    ((op, (x_in, r1, r2), kwargs),) = on_cpu.calls
    compute = torch.promote_types(dtype, table_dtype)  # float32 tables: float32, as MindIE SD computes
    assert op == "npu_rotary_mul" and kwargs == {"rotary_mode": "interleave" if interleaved else "half"}
    assert x_in.shape == x.shape and x_in.dtype == r1.dtype == r2.dtype == compute
    assert r1.shape == r2.shape == table_4d
    assert_matches(rope.rope_reference(x, cos, sin, interleaved), y)


ROPE_UNSUPPORTED = {  # x shape, cos/sin shape, interleaved
    "3d_input": ((3, 16, 64), (16, 64), False),
    "full_table": ((2, 3, 16, 64), (2, 3, 16, 64), False),
    "interleave_per_batch": ((2, 3, 16, 64), (2, 1, 16, 64), True),
    "head_dim_896": ((1, 2, 4, 896), (4, 896), False),
    "interleave_bn_1000": ((1, 1000, 2, 8), (2, 8), True),
    "float64": ((2, 3, 16, 64), (16, 64), False),
}


@pytest.mark.parametrize("case", ROPE_UNSUPPORTED)
def test_rope_outside_npu_rotary_mul_runs_the_reference(on_cpu, case):
    x_shape, table_shape, interleaved = ROPE_UNSUPPORTED[case]
    dtype = torch.float64 if case == "float64" else torch.bfloat16
    x, angles = torch.randn(x_shape).to(dtype), torch.rand(table_shape)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert K.implementation("rope", "cpu", x, cos, sin, interleaved) == "reference"
    y = torch.ops.sdkiln.rope(x, cos, sin, interleaved)
    assert on_cpu.calls == [] and torch.equal(y, rope.rope_reference(x, cos, sin, interleaved))


@pytest.mark.parametrize("dtype", FLOATS)
def test_gelu_tanh_is_npu_gelu_tanh_not_fast_gelu(on_cpu, dtype):
    x = (torch.randn(3, 5, 64) * 3).to(dtype)
    y = torch.ops.sdkiln.gelu_tanh(x)
    ((op, (x_in,), kwargs),) = on_cpu.calls  # the fake has no npu_fast_gelu: calling it would fail
    assert op == "npu_gelu" and x_in.data_ptr() == x.data_ptr() and kwargs == {"approximate": "tanh"}
    assert_matches(elementwise.gelu_tanh_reference(x), y)


@pytest.mark.parametrize(
    "dtypes",
    [(torch.bfloat16,) * 3, (torch.float16,) * 3, (torch.bfloat16, torch.float32, torch.bfloat16)],
    ids=["bf16", "fp16", "mixed"],
)
def test_mul_add_is_addcmul_in_the_promoted_dtype(on_cpu, aten_calls, dtypes):
    gate, branch, residual = (
        torch.randn(s).to(d) for s, d in zip([(2, 1, 64), (2, 7, 64), (2, 7, 64)], dtypes, strict=True)
    )
    y = torch.ops.sdkiln.mul_add(gate, branch, residual)
    ((op, (z, x, w), _),) = list(aten_calls)
    promoted = torch.promote_types(torch.promote_types(*dtypes[:2]), dtypes[2])
    assert op == "addcmul" and z.dtype == x.dtype == w.dtype == promoted
    assert torch.equal(z, residual.to(promoted)) and x.shape == (2, 1, 64)
    assert_matches(elementwise.mul_add_reference(gate, branch, residual), y)


@pytest.mark.parametrize("dtype", HALF)
def test_lora_add_is_two_matmuls_in_the_model_dtype(on_cpu, dtype):
    """The branch on Ascend: no torch_npu call, the shrink and the expand in the model dtype."""
    g = torch.Generator().manual_seed(0)
    x, base = torch.randn(2, 7, 64, generator=g).to(dtype), torch.randn(2, 7, 48, generator=g).to(dtype)
    a, b = torch.randn(8, 64, generator=g).to(dtype) / 8, torch.randn(48, 8, generator=g).to(dtype)
    scale = torch.tensor([0.5] * 4 + [1.0] * 2 + [0.0] * 2)
    assert K.implementation("lora_add", "cpu", x, a, b, scale, base) == "torch_npu"
    y = torch.ops.sdkiln.lora_add(x, a, b, scale, base)
    assert on_cpu.calls == []
    assert_matches(lora.lora_add_reference(x, a, b, scale, base), y)


# ---- norm + per-token int8 ----


def _check_quantized(fake_call, q, scale, x_shape) -> None:
    """q and scale are exactly quantize_per_token_int8's of what the norm handed npu_dynamic_quant."""
    op, (normed,), kwargs = fake_call
    assert op == "npu_dynamic_quant" and normed.dim() == 2 and kwargs == {"smooth_scales": None}
    ref_q, ref_scale = int8.quantize_per_token_int8_reference(normed.reshape(x_shape))
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("dtype", HALF)
def test_rms_norm_quantize_is_npu_rms_norm_then_npu_dynamic_quant(on_cpu, dtype):
    x, weight = torch.randn(2, 5, 64).to(dtype), (torch.rand(64) + 0.5).to(dtype)
    q, scale = torch.ops.sdkiln.rms_norm_quantize(x, weight, 1e-6, torch.int8)
    assert [c[0] for c in on_cpu.calls] == ["npu_rms_norm", "npu_dynamic_quant"]
    _check_quantized(on_cpu.calls[1], q, scale, x.shape)
    ref_q, ref_scale = fused.rms_norm_quantize_reference(x, weight, 1e-6, torch.int8)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (2, 5, 1)
    assert sqnr_db(ref_q * ref_scale, q * scale) > KERNEL_VS_REFERENCE_MIN_SQNR_DB


@pytest.mark.parametrize("dtype", HALF)
def test_layer_norm_modulate_quantize_is_the_adaln_then_npu_dynamic_quant(on_cpu, aten_calls, dtype):
    x = torch.randn(2, 7, 64).to(dtype)
    scale, shift = torch.randn(2, 64).to(dtype) / 4, torch.randn(2, 64).to(dtype)
    q, qscale = torch.ops.sdkiln.layer_norm_modulate_quantize(x, scale, shift, 1e-6, torch.int8)
    assert [c[0] for c in aten_calls] == ["layer_norm", "layer_norm"]
    assert [c[0] for c in on_cpu.calls] == ["npu_dynamic_quant"]
    _check_quantized(on_cpu.calls[0], q, qscale, x.shape)
    ref_q, ref_scale = fused.layer_norm_modulate_quantize_reference(x, scale, shift, 1e-6, torch.int8)
    assert q.shape == x.shape and qscale.shape == (2, 7, 1)
    assert sqnr_db(ref_q * ref_scale, q * qscale) > KERNEL_VS_REFERENCE_MIN_SQNR_DB


def test_float8_norm_quantize_runs_the_reference_and_float32_is_refused(on_cpu):
    x = torch.randn(2, 3, 32).bfloat16()
    scale, shift = torch.randn(2, 32).bfloat16(), torch.randn(2, 32).bfloat16()
    fp8 = torch.float8_e4m3fn
    assert K.implementation("rms_norm_quantize", "cpu", x, None, 1e-6, fp8) == "reference"
    assert K.implementation("layer_norm_modulate_quantize", "cpu", x, scale, shift, 1e-6, fp8) == "reference"
    q, s = torch.ops.sdkiln.rms_norm_quantize(x, None, 1e-6, fp8)
    ref_q, ref_s = fused.rms_norm_quantize_reference(x, None, 1e-6, fp8)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    torch.ops.sdkiln.layer_norm_modulate_quantize(x, scale, shift, 1e-6, fp8)
    assert on_cpu.calls == []
    with pytest.raises(ValueError, match="rms_norm_quantize on Ascend: .*got torch.float32"):
        torch.ops.sdkiln.rms_norm_quantize(x.float(), None, 1e-6, torch.int8)
    with pytest.raises(ValueError, match="layer_norm_modulate_quantize on Ascend: .*got torch.float32"):
        torch.ops.sdkiln.layer_norm_modulate_quantize(x.float(), scale, shift, 1e-6, torch.int8)


# ---- attention ----


def _qkv(b, sq, sk, h, d, dv, dtype):
    return (
        torch.randn(b, sq, h, d).to(dtype),
        torch.randn(b, sk, h, d).to(dtype),
        torch.randn(b, sk, h, dv).to(dtype),
    )


def assert_attention_matches(expected, got) -> None:
    """out within the SQNR bound; lse's -inf (attends to nothing) exactly, its finite values within it."""
    (out_ref, lse_ref), (out, lse) = expected, got
    assert_matches(out_ref, out)
    assert lse.shape == lse_ref.shape and lse.dtype == torch.float32 and lse.is_contiguous()
    finite = torch.isfinite(lse_ref)
    assert torch.equal(finite, torch.isfinite(lse)) and bool((lse[~finite] == -math.inf).all())
    assert sqnr_db(lse_ref[finite], lse[finite]) > KERNEL_VS_REFERENCE_MIN_SQNR_DB
    assert bool((out[(~finite).unsqueeze(-1).expand_as(out)] == 0).all())


def _mask(kind: str, b: int, h: int, sq: int, sk: int):
    """A boolean mask (True attends) and the shape npu_fusion_attention's atten_mask gets."""
    if kind == "none":
        return None, None
    if kind == "key_padding":  # [B, 1, 1, Sk], the second sample's last keys padded
        mask = torch.ones(b, 1, 1, sk, dtype=torch.bool)
        mask[1, ..., sk - 5 :] = False
        return mask, (b, 1, sq, sk)
    if kind == "per_head":  # [1, H, Sq, Sk] with one query row of head 0 attending nothing
        mask = torch.rand(1, h, sq, sk) > 0.3
        mask[0, 0, 2] = False
        return mask, (b, h, sq, sk)
    mask = torch.rand(sq, sk) > 0.5  # "shared": [Sq, Sk]
    return mask, (1, 1, sq, sk)


@pytest.mark.parametrize("mask_kind", ["none", "key_padding", "per_head", "shared"])
@pytest.mark.parametrize("dtype", HALF)
def test_attention_is_npu_fusion_attention_bsnd(on_cpu, dtype, mask_kind):
    b, sq, sk, h, d, dv = 2, 9, 12, 3, 64, 32
    q, k, v = _qkv(b, sq, sk, h, d, dv, dtype)
    mask, atten_shape = _mask(mask_kind, b, h, sq, sk)
    scale = None if mask_kind == "none" else 0.2
    assert K.implementation("attention", "cpu", q, k, v, mask, scale) == "torch_npu"
    got = torch.ops.sdkiln.attention(q, k, v, mask, scale)
    ((op, (q_in, k_in, v_in, head_num, layout), kwargs),) = on_cpu.calls
    assert op == "npu_fusion_attention" and layout == "BSND" and head_num == h
    assert (q_in.data_ptr(), k_in.data_ptr(), v_in.data_ptr()) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert kwargs["scale"] == (1 / math.sqrt(d) if scale is None else scale)  # torch_npu's default is 1.0
    atten_mask = kwargs["atten_mask"]
    if mask is None:
        assert atten_mask is None
    else:  # True = masked out, the inverse of ours, in a documented shape
        assert atten_mask.dtype == torch.bool and atten_mask.shape == atten_shape
        assert torch.equal(atten_mask, (~mask).expand(b, h, sq, sk)[: atten_shape[0], : atten_shape[1]])
    assert_attention_matches(attention.attention_reference(q, k, v, mask, scale), got)


ATTENTION_UNSUPPORTED = {  # what npu_fusion_attention does not take, or we do not send it
    "float32": dict(dtype=torch.float32),
    "float_mask": dict(mask=torch.zeros(1, 1, 9, 12)),
    "head_dim_800": dict(d=800),
    "value_wider_than_key": dict(dv=128),
}


@pytest.mark.parametrize("case", ATTENTION_UNSUPPORTED)
def test_attention_outside_npu_fusion_attention_runs_the_reference(on_cpu, case):
    args = dict(dtype=torch.bfloat16, mask=None, d=64, dv=64) | ATTENTION_UNSUPPORTED[case]
    q, k, v = _qkv(1, 9, 12, 2, args["d"], args["dv"], args["dtype"])
    assert K.implementation("attention", "cpu", q, k, v, args["mask"], None) == "reference"
    out, lse = torch.ops.sdkiln.attention(q, k, v, args["mask"], None)
    out_ref, lse_ref = attention.attention_reference(q, k, v, args["mask"], None)
    assert on_cpu.calls == [] and torch.equal(out, out_ref) and torch.equal(lse, lse_ref)


def _kept(b, h, nq, nk, empty_block: bool) -> torch.Tensor:
    """Random distinct kept key blocks per (batch, head, query block), -1 padded; one query block
    of head 0 keeps nothing when asked."""
    kept = torch.full((b, h, nq, nk), -1, dtype=torch.int32)
    for idx in torch.cartesian_prod(torch.arange(b), torch.arange(h), torch.arange(nq)).tolist():
        chosen = torch.randperm(nk)[: int(torch.randint(1, nk + 1, ()))]
        kept[tuple(idx)][: len(chosen)] = chosen.int()
    if empty_block:
        kept[0, 0, 1] = -1
    return kept


@pytest.mark.parametrize("dtype", HALF)
def test_block_sparse_attention_is_npu_block_sparse_attention_bnsd(on_cpu, dtype):
    b, s, h, d, block = 2, 300, 2, 64, 128  # 3 blocks, the last one short
    q, k, v = _qkv(b, s, s, h, d, d, dtype)
    kept = _kept(b, h, 3, 3, empty_block=True)
    assert K.implementation("block_sparse_attention", "cpu", q, k, v, kept, block, None) == "torch_npu"
    got = torch.ops.sdkiln.block_sparse_attention(q, k, v, kept, block, None)
    ((op, (q_in, k_in, v_in, blocks, block_shape), kwargs),) = on_cpu.calls
    assert op == "npu_block_sparse_attention" and block_shape == [block, block]
    for given, ours in ((q_in, q), (k_in, k), (v_in, v)):  # BNSD copies
        assert given.is_contiguous() and torch.equal(given, ours.transpose(1, 2))
    assert kwargs == {
        "q_input_layout": "BNSD",
        "kv_input_layout": "BNSD",
        "num_key_value_heads": h,
        "scale_value": 1 / math.sqrt(d),
        "inner_precise": 0,
        "softmax_lse_flag": 1,
    }
    expected_blocks = torch.zeros(b, h, 3, 3, dtype=torch.int8)
    for idx in (kept >= 0).nonzero().tolist():
        expected_blocks[tuple(idx[:3]) + (int(kept[tuple(idx)]),)] = 1
    assert blocks.dtype == torch.int8 and torch.equal(blocks, expected_blocks)
    expected = sparse_attention.block_sparse_attention_reference(q, k, v, kept, block, None)
    assert_attention_matches(expected, got)
    assert bool((got[1][0, 128:256, 0] == -math.inf).all()), "the query block that keeps nothing"


@pytest.mark.parametrize("case", ["block_64", "no_npu_block_sparse_attention", "head_dim_96"])
def test_block_sparse_attention_falls_back_to_fusion_attention_with_the_dense_mask(on_cpu, monkeypatch, case):
    block = 64 if case == "block_64" else 128
    d = 96 if case == "head_dim_96" else 64
    if case == "no_npu_block_sparse_attention":  # torch_npu before 26.0.0
        monkeypatch.setattr(on_cpu, "npu_block_sparse_attention", None)
    b, s, h = 1, 200, 2
    q, k, v = _qkv(b, s, s, h, d, d, torch.bfloat16)
    nb = math.ceil(s / block)
    kept = _kept(b, h, nb, nb, empty_block=True)
    runs = K.implementation("block_sparse_attention", "cpu", q, k, v, kept, block, 0.1)
    assert runs == "torch_npu_dense_mask"
    got = torch.ops.sdkiln.block_sparse_attention(q, k, v, kept, block, 0.1)
    ((op, _, kwargs),) = on_cpu.calls
    assert op == "npu_fusion_attention" and kwargs["scale"] == 0.1
    assert torch.equal(kwargs["atten_mask"], ~sparse_attention.dense_mask(kept, block, s, s))
    expected = sparse_attention.block_sparse_attention_reference(q, k, v, kept, block, 0.1)
    assert_attention_matches(expected, got)


def test_float32_block_sparse_attention_runs_the_reference(on_cpu):
    q, k, v = _qkv(1, 130, 130, 2, 64, 64, torch.float32)
    kept = _kept(1, 2, 2, 2, empty_block=False)
    assert K.implementation("block_sparse_attention", "cpu", q, k, v, kept, 128, None) == "reference"
    torch.ops.sdkiln.block_sparse_attention(q, k, v, kept, 128, None)
    assert on_cpu.calls == []


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_fp8_block_attention_is_npu_dynamic_block_quant_then_fia_v2_per_batch_row(on_cpu, dtype, rotate):
    b, sq, sk, h, d = 2, 300, 520, 3, 64  # partial blocks of 128 queries and 256 keys
    q, k, v = _qkv(b, sq, sk, h, d, d, dtype)
    assert K.implementation("fp8_block_attention", "cpu", q, k, v, None, 0.2, rotate) == "torch_npu"
    got = torch.ops.sdkiln.fp8_block_attention(q, k, v, None, 0.2, rotate)
    names = [c[0] for c in on_cpu.calls]
    assert names == (["npu_dynamic_block_quant"] * 3 + ["npu_fused_infer_attention_score_v2"]) * b
    quants = [c for c in on_cpu.calls if c[0] == "npu_dynamic_block_quant"]
    assert [c[2]["row_block_size"] for c in quants] == [128, 256, 256] * b
    assert all(c[2]["col_block_size"] == 128 and c[1][0].shape[0] == h for c in quants)  # one batch row, NSD
    fia = [c[2] for c in on_cpu.calls if c[0] == "npu_fused_infer_attention_score_v2"]
    assert all(
        f["softmax_scale"] == 0.2 and f["out_dtype"] == dtype and f["input_layout"] == "BNSD" for f in fia
    )
    want = fp8_block_attention.fp8_block_attention_reference(q, k, v, None, 0.2, rotate)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel <= FP8_BLOCK_REL_ERR[dtype], rel


FP8_BLOCK_UNSUPPORTED = {  # what the FA quantization does not take, or we do not send it
    "float32": dict(dtype=torch.float32),
    "mask": dict(mask=torch.ones(1, 1, 9, 12, dtype=torch.bool)),
    "head_dim_256": dict(d=256),
}


@pytest.mark.parametrize("case", FP8_BLOCK_UNSUPPORTED)
def test_fp8_block_attention_outside_the_fa_quantization_runs_the_reference(on_cpu, case):
    args = dict(dtype=torch.bfloat16, mask=None, d=64) | FP8_BLOCK_UNSUPPORTED[case]
    q, k, v = _qkv(1, 9, 12, 2, args["d"], args["d"], args["dtype"])
    assert K.implementation("fp8_block_attention", "cpu", q, k, v, args["mask"], None, False) == "reference"
    out = torch.ops.sdkiln.fp8_block_attention(q, k, v, args["mask"], None, False)
    ref = fp8_block_attention.fp8_block_attention_reference(q, k, v, args["mask"], None, False)
    assert on_cpu.calls == [] and torch.equal(out, ref)
