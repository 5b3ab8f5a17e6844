"""Fused-kernel ops and the platform object. Importing this package defines the ``sdkiln`` ops
(``torch.ops.sdkiln.*``) with their pure-torch references; it imports neither triton nor torch_npu.
A device's kernels register only through ``load_device_kernels(device_type)``."""

from sdkiln.kernels.ops.attention import attention
from sdkiln.kernels.ops.elementwise import gelu_tanh, mul_add
from sdkiln.kernels.ops.fp8 import fp8_linear, fp8_quantize_per_token
from sdkiln.kernels.ops.fp8_block_attention import fp8_block_attention
from sdkiln.kernels.ops.fused import layer_norm_modulate_quantize, rms_norm_quantize
from sdkiln.kernels.ops.int8 import (
    quantize_per_tensor_int8,
    quantize_per_token_int8,
    w8a8_linear,
    w8a8_linear_from_float,
    w8a8_static_linear,
    w8a8_static_linear_from_float,
)
from sdkiln.kernels.ops.norm import layer_norm_modulate, rms_norm
from sdkiln.kernels.ops.quantized_attention import quantized_attention
from sdkiln.kernels.ops.rope import rope
from sdkiln.kernels.ops.sparse_attention import block_sparse_attention
from sdkiln.kernels.ops.weight_only import weight_only_linear
from sdkiln.kernels.platform import Platform, current_platform, resolve_device
from sdkiln.kernels.registry import (
    composite_names,
    implementation,
    kernel_counts,
    kernels,
    load_device_kernels,
    op_names,
    register_kernel,
    remove_kernel,
    reset_kernel_counts,
)

__all__ = [
    "Platform",
    "attention",
    "block_sparse_attention",
    "composite_names",
    "current_platform",
    "fp8_block_attention",
    "fp8_linear",
    "fp8_quantize_per_token",
    "gelu_tanh",
    "implementation",
    "kernel_counts",
    "kernels",
    "layer_norm_modulate",
    "layer_norm_modulate_quantize",
    "load_device_kernels",
    "mul_add",
    "op_names",
    "quantize_per_tensor_int8",
    "quantize_per_token_int8",
    "quantized_attention",
    "register_kernel",
    "remove_kernel",
    "reset_kernel_counts",
    "resolve_device",
    "rms_norm",
    "rms_norm_quantize",
    "rope",
    "w8a8_linear",
    "w8a8_linear_from_float",
    "w8a8_static_linear",
    "w8a8_static_linear_from_float",
    "weight_only_linear",
]
