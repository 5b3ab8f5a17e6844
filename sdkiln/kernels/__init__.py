"""Fused-kernel ops and the platform object. Importing this package registers the ``sdkiln`` ops
(``torch.ops.sdkiln.*``) with their pure-torch references; it imports neither triton nor torch_npu."""

from sdkiln.kernels.ops import (
    attention,
    gelu_tanh,
    implementation,
    layer_norm_modulate,
    mul_add,
    op_names,
    quantize_per_token_int8,
    register_kernel,
    remove_kernel,
    rms_norm,
    rope,
    w8a8_linear,
)
from sdkiln.kernels.platform import Platform, current_platform, resolve_device

__all__ = [
    "Platform",
    "attention",
    "current_platform",
    "gelu_tanh",
    "implementation",
    "layer_norm_modulate",
    "mul_add",
    "op_names",
    "quantize_per_token_int8",
    "register_kernel",
    "remove_kernel",
    "resolve_device",
    "rms_norm",
    "rope",
    "w8a8_linear",
]
