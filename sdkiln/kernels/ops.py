"""The ``sdkiln`` op namespace: one schema, one fake and one reference per op; fused kernels per device.

Each op is defined once with a plain ``torch.library.Library`` define + impl, as vLLM's
``direct_register_custom_op``, rather than ``torch.library.custom_op``: a call adds about 5 us of
Python under ``inference_mode`` and 15 us under ``no_grad`` (custom_op: 10 and 21 us, on the 2-core
build machine), and it does not import ``torch._dynamo``, which custom_op does on the first call and
which imports triton where it is installed. Per op:

* the schema, in ``_SCHEMAS`` below: the contract every kernel implements;
* the pure-torch reference (``sdkiln.kernels.reference``), registered under
  ``CompositeExplicitAutograd``: it is the CPU implementation and runs on any device that has no
  kernel of its own;
* a fake (meta) function, so ``torch.compile`` and ``torch.export`` trace the op without running it;
* an autograd formula: float ops differentiate through the reference, recomputed from the saved
  inputs in backward (training through a fused kernel works, at the cost of a second forward);
  the quantized ops are inference-only and their backward raises.

A fused kernel for a device registers itself from its own module, which only the runtime imports
(``import sdkiln`` never imports triton or torch_npu)::

    from sdkiln.kernels.ops import register_kernel

    @register_kernel("rms_norm", "cuda", name="triton")
    def rms_norm_triton(x, weight, eps):  # the schema's arguments, in order
        ...

Device types are "cuda" (dispatch key CUDA), "npu" (PrivateUse1, the key torch_npu claims) and
"cpu". The kernel then takes precedence over the reference for tensors on that device;
``implementation(op, device_type)`` says which one runs ("reference" or the kernel's name), so a
test can assert the kernel it measured, and ``remove_kernel`` takes it out again.

Importing this module twice (``importlib.reload``) keeps the registrations of the first import:
the dispatcher is process-wide, so its bookkeeping here is carried over rather than redefined.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from sdkiln.kernels import reference
from sdkiln.kernels.platform import DISPATCH_KEYS

NAMESPACE = "sdkiln"

_SCHEMAS = {
    "rms_norm": "rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor",
    "layer_norm_modulate": "layer_norm_modulate(Tensor x, Tensor scale, Tensor shift, float eps) -> Tensor",
    "rope": "rope(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor",
    "gelu_tanh": "gelu_tanh(Tensor x) -> Tensor",
    "mul_add": "mul_add(Tensor x, Tensor y, Tensor z) -> Tensor",
    "quantize_per_token_int8": "quantize_per_token_int8(Tensor x) -> (Tensor, Tensor)",
    "w8a8_linear": (
        "w8a8_linear(Tensor x_q, Tensor x_scale, Tensor weight, Tensor weight_scale, Tensor? bias, "
        "ScalarType out_dtype) -> Tensor"
    ),
    "attention": "attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale) -> (Tensor, Tensor)",
    "quantize_per_tensor_int8": "quantize_per_tensor_int8(Tensor x, Tensor scale, Tensor offset) -> Tensor",
    "w8a8_static_linear": (
        "w8a8_static_linear(Tensor x_q, Tensor weight, Tensor deq_scale, Tensor quant_bias, "
        "ScalarType out_dtype) -> Tensor"
    ),
    "fp8_quantize_per_token": "fp8_quantize_per_token(Tensor x) -> (Tensor, Tensor)",
    "fp8_linear": (
        "fp8_linear(Tensor x_q, Tensor x_scale, Tensor weight, Tensor weight_scale, Tensor? bias, "
        "ScalarType out_dtype) -> Tensor"
    ),
    "weight_only_linear": (
        "weight_only_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, int group_size) -> Tensor"
    ),
}
_DIFFERENTIABLE = {"rms_norm", "layer_norm_modulate", "rope", "gelu_tanh", "mul_add", "attention"}


def _fake_like(x: Tensor) -> Tensor:
    return x.new_empty(x.shape)


def _fake_layer_norm_modulate(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    reference.check_broadcast(
        "layer_norm_modulate", x, reference.per_sample(scale, x), reference.per_sample(shift, x)
    )
    return _fake_like(x)


def _fake_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    reference.check_broadcast("rope", x, cos, sin)
    return _fake_like(x)


def _fake_mul_add(x: Tensor, y: Tensor, z: Tensor) -> Tensor:
    dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), z.dtype)
    return x.new_empty(torch.broadcast_shapes(x.shape, y.shape, z.shape), dtype=dtype)


def _fake_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def _fake_w8a8_linear(x_q, x_scale, weight, weight_scale, bias, out_dtype) -> Tensor:
    reference.check_w8a8_linear(x_q, x_scale, weight, weight_scale)
    return x_q.new_empty((*x_q.shape[:-1], weight.shape[0]), dtype=out_dtype)


def _fake_fp8_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    scale = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), scale


def _fake_fp8_linear(x_q, x_scale, weight, weight_scale, bias, out_dtype) -> Tensor:
    reference.check_fp8_linear(x_q, x_scale, weight, weight_scale)
    return x_q.new_empty((*x_q.shape[:-1], weight.shape[0]), dtype=out_dtype)


def _fake_weight_only_linear(x, weight, weight_scale, bias, group_size) -> Tensor:
    reference.check_weight_only_linear(x, weight, weight_scale, group_size)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_quantize_per_tensor(x: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    reference.check_quantize_per_tensor_int8(x, scale, offset)
    return x.new_empty(x.shape, dtype=torch.int8)


def _fake_w8a8_static_linear(x_q, weight, deq_scale, quant_bias, out_dtype) -> Tensor:
    reference.check_w8a8_static_linear(x_q, weight, deq_scale, quant_bias)
    return x_q.new_empty((*x_q.shape[:-1], weight.shape[0]), dtype=out_dtype)


def _fake_attention(q, k, v, mask, scale) -> tuple[Tensor, Tensor]:
    reference.check_attention(q, k, v)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


_FAKES = {
    "rms_norm": lambda x, weight, eps: _fake_like(x),
    "layer_norm_modulate": _fake_layer_norm_modulate,
    "rope": _fake_rope,
    "gelu_tanh": _fake_like,
    "mul_add": _fake_mul_add,
    "quantize_per_token_int8": _fake_quantize,
    "w8a8_linear": _fake_w8a8_linear,
    "attention": _fake_attention,
    "quantize_per_tensor_int8": _fake_quantize_per_tensor,
    "w8a8_static_linear": _fake_w8a8_static_linear,
    "fp8_quantize_per_token": _fake_fp8_quantize,
    "fp8_linear": _fake_fp8_linear,
    "weight_only_linear": _fake_weight_only_linear,
}


def _recompute_autograd(fn: Callable) -> tuple[Callable, Callable]:
    """(setup_context, backward) that differentiate ``fn`` by running it again under autograd."""

    def setup_context(ctx, inputs, output):
        ctx.is_tensor = [isinstance(a, Tensor) for a in inputs]
        ctx.constants = [None if is_t else a for a, is_t in zip(inputs, ctx.is_tensor, strict=True)]
        ctx.save_for_backward(*(a for a, is_t in zip(inputs, ctx.is_tensor, strict=True) if is_t))

    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        args = [
            next(saved).detach().requires_grad_(need) if is_t else const
            for is_t, const, need in zip(ctx.is_tensor, ctx.constants, ctx.needs_input_grad, strict=True)
        ]
        with torch.enable_grad():
            outputs = fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
        wanted = [a for a, need in zip(args, ctx.needs_input_grad, strict=True) if need]
        if not pairs or not wanted:
            return tuple(None for _ in args)
        got = iter(
            torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        )
        return tuple(next(got) if need else None for need in ctx.needs_input_grad)

    return setup_context, backward


def _no_gradient(name: str) -> tuple[Callable, Callable]:
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{NAMESPACE}::{name} has no gradient: quantized ops are inference-only; run the model under "
            "torch.no_grad() or freeze its parameters"
        )

    return (lambda ctx, inputs, output: None), backward


def _define_ops() -> torch.library.Library:
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        fn = getattr(reference, name)
        lib.define(schema)
        lib.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", _FAKES[name], lib=lib)
        setup_context, backward = _recompute_autograd(fn) if name in _DIFFERENTIABLE else _no_gradient(name)
        torch.library.register_autograd(
            f"{NAMESPACE}::{name}", backward, setup_context=setup_context, lib=lib
        )
    return lib


# Carried over on re-import; see the module docstring.
_LIB: torch.library.Library = globals().get("_LIB") or _define_ops()
# (op, device_type) -> (kernel name, the Library that holds its registration)
_KERNELS: dict[tuple[str, str], tuple[str, torch.library.Library]] = globals().get("_KERNELS", {})

_F = TypeVar("_F", bound=Callable)


def _check_op(op: str, device_type: str) -> None:
    if op not in _SCHEMAS:
        raise KeyError(f"unknown sdkiln op {op!r}; ops: {', '.join(_SCHEMAS)}")
    if device_type not in DISPATCH_KEYS:
        raise ValueError(f"unknown device type {device_type!r}; known: {', '.join(DISPATCH_KEYS)}")


def op_names() -> list[str]:
    """The ops of the ``sdkiln`` namespace."""
    return list(_SCHEMAS)


def register_kernel(op: str, device_type: str, name: str) -> Callable[[_F], _F]:
    """Decorator: make the function ``sdkiln::<op>``'s kernel for tensors on ``device_type``.

    The function takes the schema's arguments in order and must match the reference within the
    tolerances of ``tests/kernels``. One kernel per (op, device type): registering a second one
    raises; ``remove_kernel`` first.
    """
    _check_op(op, device_type)

    def decorator(fn: _F) -> _F:
        if (op, device_type) in _KERNELS:
            raise ValueError(
                f"{NAMESPACE}::{op} already has the {device_type} kernel {_KERNELS[op, device_type][0]!r}; "
                "remove_kernel() it first"
            )
        lib = torch.library.Library(NAMESPACE, "IMPL")
        lib.impl(op, fn, DISPATCH_KEYS[device_type])
        _KERNELS[op, device_type] = (name, lib)
        return fn

    return decorator


def remove_kernel(op: str, device_type: str) -> None:
    """Unregister the kernel of ``op`` for ``device_type``; the reference runs there again."""
    _check_op(op, device_type)
    if (op, device_type) not in _KERNELS:
        raise KeyError(f"{NAMESPACE}::{op} has no {device_type} kernel to remove")
    _, lib = _KERNELS.pop((op, device_type))
    lib._destroy()


def implementation(op: str, device_type: str) -> str:
    """The name of what runs ``sdkiln::<op>`` for tensors on ``device_type``: a kernel or "reference"."""
    _check_op(op, device_type)
    return _KERNELS[op, device_type][0] if (op, device_type) in _KERNELS else "reference"


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last axis, computed in fp32; see ``reference.rms_norm``."""
    return torch.ops.sdkiln.rms_norm.default(x, weight, eps)


def layer_norm_modulate(x: Tensor, scale: Tensor, shift: Tensor, eps: float = 1e-6) -> Tensor:
    """``LayerNorm(x) * (1 + scale) + shift``; scale/shift [B, D] or broadcasting against x."""
    return torch.ops.sdkiln.layer_norm_modulate.default(x, scale, shift, eps)


def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = True) -> Tensor:
    """Rotary embedding of x [B, H, S, D] by cos/sin [S, D]; interleaved pairs or rotate-half."""
    return torch.ops.sdkiln.rope.default(x, cos, sin, interleaved)


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU, tanh approximation, computed in fp32."""
    return torch.ops.sdkiln.gelu_tanh.default(x)


def mul_add(x: Tensor, y: Tensor, z: Tensor) -> Tensor:
    """``x * y + z`` with broadcasting, computed in fp32."""
    return torch.ops.sdkiln.mul_add.default(x, y, z)


def quantize_per_token_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-token int8 quantization: (int8 values like x, fp32 scales [..., 1])."""
    return torch.ops.sdkiln.quantize_per_token_int8.default(x)


def w8a8_linear(
    x_q: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """int8 x int8 linear, exact in int32, dequantized per token and per channel: [..., N]."""
    return torch.ops.sdkiln.w8a8_linear.default(x_q, x_scale, weight, weight_scale, bias, out_dtype)


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention of [B, H, S, D] tensors: (out in q's dtype, fp32 lse [B, H, Sq])."""
    return torch.ops.sdkiln.attention.default(q, k, v, mask, scale)


def quantize_per_tensor_int8(x: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """Asymmetric per-tensor int8 with calibrated ``scale`` and integer ``offset`` (fp32, one value
    each): ``clamp(round(x / scale) + offset, -128, 127)``."""
    return torch.ops.sdkiln.quantize_per_tensor_int8.default(x, scale, offset)


def w8a8_static_linear(
    x_q: Tensor,
    weight: Tensor,
    deq_scale: Tensor,
    quant_bias: Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """int8 x int8 linear with static activation parameters: ``(x_q @ weight.T + quant_bias) * deq_scale``."""
    return torch.ops.sdkiln.w8a8_static_linear.default(x_q, weight, deq_scale, quant_bias, out_dtype)


def fp8_quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-token float8_e4m3fn quantization: (fp8 values like x, fp32 scales [..., 1])."""
    return torch.ops.sdkiln.fp8_quantize_per_token.default(x)


def fp8_linear(
    x_q: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """float8 x float8 linear, exact product, dequantized per token and per channel: [..., N]."""
    return torch.ops.sdkiln.fp8_linear.default(x_q, x_scale, weight, weight_scale, bias, out_dtype)


def weight_only_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None = None, group_size: int = 0
) -> Tensor:
    """Float x [..., K] times int8 [N, K] or packed int4 [N, K/2] weights, per channel (``group_size``
    0) or per group along K: [..., N] in x's dtype."""
    return torch.ops.sdkiln.weight_only_linear.default(x, weight, weight_scale, bias, group_size)
