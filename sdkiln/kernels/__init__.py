"""Fused-kernel ops and the platform object. Importing this package registers the ``sdkiln`` ops
(``torch.ops.sdkiln.*``) with their pure-torch references; it imports neither triton nor torch_npu."""

from sdkiln.kernels.ops import (
    attention,
    fp8_linear,
    fp8_quantize_per_token,
    gelu_tanh,
    implementation,
    layer_norm_modulate,
    mul_add,
    op_names,
    quantize_per_tensor_int8,
    quantize_per_token_int8,
    register_kernel,
    remove_kernel,
    rms_norm,
    rope,
    w8a8_linear,
    w8a8_static_linear,
    weight_only_linear,
)
from sdkiln.kernels.platform import Platform, current_platform, resolve_device

__all__ = [
    "Platform",
    "attention",
    "current_platform",
    "fp8_linear",
    "fp8_quantize_per_token",
    "gelu_tanh",
    "implementation",
    "layer_norm_modulate",
    "mul_add",
    "op_names",
    "quantize_per_tensor_int8",
    "quantize_per_token_int8",
    "register_kernel",
    "remove_kernel",
    "resolve_device",
    "rms_norm",
    "rope",
    "w8a8_linear",
    "w8a8_static_linear",
    "weight_only_linear",
]
