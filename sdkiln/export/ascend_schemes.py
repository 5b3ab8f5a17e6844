"""Per scheme: a quantized layer's package tensors -> the tensors msModelSlim writes for it.

Our packages already store each quantized layer under Ascend names (``docs/package-format.md``),
so most schemes are a check and a copy. What differs from our runtime's storage is written here,
once per scheme, from msModelSlim's savers and MindIE SD's loader (``docs/ascend.md`` cites them):

* every quantized layer's ``bias`` is tagged ``FLOAT``: float32 (msModelSlim's form, which MindIE
  SD casts itself), except for a float16 deployment of a weight-only layer, where MindIE SD passes
  the bias as stored and CANN's weight-quant matmul takes only a float16 bias with float16
  activations;
* W8A8 and W8A8_TIMESTEP store ``deq_scale`` and ``quant_bias`` as our runtime does, on the grids
  MindIE SD's casts leave unchanged (``sdkiln.runtime.quant.scales``). A package written before
  those grids has its ``input_scale`` rounded to bfloat16 for a bfloat16 deployment and its
  ``deq_scale`` to fp19 for a float16 one, and ``quant_bias`` recomputed from the rounded values
  (``AscendLayer.regridded`` counts them). ``deq_scale``'s form depends on the deployment: float32
  for bfloat16, and for float16 the float32 bits held in an int64 (msModelSlim's ``deqscale2int64``).

A scheme that MindIE SD cannot load is refused with the reason, never written approximately.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sdkiln.errors import PackageError
from sdkiln.runtime.quant import scheme_classes
from sdkiln.runtime.quant.scales import fp19_nearest
from sdkiln.runtime.quant.w8a8_static import quant_bias

FLOAT_TAG = "FLOAT"
DTYPE_HINT = "name it with `export-ascend --dtype`, `optimize --ascend-dtype` or export_ascend(dtype=...)"


@dataclass
class AscendLayer:
    """One quantized layer as the converter sees it: its tensors by suffix (``weight``, ...), the
    manifest's parameters for it, and the float type the model will run in on the NPU."""

    name: str
    tensors: dict[str, Tensor]
    params: dict[str, Any] = field(default_factory=dict)
    deploy_dtype: torch.dtype | None = None
    regridded: bool = False
    """Its static scales were moved onto the deployment's grid here (a package from before the grids)."""

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

    def bias(self, weight_only: bool = False) -> dict[str, tuple[Tensor, str]]:
        """The float bias tagged FLOAT, nothing without one: float32 as msModelSlim writes it, or
        float16 for a weight-only layer of a float16 deployment (the only bias MindIE SD does not
        cast, and CANN's ``aclnnWeightQuantBatchMatmulV2`` takes a float16 bias with float16 input)."""
        if "bias" not in self.tensors:
            return {}
        b = self.tensors["bias"]
        if not b.is_floating_point() or tuple(b.shape) != (self.out_in[0],):
            raise PackageError(f"{self.name}.bias: expected a float [N], got {b.dtype} {list(b.shape)}")
        if weight_only and self.deploy_dtype is None:
            raise PackageError(
                f"{self.name}: a weight-only layer's bias is float16 for a float16 deployment and float32 "
                f"for bfloat16, and the package's model is in neither: {DTYPE_HINT}"
            )
        fp16 = weight_only and self.deploy_dtype == torch.float16
        return {"bias": (b.to(torch.float16 if fp16 else torch.float32), FLOAT_TAG)}

    def static_scales(self, lead: tuple[int, ...], tag: str) -> dict[str, tuple[Tensor, str]]:
        """W8A8's ``input_scale``, ``input_offset``, ``deq_scale`` and ``quant_bias`` ([*lead, ...]) as
        MindIE SD computes with them: ``input_scale`` bfloat16-exact for a bfloat16 deployment (it
        casts it), ``deq_scale`` fp19-exact for a float16 one (CANN keeps 10 mantissa bits), and
        ``quant_bias`` from those values. A package from this sdkiln is on both grids already.

        ``deq_scale`` is written as MindIE SD reads it: float32 for bfloat16 models; for float16 models
        the float32 bit pattern read as an int32 and widened to int64 (msModelSlim's
        ``deqscale2int64``; the scales are positive, so that is the bits in the low word, zeros above).
        """
        if self.deploy_dtype not in (torch.bfloat16, torch.float16):
            raise PackageError(
                f"{self.name}: deq_scale's form depends on the dtype MindIE SD runs the model in (float32 for "
                f"bfloat16, int64 for float16) and the package's model is in neither: {DTYPE_HINT}"
            )
        n, _ = self.out_in
        scale = self.take("input_scale", torch.float32, (*lead, 1))
        offset = self.take("input_offset", torch.float32, (*lead, 1))
        deq = self.take("deq_scale", torch.float32, (*lead, n))
        qbias = self.take("quant_bias", torch.int32, (*lead, n))
        if not bool(torch.isfinite(deq).all()) or not bool((deq > 0).all()):
            raise PackageError(f"{self.name}.deq_scale: has non-positive or non-finite values")
        bf16 = self.deploy_dtype == torch.bfloat16
        new_scale = scale.to(torch.bfloat16).float() if bf16 else scale
        new_deq = (deq.double() * (new_scale.double() / scale.double())).float()
        new_deq = new_deq if bf16 else fp19_nearest(new_deq)  # unchanged if already on the grid
        if not (torch.equal(new_scale, scale) and torch.equal(new_deq, deq)):
            self.regridded = True
            bias = self.tensors.get("bias")
            qbias = quant_bias(self.take("weight", torch.int8), bias, new_deq, offset)
        return {
            "input_scale": (new_scale, tag),
            "input_offset": (offset, tag),
            "deq_scale": (new_deq if bf16 else new_deq.view(torch.int32).to(torch.int64), tag),
            "quant_bias": (qbias, tag),
        }


Converter = Callable[[AscendLayer], dict[str, tuple[Tensor, str]]]
CONVERTERS: dict[str, Converter] = {}
NEEDS_DEPLOY_DTYPE: set[str] = set()
"""Schemes whose files depend on the dtype MindIE SD runs in (``deq_scale``'s form, a bias dtype)."""


def converter(scheme: str, *, needs_deploy_dtype: bool = False) -> Callable[[Converter], Converter]:
    def wrap(fn: Converter) -> Converter:
        if scheme in CONVERTERS:
            raise ValueError(f"an Ascend converter for {scheme} is registered twice")
        CONVERTERS[scheme] = fn
        if needs_deploy_dtype:
            NEEDS_DEPLOY_DTYPE.add(scheme)
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


@converter("W8A16", needs_deploy_dtype=True)
def w8a16(layer: AscendLayer) -> dict[str, tuple[Tensor, str]]:
    n, k = layer.out_in
    tag = "W8A16"
    return {
        "weight": (layer.take("weight", torch.int8, (n, k)), tag),
        "weight_scale": (layer.take("weight_scale", torch.float32, (n, 1)), tag),
        "weight_offset": (layer.zero_offset("weight_offset", (n, 1)), tag),
        **layer.bias(weight_only=True),
    }


@converter("W8A8", needs_deploy_dtype=True)
def w8a8_static(layer: AscendLayer) -> dict[str, tuple[Tensor, str]]:
    n, k = layer.out_in
    return {
        "weight": (layer.take("weight", torch.int8, (n, k)), "W8A8"),
        **layer.static_scales((), "W8A8"),
        **layer.bias(),
    }


@converter("W8A8_TIMESTEP", needs_deploy_dtype=True)
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
        **layer.static_scales((t,), tag),
        **layer.bias(),
    }
