"""Per scheme: a quantized layer's package tensors -> the tensors msModelSlim writes for it.

Our packages already store each quantized layer under Ascend names (``docs/package-format.md``),
so most schemes are a check and a copy. What differs from our runtime's storage is written here,
once per scheme, from msModelSlim's savers (``docs/ascend.md`` cites them):

* every quantized layer's ``bias`` is float32 and tagged ``FLOAT``;
* W8A8 and W8A8_TIMESTEP store ``deq_scale`` and ``quant_bias`` exactly as our runtime does
  (``sdkiln.runtime.quant.w8a8_static`` computes them as msModelSlim does); only ``deq_scale``'s
  form depends on the deployment: float32 for bfloat16, and for float16 the float32 bits held in
  an int64 (msModelSlim's ``deqscale2int64``);
* W4A16 weights are int4 values, one per int8 (MindIE SD packs them itself on load).

A scheme that MindIE SD cannot load is refused with the reason, never written approximately.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sdkiln.errors import PackageError
from sdkiln.kernels.int4 import unpack_int4
from sdkiln.runtime.quant import scheme_classes

FLOAT_TAG = "FLOAT"


@dataclass
class AscendLayer:
    """One quantized layer as the converter sees it: its tensors by suffix (``weight``, ...), the
    manifest's parameters for it, and the float type the model will run in on the NPU."""

    name: str
    tensors: dict[str, Tensor]
    params: dict[str, Any] = field(default_factory=dict)
    deploy_dtype: torch.dtype | None = None

    def take(self, suffix: str, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> Tensor:
        """The tensor ``<layer>.<suffix>``, checked for dtype and (if given) shape."""
        key = f"{self.name}.{suffix}"
        if suffix not in self.tensors:
            raise PackageError(f"{key}: missing from the package's transformer tensors")
        t = self.tensors[suffix]
        if t.dtype != dtype or (shape is not None and tuple(t.shape) != shape):
            raise PackageError(
                f"{key}: expected {dtype} {list(shape) if shape else ''}, got {t.dtype} {list(t.shape)}"
            )
        return t

    def zero_offset(self, suffix: str, shape: tuple[int, ...]) -> Tensor:
        """A symmetric scheme's offset: float32 zeros, as msModelSlim writes them."""
        t = self.take(suffix, torch.float32, shape)
        if bool(t.any()):
            raise PackageError(f"{self.name}.{suffix}: a symmetric scheme's offset must be zeros")
        return t

    @property
    def out_in(self) -> tuple[int, int]:
        w = self.tensors.get("weight")
        if w is None or w.dim() != 2:
            raise PackageError(f"{self.name}.weight: missing or not a 2-D tensor")
        return int(w.shape[0]), int(w.shape[1])

    def bias(self) -> dict[str, tuple[Tensor, str]]:
        """The float bias, float32 and tagged FLOAT as msModelSlim writes it; nothing without one."""
        if "bias" not in self.tensors:
            return {}
        b = self.tensors["bias"]
        if not b.is_floating_point() or tuple(b.shape) != (self.out_in[0],):
            raise PackageError(f"{self.name}.bias: expected a float [N], got {b.dtype} {list(b.shape)}")
        return {"bias": (b.float(), FLOAT_TAG)}


Converter = Callable[[AscendLayer], dict[str, tuple[Tensor, str]]]
CONVERTERS: dict[str, Converter] = {}


def converter(scheme: str) -> Callable[[Converter], Converter]:
    def wrap(fn: Converter) -> Converter:
        if scheme in CONVERTERS:
            raise ValueError(f"an Ascend converter for {scheme} is registered twice")
        CONVERTERS[scheme] = fn
        return fn

    return wrap


def ascend_layer_tensors(scheme: str, layer: AscendLayer) -> dict[str, tuple[Tensor, str]]:
    """``{suffix: (tensor, type tag)}`` for one layer of ``scheme``; PackageError if it has no Ascend form."""
    cls = scheme_classes().get(scheme)
    if cls is not None and cls.ascend_rank is None:  # no MindIE SD / msModelSlim linear format
        raise PackageError(
            f"{layer.name}: scheme {scheme} cannot be exported for Ascend: {cls.ascend_refusal}"
        )
    if scheme not in CONVERTERS:
        raise PackageError(
            f"{layer.name}: scheme {scheme} has no Ascend converter; this sdkiln exports {sorted(CONVERTERS)}"
        )
    return CONVERTERS[scheme](layer)


def pack_deq_scale(deq_scale: Tensor, layer: AscendLayer) -> Tensor:
    """``deq_scale`` as MindIE SD reads it: float32 for bfloat16 models; for float16 models the
    float32 bit pattern read as an int32 and widened to int64 (msModelSlim's ``deqscale2int64``).

    The scales are positive, so the widened value is the fp32 bits in the low 32 bits and zeros above.
    """
    if layer.deploy_dtype not in (torch.bfloat16, torch.float16):
        raise PackageError(
            f"{layer.name}: deq_scale's form depends on the dtype MindIE SD runs the model in (float32 for "
            "bfloat16, int64 for float16) and the package's model is in neither: name it with "
            "`export-ascend --dtype`, `optimize --ascend-dtype` or export_ascend(dtype=...)"
        )
    deq = deq_scale.float().contiguous()
    if not bool(torch.isfinite(deq).all()) or not bool((deq > 0).all()):
        raise PackageError(f"{layer.name}.deq_scale: has non-positive or non-finite values")
    return deq if layer.deploy_dtype == torch.bfloat16 else deq.view(torch.int32).to(torch.int64)


@converter("W8A8_DYNAMIC")
def w8a8_dynamic(layer: AscendLayer) -> dict[str, tuple[Tensor, str]]:
    n, k = layer.out_in
    tag = "W8A8_DYNAMIC"
    return {
        "weight": (layer.take("weight", torch.int8, (n, k)), tag),
        "weight_scale": (layer.take("weight_scale", torch.float32, (n, 1)), tag),
        "weight_offset": (layer.zero_offset("weight_offset", (n, 1)), tag),
        **layer.bias(),
    }


@converter("W8A16")
def w8a16(layer: AscendLayer) -> dict[str, tuple[Tensor, str]]:
    n, k = layer.out_in
    tag = "W8A16"
    return {
        "weight": (layer.take("weight", torch.int8, (n, k)), tag),
        "weight_scale": (layer.take("weight_scale", torch.float32, (n, 1)), tag),
        "weight_offset": (layer.zero_offset("weight_offset", (n, 1)), tag),
        **layer.bias(),
    }


@converter("W4A16")
def w4a16(layer: AscendLayer) -> dict[str, tuple[Tensor, str]]:
    """Our package packs two int4 values a byte (uint8 [N, K/2]); msModelSlim's W4A16 weight is the
    int4 values one per int8 [N, K], which MindIE SD packs for the NPU itself on load."""
    packed = layer.tensors.get("weight")
    if packed is None or packed.dtype != torch.uint8 or packed.dim() != 2:
        raise PackageError(f"{layer.name}.weight: expected packed int4 uint8 [N, K/2]")
    n, k = int(packed.shape[0]), 2 * int(packed.shape[1])
    group_size = int(layer.params.get("group_size", 0))
    if group_size <= 0 or k % group_size:
        raise PackageError(f"{layer.name}: manifest group_size {group_size} does not divide in_features {k}")
    groups = k // group_size
    tag = "W4A16"
    return {
        "weight": (unpack_int4(packed), tag),
        "weight_scale": (layer.take("weight_scale", torch.float32, (n, groups)), tag),
        "weight_offset": (layer.zero_offset("weight_offset", (n, groups)), tag),
        **layer.bias(),
    }


@converter("W8A8")
def w8a8_static(layer: AscendLayer) -> dict[str, tuple[Tensor, str]]:
    n, k = layer.out_in
    tag = "W8A8"
    return {
        "weight": (layer.take("weight", torch.int8, (n, k)), tag),
        "input_scale": (layer.take("input_scale", torch.float32, (1,)), tag),
        "input_offset": (layer.take("input_offset", torch.float32, (1,)), tag),
        "deq_scale": (pack_deq_scale(layer.take("deq_scale", torch.float32, (n,)), layer), tag),
        "quant_bias": (layer.take("quant_bias", torch.int32, (n,)), tag),
        **layer.bias(),
    }


@converter("W8A8_TIMESTEP")
def w8a8_timestep(layer: AscendLayer) -> dict[str, tuple[Tensor, str]]:
    """One static row per denoising step (T = ``num_steps``), every row written; which steps run
    dynamically is MindIE SD's ``TimestepPolicyConfig`` at load time, not part of the files."""
    n, k = layer.out_in
    t = int(layer.params.get("num_steps", 0))
    tag = "W8A8_TIMESTEP"
    return {
        "weight": (layer.take("weight", torch.int8, (n, k)), tag),
        "weight_scale": (layer.take("weight_scale", torch.float32, (n, 1)), tag),
        "weight_offset": (layer.zero_offset("weight_offset", (n, 1)), tag),
        "input_scale": (layer.take("input_scale", torch.float32, (t, 1)), tag),
        "input_offset": (layer.take("input_offset", torch.float32, (t, 1)), tag),
        "deq_scale": (pack_deq_scale(layer.take("deq_scale", torch.float32, (t, n)), layer), tag),
        "quant_bias": (layer.take("quant_bias", torch.int32, (t, n)), tag),
        **layer.bias(),
    }
