"""W8A8_DYNAMIC: swap every block Linear (except the family's float list) for ``W8A8Linear``."""

from __future__ import annotations

import fnmatch

from torch import nn

from sdkiln.configs import W8A8DynamicConfig
from sdkiln.optimizer.registry import StepContext, StepResult, register_transform
from sdkiln.runtime.quant.w8a8_dynamic import W8A8Linear


def block_linears(ctx: StepContext, exclude: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """Names of the ``nn.Linear`` layers inside the spec's blocks: (to quantize, kept in float)."""
    prefixes = ctx.spec.block_prefixes()
    chosen, kept = [], []
    for name, module in ctx.transformer.named_modules():
        if not isinstance(module, nn.Linear) or not name.startswith(prefixes):
            continue
        if ctx.spec.is_float_layer(name) or any(fnmatch.fnmatchcase(name, p) for p in exclude):
            kept.append(name)
        else:
            chosen.append(name)
    return chosen, kept


@register_transform(W8A8DynamicConfig)
def apply_w8a8_dynamic(ctx: StepContext, config: W8A8DynamicConfig) -> StepResult:
    model = ctx.transformer
    chosen, kept = block_linears(ctx, config.exclude)
    if not chosen:
        raise ValueError("w8a8_dynamic found no Linear layer to quantize inside the transformer blocks")
    for name in chosen:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, W8A8Linear.from_linear(getattr(parent, leaf)))
    modules = {name: {"scheme": W8A8Linear.scheme} for name in chosen}
    return StepResult(modules=modules, record={"quantized": chosen, "float": kept, "calibration": None})
