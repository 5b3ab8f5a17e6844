"""Which Linear layers a quantization step takes, and swapping them in place: the one layer-selection
helper every quantization transform uses.

A step takes the float Linears inside the spec's transformer blocks, minus the family's float list
(and, for a step that quantizes activations, its weight-only list) and the step's ``exclude`` patterns. A layer that SmoothQuant wrapped in ``SmoothedLinear`` (an
input multiplier in front of it) counts as the layer itself while its inner ``linear`` is still
float: its manifest name stays the original Linear's (the runtime finds a Linear there), patterns
match that name, and the module that is observed and quantized is ``<layer>.linear``. Layers an
earlier step quantized are no longer float and are not taken again, smoothed or not.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from torch import nn

from sdkiln.optimizer.registry import TransformContext
from sdkiln.runtime.quant.smooth import SmoothedLinear


@dataclass(frozen=True)
class Target:
    layer: str
    """The manifest name: the original ``nn.Linear``'s name in the transformer."""
    smoothed: bool
    """SmoothQuant left an input multiplier in front of it (``<layer>.div``)."""

    @property
    def linear(self) -> str:
        """The ``nn.Linear`` whose input is observed and which the quantized module replaces."""
        return f"{self.layer}.linear" if self.smoothed else self.layer


def select_layers(
    ctx: TransformContext,
    exclude: tuple[str, ...] = (),
    *,
    required_by: str | None = None,
    weight_only: bool = False,
) -> tuple[list[Target], list[str]]:
    """(float layers to quantize, layer names kept in float). A smoothed layer may not stay float:
    its ``div`` and ``linear`` have no runtime module without a quantization scheme. With
    ``required_by`` (a recipe step kind), finding no layer is that step's error. A ``weight_only``
    step takes the family's ``weight_only_layers`` too (``ModelSpec``)."""
    prefixes = ctx.spec.block_prefixes()
    chosen, kept, inner = [], [], set()
    for name, module in ctx.transformer.named_modules():
        if name in inner or not name.startswith(prefixes):
            continue
        smoothed = isinstance(module, SmoothedLinear)
        if smoothed:
            inner.add(f"{name}.linear")
            if not isinstance(module.linear, nn.Linear):  # quantized by an earlier step
                continue
        elif not isinstance(module, nn.Linear):
            continue
        if ctx.spec.is_float_layer(name, weight_only) or any(fnmatch.fnmatchcase(name, p) for p in exclude):
            if smoothed:
                raise ValueError(
                    f"{name} was smoothed with an input multiplier but this step keeps it in float; "
                    "give the smoothquant step the same exclude patterns"
                )
            kept.append(name)
        else:
            chosen.append(Target(name, smoothed))
    if required_by is not None and not chosen:
        raise ValueError(
            f"{required_by} found no float Linear layer inside the transformer blocks (outside the family's "
            "float layers and the step's excludes)"
        )
    return chosen, kept


def replace(model: nn.Module, target: Target, module: nn.Module) -> None:
    parent, _, leaf = target.linear.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def manifest_entry(target: Target, module: nn.Module) -> dict[str, Any]:
    """What the runtime needs to rebuild the module before loading its tensors."""
    return {"scheme": module.scheme, **module.params(), **({"smooth": True} if target.smoothed else {})}
