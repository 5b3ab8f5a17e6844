"""The int4 storage format: two signed 4-bit values per byte.

A W4A16 weight [N, K] of values in [-8, 7] is stored as uint8 [N, K/2]. Byte ``j`` of a row holds
element ``2j`` in its low nibble (bits 0-3) and element ``2j + 1`` in its high nibble (bits 4-7),
each in two's complement: ``byte = (v[2j] & 0xF) | ((v[2j + 1] & 0xF) << 4)``. This is the
"first element in the low nibble" order of ONNX's int4 and torch's ``quint4x2``, and of the int32
words torch_npu packs eight int4 values into, so a device kernel can reinterpret the bytes rather
than reshuffle them.

The package stores the packed bytes (the weight really is 4-bit on disk); ``unpack_int4`` gives
the int8 [N, K] that Ascend's msModelSlim format and the reference op consume.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT4_MIN, INT4_MAX = -8, 7


def pack_int4(values: Tensor) -> Tensor:
    """int8 values in [-8, 7], shape [..., K] with K even -> uint8 [..., K/2] (low nibble first)."""
    if values.dtype != torch.int8:
        raise ValueError(f"pack_int4: values must be torch.int8, got {values.dtype}")
    if values.shape[-1] % 2:
        raise ValueError(
            f"pack_int4: the last dimension must be even to pack two values a byte, got {values.shape[-1]}"
        )
    if values.numel() and (values.min() < INT4_MIN or values.max() > INT4_MAX):
        raise ValueError(
            f"pack_int4: values must lie in [{INT4_MIN}, {INT4_MAX}], got [{values.min()}, {values.max()}]"
        )
    nibbles = values.view(torch.uint8) & 0xF
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [..., K/2] -> int8 [..., K] in [-8, 7]; the exact inverse of ``pack_int4``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4: packed weights must be torch.uint8, got {packed.dtype}")
    low = (packed & 0xF).view(torch.int8)
    high = (packed >> 4).view(torch.int8)
    # A nibble n in [0, 15] is the two's-complement value n - 16 when its sign bit (8) is set.
    values = torch.stack([low, high], dim=-1).flatten(-2)
    return torch.where(values >= 8, values - 16, values).contiguous()
