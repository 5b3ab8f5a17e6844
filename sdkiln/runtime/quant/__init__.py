"""Runtime modules that replace ``nn.Linear`` in a quantized transformer, one file per scheme.

A scheme's runtime class is its single source (STYLE habit 16): it subclasses ``QuantLinear`` and
declares what every table used to repeat. Subclassing registers it; ``scheme_classes()`` and
``quant_module(scheme)`` find every scheme module of this package, so the loader's map, quant_auto's
candidates and the Ascend export's ranking are all derived from these classes. Adding a scheme is
one module here, its recipe config (``sdkiln.configs.quant``) and its transform
(``sdkiln.optimizer.quant``); an Ascend converter if MindIE SD has a format for it.

The contract of a ``QuantLinear``:

* ``scheme``: the quant type it runs, as the manifest and msModelSlim name it (``W8A8_DYNAMIC``);
* ``recipe_kind``: the recipe step that applies it to every chosen layer, also quant_auto's name
  for it (``w8a8_dynamic``);
* ``needs_ranges``: it is built from calibrated activation ranges (``ranges`` below); with
  ``needs_step``, per denoising step (it gets a step tracker at run time);
* ``weight_range``: the integer grid of its weight values where GPTQ can round onto it
  (``set_values`` replaces them), None for a scheme without one;
* ``ascend_rank``: its place among msModelSlim's ``model_quant_type`` ranks (fewer bits outrank
  more); None when MindIE SD has no format for it, and ``ascend_refusal`` says why;
* ``__init__(in_features, out_features, bias, dtype, device, **params)``: empty buffers, so the
  runtime can build it on the meta device; ``params`` are the manifest entry's other keys;
* ``from_linear(linear, ranges=None, **params)``: quantize a float Linear (``ranges`` has ``min``,
  ``max``, ``step_min``, ``step_max`` as ``Ranges`` or a calibration observer does); a
  ``ValueError`` means the scheme cannot represent that layer, and says why;
* ``params()``: what the manifest must record to rebuild it (e.g. ``group_size``);
* state-dict names are the Ascend tensor names (``weight``, ``weight_scale``, ``input_scale``, ...).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

_REGISTRY: dict[str, type[QuantLinear]] = {}
_discovered = False


@dataclass(frozen=True)
class Ranges:
    """Calibrated activation ranges: per tensor (``min``, ``max``) and per denoising step
    (``step_min``, ``step_max``, [T] each). ``sdkiln.calibrate``'s observers have the same fields."""

    min: float = 0.0
    max: float = 0.0
    step_min: torch.Tensor | None = None
    step_max: torch.Tensor | None = None


class QuantLinear(nn.Module):
    """Base of the scheme modules; see the package docstring for the contract."""

    scheme: ClassVar[str]
    recipe_kind: ClassVar[str]
    needs_ranges: ClassVar[bool] = False
    needs_step: ClassVar[bool] = False
    weight_range: ClassVar[tuple[int, int] | None] = None
    ascend_rank: ClassVar[int | None] = None
    ascend_refusal: ClassVar[str] = ""
    onnx_form: ClassVar[bool] = False
    """Whether ``sdkiln export-onnx`` writes this scheme (as QDQ, ``sdkiln.export.onnx_ops``)."""
    torchao_config: ClassVar[str | None] = None
    """The torchao config class diffusers' torchao backend represents this scheme with, if any
    (``sdkiln export-diffusers``)."""
    quantizes_activations: ClassVar[bool] = True
    """False for weight-only schemes, which take a family's ``weight_only_layers`` too."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "scheme" not in cls.__dict__:  # an intermediate base, not a scheme
            return
        if _REGISTRY.get(cls.scheme, cls) is not cls:
            raise ValueError(f"scheme {cls.scheme} is registered twice")
        _REGISTRY[cls.scheme] = cls

    def _init_linear(self, in_features: int, out_features: int, bias: bool, dtype, device) -> None:
        self.in_features, self.out_features = in_features, out_features
        if bias:
            self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, ranges: Any = None, **params: Any) -> QuantLinear:
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        return {}

    def set_values(self, values: torch.Tensor) -> None:
        """Replace the integer weight values [N, K] (any dtype holding integers in ``weight_range``),
        keeping the scales: how GPTQ's rounding is stored."""
        raise TypeError(f"{self.scheme} has no integer weight grid to set values on")

    def extra_repr(self) -> str:
        params = "".join(f", {k}={v}" for k, v in self.params().items())
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}{params}"
        )


def _discover() -> None:
    """Import every module of this package once, so each scheme class has registered itself."""
    global _discovered
    if not _discovered:
        for info in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{info.name}")
        _discovered = True


def scheme_classes() -> dict[str, type[QuantLinear]]:
    """Every scheme this sdkiln runs: scheme name -> its runtime class."""
    _discover()
    return dict(_REGISTRY)


def quant_module(scheme: str) -> type[QuantLinear]:
    """The runtime class of ``scheme``; KeyError naming the known schemes if this sdkiln does not run it."""
    classes = scheme_classes()
    if scheme not in classes:
        raise KeyError(
            f"unknown quantization scheme {scheme!r}; this sdkiln runs {', '.join(sorted(classes))}"
        )
    return classes[scheme]


def by_recipe_kind() -> dict[str, type[QuantLinear]]:
    """Recipe step kind -> runtime class (``w8a8_dynamic`` -> ``W8A8DynamicLinear``)."""
    return {cls.recipe_kind: cls for cls in scheme_classes().values()}


__all__ = ["QuantLinear", "Ranges", "by_recipe_kind", "quant_module", "scheme_classes"]
