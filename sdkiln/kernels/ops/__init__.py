"""The ``sdkiln`` ops, one module per op family: schema, checks, pure-torch reference, fake and
wrapper side by side (``elementwise``, ``norm``, ``rope``, ``attention``, ``int8``, ``fp8``,
``weight_only``, ``fused`` (norm + quantize), ``sparse_attention``, ``quantized_attention``, ``fp8_block_attention`` (MindIE SD's FP8 attention arithmetic), ``lora`` (a LoRA branch added to a
layer's output)). Importing this package defines every op (``sdkiln.kernels.registry``).

The references are the CPU implementation, the fallback on any device without a kernel that
supports the arguments, and the oracle that every kernel is tested against. Their numerics
contract, which a kernel must follow to match them:

* Float ops compute in fp32 and round once, to the input's dtype, at the end. In fp32 they equal
  the plain torch formula to within 1e-5; in bf16/fp16 they can be more accurate than eager
  diffusers, which rounds after every op.
* Quantized ops are bit-reproducible: integer parts are exact, and the float steps run in the
  order written in their docstrings, each one correctly rounded (no fused multiply-add, no
  reciprocal in place of a division).
* Outputs are contiguous and never alias an input.
"""

from sdkiln.kernels.ops import (
    attention,
    elementwise,
    fp8,
    fp8_block_attention,
    fused,
    int8,
    lora,
    norm,
    quantized_attention,
    rope,
    sparse_attention,
    weight_only,
)

__all__ = [
    "attention",
    "elementwise",
    "fp8",
    "fp8_block_attention",
    "fused",
    "int8",
    "lora",
    "norm",
    "quantized_attention",
    "rope",
    "sparse_attention",
    "weight_only",
]
