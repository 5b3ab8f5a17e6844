"""W8A16 and W4A16: swap block Linears for weight-only quantized modules; activations stay float.

W4A16 quantizes groups of ``group_size`` consecutive inputs, so a layer whose in_features is not a
multiple of the group size cannot take it. Such a layer stays in float, is listed under the step's
``float`` layers (which ``sdkiln inspect`` reports) and, with its in_features, under
``not_divisible``, and the step warns. That keeps one odd-sized layer from failing a whole model;
a step that leaves nothing to quantize is an error.
"""

from __future__ import annotations

import functools
import warnings

from sdkiln.configs import W4A16Config, W8A16Config
from sdkiln.optimizer.layers import block_linears, replace_linears
from sdkiln.optimizer.registry import StepContext, StepResult, register_transform
from sdkiln.runtime.quant.weight_only import W4A16Linear, W8A16Linear


@register_transform(W8A16Config)
def apply_w8a16(ctx: StepContext, config: W8A16Config) -> StepResult:
    chosen, kept = block_linears(ctx, config.exclude)
    if not chosen:
        raise ValueError("w8a16 found no Linear layer to quantize inside the transformer blocks")
    modules = replace_linears(ctx.transformer, chosen, W8A16Linear.from_linear)
    return StepResult(modules=modules, record={"quantized": chosen, "float": kept, "calibration": None})


@register_transform(W4A16Config)
def apply_w4a16(ctx: StepContext, config: W4A16Config) -> StepResult:
    model = ctx.transformer
    candidates, kept = block_linears(ctx, config.exclude)
    in_features = {name: model.get_submodule(name).in_features for name in candidates}
    not_divisible = {name: k for name, k in in_features.items() if k % config.group_size}
    chosen = [name for name in candidates if name not in not_divisible]
    if not chosen:
        why = f": the in_features of all {len(not_divisible)} candidates are not multiples of group_size"
        raise ValueError(
            "w4a16 found no Linear layer to quantize inside the transformer blocks"
            + (f"{why} {config.group_size}" if not_divisible else "")
        )
    if not_divisible:
        names = sorted(not_divisible)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        warnings.warn(
            f"w4a16: {len(names)} layers stay in float because their in_features is not a multiple of "
            f"group_size {config.group_size}: {shown}",
            stacklevel=2,
        )
    build = functools.partial(W4A16Linear.from_linear, group_size=config.group_size)
    modules = replace_linears(model, chosen, build)
    record = {
        "quantized": chosen,
        "float": kept + sorted(not_divisible),
        "not_divisible": not_divisible,
        "group_size": config.group_size,
        "calibration": None,
    }
    return StepResult(modules=modules, record=record)
